// src/staging/pageable_stager.hpp (internal): the weight pager's pageable path, without CUDA.
//
// Page-in jobs are cut into chunks (at most chunk_bytes, each job from its own start) and
// every chunk into pieces (at most fill_piece_bytes). The chunks flow through a ring of
// `staging_buffers` pinned buffers as one pipeline that spans consecutive jobs:
//
//   dispatch (driver)  -> fill (fill threads, piece by piece) -> copy queued (driver)
//                      -> copy observed complete, buffer retired (driver) -> dispatch ...
//
// Chunk number s (counted over all jobs) is staged in ring_[s % B], B = staging_buffers.
// The driver dispatches chunk s as soon as its buffer's previous chunk (s - B) was retired,
// whatever job s belongs to: the fills of page-in N+1 run while page-in N's copies are in
// flight (or still being filled). The fill threads take pieces from the oldest dispatched
// chunk first, several chunks at once; a thread that is descheduled holds up one piece,
// not the whole pool. The driver queues chunk s's copy as soon as its last piece is filled
// (in chunk order: the copy stream is FIFO, and a job's begin()/end() bracket its copies).
// acquire() on the compute thread waits only until the copy of the layer it needs has been
// issued (wait_issued).
//
// The seam: everything CUDA (the device thread binding, the copy stream, slot events,
// timing) lives behind StagedCopyTarget; the pager's CUDA device implements it in
// src/pager/pager_device.cpp, the CPU tests with host threads and host-fenced copies. One
// virtual call per chunk (a chunk is megabytes: milliseconds of DMA), none per byte; the
// fill threads never call the target.
//
// Invariants (the sequence numbers are chunk numbers, all under mutex_)
//   retired_seq_ <= issue_seq_ <= fill_seq_ <= dispatch_seq_ <= retired_seq_ + B
//   - [retired_seq_, issue_seq_): filled, copy queued, buffer not yet given back.
//   - [issue_seq_, dispatch_seq_): dispatched, being filled or filled and waiting its turn.
//   - fill_seq_: the oldest chunk with pieces not yet claimed (dispatch_seq_: none).
//   REUSE: a staging buffer is written (dispatch, then fill) only after retire() gave its
//   previous lease back to the PinnedStagingPool with the CopyCompleted witness of the copy
//   that read it, i.e. after the host observed that copy complete (dispatch_seq_ <
//   retired_seq_ + B, and the pool itself hands out retired buffers only). retire() runs
//   in chunk order on the driver thread; a chunk's buffer is never retired while a fill
//   thread writes it (it is retired only after its copy, which is queued only once every
//   piece was filled).
//   - ring_[i]'s lease and copy (the optional members) are touched by the driver thread
//     only (and by stop() after the driver and the fill threads were joined); the fill
//     threads see a chunk's raw pointers and piece counters, under mutex_.
//   - Jobs are issued in enqueue order; issued_[slot] is the latest ticket of that slot
//     whose copies were all queued (or skipped after a failure, which is then rethrown).
//   - After the first failure no copy is queued and no chunk dispatched; unclaimed pieces
//     are dropped, the driver waits for the pieces being filled, every waiter gets the
//     failure rethrown.
//   - stop() issues what is queued, joins the driver (which returns only with no piece
//     being filled), joins the fill threads, then waits for the last copies.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "parallel_copy.hpp"
#include "vram/copy.hpp"
#include "vram/cuda/error.hpp"
#include "vram/pinned_staging_pool.hpp"
#include "vram/upstream.hpp"

