// src/pageable_stager.hpp (internal): the weight pager's pageable path, without CUDA.
//
// A driver thread takes page-in jobs in order, fills pinned staging buffers from pageable
// host memory with a ParallelCopy (several host threads), in chunks, and hands each filled
// buffer to a StagedCopyTarget, which queues its copy to the device. The buffers form a
// ring of `staging_buffers`: a buffer is refilled only after retire() gave it back to the
// PinnedStagingPool with the CopyCompleted witness of the copy that read it, i.e. after
// the host observed that copy complete. acquire() on the compute thread waits only until
// the copy of the layer it needs has been issued (wait_issued).
//
// The seam: everything CUDA (the device thread binding, the copy stream, slot events,
// timing) lives behind StagedCopyTarget; the pager's CUDA device implements it in
// src/cuda/pager_device.cpp, the CPU tests with host threads and host-fenced copies. One virtual
// call per chunk (a chunk is megabytes: milliseconds of DMA), none per byte.
//
// Invariants
//   - Jobs are issued in enqueue order; issued[slot] is the latest ticket of that slot
//     whose copies were all queued (or skipped after a failure, which is then rethrown).
//   - ring_[i] holds at most one lease and the one copy that reads it; stage_chunk()
//     retires it (waits for that copy, on the driver thread) before refilling it.
//   - After the first failure no job is issued; every waiter gets the failure rethrown.
//   - stop() issues what is queued, joins the driver, then waits for the last copies.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
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
  bool streaming_fill = false;                 // ParallelCopy's non-temporal stores
  std::shared_ptr<Upstream> staging_upstream;  // null: page-locked host memory
};

class PageableStager {
 public:
  static constexpr std::size_t kMinChunk = 4096;

  // Throws vram::InvalidArgument (no slots, null target), vram::PinningError (staging).
  PageableStager(StagedCopyTarget& target, const PageableStagerOptions& options)
      : target_(target),
        chunk_(checked_chunk(options)),
        pool_(make_pool(options)),
        ring_(std::max<std::size_t>(2, options.staging_buffers)),
        queue_(2 * options.slot_count + 4),
        issued_(options.slot_count, 0),
        fill_(options.fill_threads != 0 ? options.fill_threads : default_fill_threads(),
              options.streaming_fill) {
    pool_.reserve(ring_.size(), chunk_);  // pinned now, at load: none per page-in
    pins_at_load_ = pool_.stats().pin_calls;
    driver_ = std::thread([this] { loop(); });
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
      // more page-ins than it ever waited for: it waits for the stager to take one.
      changed_.wait(lock, [&] { return queued_ < queue_.size() || failure_ || stopping_; });
      if (failure_) std::rethrow_exception(failure_);
      if (stopping_) throw InvalidArgument("vram::detail::PageableStager: enqueue after stop.");
      queue_[(head_ + queued_++) % queue_.size()] = job;
    }
    changed_.notify_all();
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
    changed_.wait(lock, [&] { return (queued_ == 0 && !issuing_) || failure_ != nullptr; });
    if (failure_) std::rethrow_exception(failure_);
  }

  std::uint64_t pins_after_load() const { return pool_.stats().pin_calls - pins_at_load_; }
  PinnedStagingStats pool_stats() const { return pool_.stats(); }

  void stop() noexcept {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      stopping_ = true;
    }
    changed_.notify_all();
    if (driver_.joinable()) driver_.join();
    // The last copies still read their buffers: retire each with its witness (or, if the
    // wait fails, the PendingCopy destructor waits and the buffer is freed, not reused).
    for (auto& buffer : ring_) {
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

  void loop() {
    try {
      target_.bind_thread();
    } catch (...) {
      std::lock_guard lock(mutex_);
      failure_ = std::current_exception();
    }
    for (;;) {
      StagerJob job{};
      bool failed = false;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stopping_ || queued_ > 0; });
        if (queued_ == 0) return;  // stopping, and nothing left to issue
        job = queue_[head_];
        head_ = (head_ + 1) % queue_.size();
        --queued_;
        issuing_ = true;
        failed = failure_ != nullptr;
      }
      std::exception_ptr failure;
      if (!failed) {
        try {
          issue(job);
        } catch (...) {
          failure = std::current_exception();
        }
      }
      {
        std::lock_guard lock(mutex_);
        if (failure && !failure_) failure_ = failure;
        issued_[job.slot] = std::max(issued_[job.slot], job.ticket);
        issuing_ = false;
      }
      changed_.notify_all();
    }
  }

  void issue(const StagerJob& job) {
    target_.begin(job);
    for (std::size_t offset = 0; offset < job.bytes; offset += chunk_) {
      const std::size_t length = std::min(chunk_, job.bytes - offset);
      stage_chunk(ring_[next_++ % ring_.size()], job.device + offset, job.host + offset, length);
    }
    target_.end(job);
  }

  // ---- THE ONE PLACE that uses the copy-witness API (copy.hpp, pinned_staging_pool.hpp):
  // Buffer, retire() and stage_chunk(). The rest of the stager sees "a ring of buffers,
  // each refilled after its previous copy completed".
  struct Buffer {
    std::optional<PooledStaging> staging;  // the pinned buffer, while a copy may read it
    std::optional<PendingCopy> copy;       // the copy that reads it, until its witness
  };

  // Back to the pool, proven after the copy that read it: wait() is a host wait on the
  // driver thread (never the compute thread) for a copy issued staging_buffers chunks ago.
  static void retire(Buffer& buffer) {
    if (buffer.copy) buffer.staging->retire(std::move(*buffer.copy).wait());
    buffer.copy.reset();
    buffer.staging.reset();
  }

  // Fills one chunk into a staging buffer (reused only after retire()) and queues its copy.
  // With staging_buffers >= 2 the fill overlaps earlier chunks' copies.
  void stage_chunk(Buffer& buffer, std::byte* device, const std::byte* host, std::size_t bytes) {
    retire(buffer);
    buffer.staging.emplace(pool_.acquire(bytes));  // best fit: a retired buffer, no pin
    fill_.run(buffer.staging->data(), host, bytes);
    buffer.copy.emplace(target_.copy(device, *buffer.staging));
  }
  // ---- end of the witness-API spot.

  StagedCopyTarget& target_;
  std::size_t chunk_;
  PinnedStagingPool pool_;
  std::vector<Buffer> ring_;
  std::size_t next_ = 0;
  std::uint64_t pins_at_load_ = 0;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<StagerJob> queue_;  // ring: queued_ jobs from head_
  std::size_t head_ = 0;
  std::size_t queued_ = 0;
  std::vector<std::uint64_t> issued_;
  bool issuing_ = false;
  bool stopping_ = false;
  std::exception_ptr failure_;
  ParallelCopy fill_;
  std::thread driver_;  // last: started after everything it uses exists
};

}  // namespace vram::detail