namespace vram::detail {

struct StagerJob {
  std::size_t slot = 0;
  std::byte* device = nullptr;
  const std::byte* host = nullptr;
  std::size_t bytes = 0;
  std::uint64_t ticket = 0;       // > 0, increasing over all jobs
  std::size_t release_count = 0;  // the target's business: releases to wait for
  void* context = nullptr;        // the target's business (the CUDA pager: a timing sample)
};

// Where the staged copies go. All calls come from the stager's driver thread, in order:
// bind_thread() once, then per job begin(), copy() per chunk, end().
class StagedCopyTarget {
 public:
  virtual ~StagedCopyTarget() = default;
  virtual void bind_thread() = 0;
  // Order the job's copies after what must precede them (the slot's releases).
  virtual void begin(const StagerJob& job) = 0;
  // Queue a copy of staging.bytes() to `device`, issued through the lease (so its witness
  // can retire the buffer).
  virtual PendingCopy copy(std::byte* device, PooledStaging& staging) = 0;
  // Mark the slot ready after the job's copies.
  virtual void end(const StagerJob& job) = 0;
};

// The hardware threads, at most 16: the fill is memory-bound and scales to about that.
inline unsigned default_fill_threads() noexcept {
  return std::min(16U, std::max(1U, std::thread::hardware_concurrency()));
}

struct PageableStagerOptions {
  std::size_t slot_count = 0;
  std::size_t chunk_bytes = std::size_t{32} << 20;
  std::size_t staging_buffers = 3;
  unsigned fill_threads = 0;                   // 0: default_fill_threads()
  bool streaming_fill = false;                 // non-temporal stores (streaming_copy)
  std::shared_ptr<Upstream> staging_upstream;  // null: page-locked host memory
  std::size_t fill_piece_bytes = 0;            // 0: 1 MiB; what one fill thread takes at once
};

class PageableStager {
 public:
  static constexpr std::size_t kMinChunk = 4096;
  static constexpr std::size_t kDefaultPiece = std::size_t{1} << 20;
  static constexpr std::size_t kMinPiece = 256;

  // Throws vram::InvalidArgument (no slots, null target), vram::PinningError (staging).
  PageableStager(StagedCopyTarget& target, const PageableStagerOptions& options)
      : target_(target),
        chunk_(checked_chunk(options)),
        piece_(std::max(kMinPiece,
                        options.fill_piece_bytes != 0 ? options.fill_piece_bytes : kDefaultPiece)),
        streaming_(options.streaming_fill),
        pool_(make_pool(options)),
        ring_(std::max<std::size_t>(2, options.staging_buffers)),
        queue_(2 * options.slot_count + 8),
        issued_(options.slot_count, 0) {
    pool_.reserve(ring_.size(), chunk_);  // pinned now, at load: none per page-in
    pins_at_load_ = pool_.stats().pin_calls;
    // Fill threads the system cannot start are done without; with none, the driver fills.
    const unsigned fillers =
        options.fill_threads != 0 ? options.fill_threads : default_fill_threads();
    try {
      fillers_.reserve(fillers);
      for (unsigned i = 0; i < fillers; ++i) fillers_.emplace_back([this] { fill_loop(); });
    } catch (const std::exception&) {  // std::system_error, std::bad_alloc: fewer threads
    }
    try {
      driver_ = std::thread([this] { loop(); });
    } catch (...) {
      stop_fillers();
      throw;
    }
  }
  PageableStager(const PageableStager&) = delete;
  PageableStager& operator=(const PageableStager&) = delete;
  ~PageableStager() { stop(); }

  // Queues a job; blocks while the queue is full. Rethrows the stager's first failure.
  // Throws vram::InvalidArgument after stop() and for a slot out of range.
  void enqueue(const StagerJob& job) {
    if (job.slot >= issued_.size()) {
      throw InvalidArgument("vram::detail::PageableStager: slot " + std::to_string(job.slot) +
                            " out of range (" + std::to_string(issued_.size()) + " slots).");
    }
    {
      std::unique_lock lock(mutex_);
      // A fixed ring (no allocation per page-in); full only if the compute thread queued
      // more page-ins than it ever waited for: it waits for the stager to issue one.
      changed_.wait(lock, [&] { return queued_ < queue_.size() || failure_ || stopping_; });
      if (failure_) std::rethrow_exception(failure_);
      if (stopping_) throw InvalidArgument("vram::detail::PageableStager: enqueue after stop.");
      queue_[(head_ + queued_++) % queue_.size()] = Queued{job};
    }
    driver_wake_.notify_one();
  }

  // Blocks until the page-in `ticket` of `slot` has been issued. Returns the milliseconds
  // waited (0 when it already was). Rethrows the stager's first failure.
  double wait_issued(std::size_t slot, std::uint64_t ticket) {
    std::unique_lock lock(mutex_);
    if (failure_) std::rethrow_exception(failure_);
    if (issued_.at(slot) >= ticket) return 0;
    const auto start = std::chrono::steady_clock::now();
    changed_.wait(lock, [&] { return issued_[slot] >= ticket || failure_ != nullptr; });
    if (failure_) std::rethrow_exception(failure_);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
        .count();
  }

  // Blocks until every queued job has been issued.
  void drain() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return queued_ == 0 || failure_ != nullptr; });
    if (failure_) std::rethrow_exception(failure_);
  }

  std::uint64_t pins_after_load() const { return pool_.stats().pin_calls - pins_at_load_; }
  PinnedStagingStats pool_stats() const { return pool_.stats(); }
  // The most chunks ever dispatched ahead of the oldest copy not yet queued (being filled
  // or filled and waiting): > 1 means fills overlapped each other (across chunks and jobs).
  std::size_t max_chunks_ahead() const {
    std::lock_guard lock(mutex_);
    return max_ahead_;
  }
  std::size_t fill_threads() const noexcept { return fillers_.size(); }

  void stop() noexcept {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    driver_wake_.notify_all();
    changed_.notify_all();
    if (driver_.joinable()) driver_.join();  // returns with no piece being filled
    stop_fillers();
    // The last copies still read their buffers: retire each with its witness (or, if the
    // wait fails, the PendingCopy destructor waits and the buffer is freed, not reused). A
    // lease with no copy (dispatched, never issued after a failure) is freed: no fill
    // thread writes it any more (joined).
    for (std::size_t n = 0; n < ring_.size(); ++n) {
      Buffer& buffer = ring_[(retired_seq_ + n) % ring_.size()];  // oldest copy first
      try {
        retire(buffer);
      } catch (const std::exception& error) {
        std::fprintf(stderr, "vram::WeightPager: waiting for a staged copy failed: %s\n",
                     error.what());
        buffer.copy.reset();
        buffer.staging.reset();
      }
    }
  }

 private:
  static constexpr std::size_t kMaxStagingBuffers = 64;
  static constexpr unsigned kMaxFillThreads = 256;
  // The driver's poll period while it needs a buffer whose copy is in flight and fills are
  // running (so it must also see their completions): a copy of a chunk takes far longer.
  static constexpr auto kRetirePoll = std::chrono::microseconds(50);

  // The chunk size, after the options are checked (first, before anything is made).
  static std::size_t checked_chunk(const PageableStagerOptions& options) {
    const std::size_t chunk = std::max(kMinChunk, options.chunk_bytes);
    const std::size_t buffers = std::max<std::size_t>(2, options.staging_buffers);
    if (buffers > kMaxStagingBuffers || chunk > SIZE_MAX / buffers) {
      throw InvalidArgument("vram::WeightPager: staging_buffers " +
                            std::to_string(options.staging_buffers) + " of " +
                            std::to_string(chunk) +
                            " bytes: more than the 64 buffers (or the address space) staging "
                            "can use. Fix: 2 (double) or 3 (triple buffering).");
    }
    if (options.fill_threads > kMaxFillThreads) {
      throw InvalidArgument("vram::WeightPager: fill_threads " +
                            std::to_string(options.fill_threads) +
                            " is more than 256. Fix: 0 picks the hardware threads, at most 16.");
    }
    return chunk;
  }

  static PinnedStagingPool make_pool(const PageableStagerOptions& options) {
    const std::size_t buffers = std::max<std::size_t>(2, options.staging_buffers);
    const PinnedStagingPool::Options bounds{
        .max_buffers = buffers, .max_bytes = buffers * std::max(kMinChunk, options.chunk_bytes)};
    if (options.staging_upstream) return PinnedStagingPool(options.staging_upstream, bounds);
    return PinnedStagingPool(bounds);
  }

  struct Queued {
    StagerJob job;
    std::size_t planned = 0;  // bytes dispatched as chunks
    std::size_t copied = 0;   // bytes whose copies were queued
    bool begun = false;       // target_.begin() called
  };

  // ---- THE ONE PLACE that uses the copy-witness API (copy.hpp, pinned_staging_pool.hpp):
  // Buffer, retire() and the lease/copy lines of dispatch() and issue_chunk(). The rest of
  // the stager sees "a ring of buffers, each refilled after its previous copy completed".
  struct Buffer {
    // Driver thread only (stop() after the joins): the lease and the copy that reads it.
    std::optional<PooledStaging> staging;  // the pinned buffer, while a copy may read it
    std::optional<PendingCopy> copy;       // the copy that reads it, until its witness
    // The chunk staged in it, under mutex_ (the fill threads read them).
    std::uint64_t seq = 0;
    std::byte* data = nullptr;  // staging->data(), for the fill threads
    std::byte* device = nullptr;
    const std::byte* host = nullptr;
    std::size_t bytes = 0;
    std::size_t pieces = 0;      // ceil(bytes / piece_)
    std::size_t next_piece = 0;  // the next piece to claim
    std::size_t unfilled = 0;    // pieces not yet filled (claimed or not)
  };

  // Back to the pool, proven after the copy that read it: wait() is a host wait on the
  // driver thread (never the compute thread, never a fill thread).
  static void retire(Buffer& buffer) {
    if (buffer.copy) buffer.staging->retire(std::move(*buffer.copy).wait());
    buffer.copy.reset();
    buffer.staging.reset();
  }
  // ---- end of the witness-API spot (plus the two marked lines below).

  Queued& queued_at(std::size_t index) { return queue_[(head_ + index) % queue_.size()]; }
  Buffer& buffer_of(std::uint64_t seq) { return ring_[seq % ring_.size()]; }

  // Under mutex_: dispatches chunks while a job has bytes not yet dispatched and the next
  // buffer was retired (REUSE). Returns whether it dispatched any.
  bool dispatch() {
    bool any = false;
    while (!failure_ && plan_index_ < queued_ && dispatch_seq_ < retired_seq_ + ring_.size()) {
      Queued& q = queued_at(plan_index_);
      if (q.planned == q.job.bytes) {  // fully dispatched (or zero bytes)
        ++plan_index_;
        continue;
      }
      Buffer& buffer = buffer_of(dispatch_seq_);
      // REUSE: chunk dispatch_seq_ - B, the buffer's previous one, was retired (its copy
      // observed complete); the pool hands out retired buffers only.
      const std::size_t length = std::min(chunk_, q.job.bytes - q.planned);
      buffer.staging.emplace(pool_.acquire(length));  // witness-API: best fit, no pin
      buffer.seq = dispatch_seq_;
      buffer.data = buffer.staging->data();
      buffer.device = q.job.device + q.planned;
      buffer.host = q.job.host + q.planned;
      buffer.bytes = length;
      buffer.pieces = (length + piece_ - 1) / piece_;
      buffer.next_piece = 0;
      buffer.unfilled = buffer.pieces;
      q.planned += length;
      if (q.planned == q.job.bytes) ++plan_index_;
      ++dispatch_seq_;
      max_ahead_ = std::max<std::size_t>(max_ahead_, dispatch_seq_ - issue_seq_);
      any = true;
    }
    return any;
  }

  // Under mutex_: claims the next piece of the oldest chunk with pieces unclaimed.
  bool claim(std::byte*& to, const std::byte*& from, std::size_t& bytes, std::uint64_t& seq) {
    if (fill_seq_ == dispatch_seq_) return false;
    Buffer& buffer = buffer_of(fill_seq_);
    const std::size_t offset = buffer.next_piece * piece_;
    to = buffer.data + offset;
    from = buffer.host + offset;
    bytes = std::min(piece_, buffer.bytes - offset);
    seq = fill_seq_;
    // Advance at once: fill_seq_ never names a chunk whose pieces are all claimed, so the
    // buffer it names is never one reused for a later chunk.
    if (++buffer.next_piece == buffer.pieces) ++fill_seq_;
    ++filling_;
    return true;
  }

  void fill_piece(std::byte* to, const std::byte* from, std::size_t bytes) const {
    if (streaming_) {
      streaming_copy(to, from, bytes);  // fenced: visible before the unlock that publishes it
    } else {
      std::memcpy(to, from, bytes);
    }
  }

  // Under mutex_ (lock held by `lock`): one piece filled.
  void filled(std::uint64_t seq) {
    --filling_;
    Buffer& buffer = buffer_of(seq);  // still chunk `seq`: not issued, so not retired
    if (--buffer.unfilled == 0 || (filling_ == 0 && (failure_ || stopping_))) {
      driver_wake_.notify_one();
    }
  }

  // Claims the next piece and fills it with `lock` (mutex_) released; false when no piece
  // was left to claim.
  bool fill_one(std::unique_lock<std::mutex>& lock) {
    std::byte* to = nullptr;
    const std::byte* from = nullptr;
    std::size_t bytes = 0;
    std::uint64_t seq = 0;
    if (!claim(to, from, bytes, seq)) return false;
    lock.unlock();
    fill_piece(to, from, bytes);
    lock.lock();
    filled(seq);
    return true;
  }

  void fill_loop() {
    std::unique_lock lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return fillers_stop_ || fill_seq_ != dispatch_seq_; });
      if (fillers_stop_) return;
      while (fill_one(lock)) {
      }
    }
  }

  void stop_fillers() noexcept {
    {
      std::lock_guard lock(mutex_);
      fillers_stop_ = true;
    }
    work_.notify_all();
    for (auto& filler : fillers_) {
      if (filler.joinable()) filler.join();
    }
  }

  // Under mutex_: after the first failure, nothing more is filled or issued. Drops the
  // unclaimed pieces and marks every queued job issued (skipped: waiters rethrow).
  void abandon_queue() {
    fill_seq_ = dispatch_seq_;
    for (std::size_t i = 0; i < queued_; ++i) {
      const StagerJob& job = queued_at(i).job;
      issued_[job.slot] = std::max(issued_[job.slot], job.ticket);
    }
    head_ = (head_ + queued_) % queue_.size();
    queued_ = 0;
    plan_index_ = 0;
  }

  void fail(std::exception_ptr failure) {
    std::lock_guard lock(mutex_);
    if (!failure_) failure_ = failure;
    abandon_queue();
    changed_.notify_all();
  }

  void loop() {
    try {
      target_.bind_thread();
    } catch (...) {
      fail(std::current_exception());
    }
    try {
      drive();
    } catch (...) {
      fail(std::current_exception());
      std::unique_lock lock(mutex_);
      // The exit rule of drive(): no piece being filled once the driver returns.
      driver_wake_.wait(lock, [&] { return stopping_ && filling_ == 0; });
    }
  }

  void drive() {
    std::unique_lock lock(mutex_);
    for (;;) {
      if (failure_) abandon_queue();
      if (dispatch()) work_.notify_all();  // one wake per batch of chunks, not per job

      // The oldest job: begin(), each chunk's copy as soon as it is filled, end().
      if (queued_ > 0 && !failure_) {
        Queued& front = queued_at(0);
        if (!front.begun) {
          front.begun = true;
          const StagerJob job = front.job;
          lock.unlock();
          target_.begin(job);
          lock.lock();
          continue;
        }
        if (front.copied == front.job.bytes) {  // every copy queued (or zero bytes)
          const StagerJob job = front.job;
          lock.unlock();
          target_.end(job);
          lock.lock();
          head_ = (head_ + 1) % queue_.size();
          --queued_;
          plan_index_ -= plan_index_ > 0 ? 1 : 0;
          issued_[job.slot] = std::max(issued_[job.slot], job.ticket);
          changed_.notify_all();
          continue;
        }
        if (issue_seq_ < dispatch_seq_ && buffer_of(issue_seq_).unfilled == 0) {
          Buffer& buffer = buffer_of(issue_seq_);
          lock.unlock();
          // Every piece was filled (the fill threads published them under mutex_): queue
          // the copy through the lease, whose witness alone can retire the buffer.
          buffer.copy.emplace(target_.copy(buffer.device, *buffer.staging));  // witness-API
          lock.lock();
          front.copied += buffer.bytes;
          ++issue_seq_;
          continue;
        }
      }

      // Dispatch waits for a buffer: retire the oldest once its copy completed (in chunk
      // order). Blocking only when no fill runs (nothing else for the driver to see).
      const bool wants_buffer =
          !failure_ && plan_index_ < queued_ && dispatch_seq_ == retired_seq_ + ring_.size();
      if (wants_buffer && retired_seq_ < issue_seq_) {
        Buffer& oldest = buffer_of(retired_seq_);
        const bool idle_fills = fill_seq_ == dispatch_seq_ && filling_ == 0 &&
                                (issue_seq_ == dispatch_seq_ || fillers_.empty());
        lock.unlock();
        const bool done = idle_fills || oldest.copy->ready();
        if (done) retire(oldest);  // REUSE: the witness of the copy that read it
        lock.lock();
        if (done) {
          ++retired_seq_;
          continue;
        }
      }

      // No fill threads: the driver fills the pieces itself.
      if (fillers_.empty() && !failure_) {
        if (fill_one(lock)) continue;
      }

      // Stopping: everything queued was issued (or dropped after a failure) and no piece
      // is being filled (stop() then frees or retires the buffers).
      if (stopping_ && queued_ == 0 && filling_ == 0) return;

      if (wants_buffer && retired_seq_ < issue_seq_) {
        driver_wake_.wait_for(lock, kRetirePoll);  // fills complete or the copy does
      } else {
        driver_wake_.wait(lock);  // a fill completes, a job arrives, stop()
      }
    }
  }

  StagedCopyTarget& target_;
  const std::size_t chunk_;
  const std::size_t piece_;
  const bool streaming_;
  PinnedStagingPool pool_;
  std::vector<Buffer> ring_;
  std::uint64_t pins_at_load_ = 0;

  mutable std::mutex mutex_;
  std::condition_variable changed_;      // the compute thread: issued, queue space, failure
  std::condition_variable driver_wake_;  // the driver: jobs, filled chunks, stop
  std::condition_variable work_;         // the fill threads: chunks dispatched, stop
  std::vector<Queued> queue_;            // ring: queued_ jobs from head_, until issued
  std::size_t head_ = 0;
  std::size_t queued_ = 0;
  std::size_t plan_index_ = 0;  // queue index of the first job not fully dispatched
  std::vector<std::uint64_t> issued_;
  std::uint64_t retired_seq_ = 0;
  std::uint64_t issue_seq_ = 0;
  std::uint64_t fill_seq_ = 0;
  std::uint64_t dispatch_seq_ = 0;
  std::size_t filling_ = 0;  // pieces being filled now
  std::size_t max_ahead_ = 0;
  bool stopping_ = false;
  bool fillers_stop_ = false;
  std::exception_ptr failure_;
  std::vector<std::thread> fillers_;
  std::thread driver_;  // last: started after everything it uses exists
};

}  // namespace vram::detail
