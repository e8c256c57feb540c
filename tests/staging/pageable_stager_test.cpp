// The weight pager's pageable stager (src/staging/pageable_stager.hpp) on the CPU: staging
// buffers over host memory, copies emulated by host threads that finish out of order and
// late, so the fill threads, the driver, the witnesses and buffer reuse run under TSan.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "staging/pageable_stager.hpp"
#include "vram/cuda/error.hpp"
#include "vram/testing/witness.hpp"
#include "vram/units.hpp"
#include "vram/upstream.hpp"
#include "vram/weight_pager.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;
using detail::PageableStager;
using detail::PageableStagerOptions;
using detail::StagerJob;

std::byte pattern(std::size_t layer, std::size_t offset) {
  const auto mix = static_cast<std::uint32_t>((layer + 1) * 0x9E3779B1U) ^
                   static_cast<std::uint32_t>(offset * 0x85EBCA6BU);
  return static_cast<std::byte>((mix >> 24) ^ (mix >> 8) ^ mix);
}

struct FenceState {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  void finish() {
    {
      std::lock_guard lock(mutex);
      done = true;
    }
    done_cv.notify_all();
  }
};

// A Completion over a FenceState (copyable handle).
struct HostFence {
  std::shared_ptr<FenceState> state;
  bool ready() const {
    std::lock_guard lock(state->mutex);
    return state->done;
  }
  void wait() {
    std::unique_lock lock(state->mutex);
    state->done_cv.wait(lock, [&] { return state->done; });
  }
};

// The "copy stream": worker threads that take copies in any order, each after a random
// delay. A copy snapshots its staging bytes, sleeps, checks they did not change (a refill
// before the copy completed would change them: every chunk's pattern differs), copies, and
// only then completes its fence. copy() also refuses (counts) a staging buffer handed over
// while an earlier copy from it is still in flight.
class HostCopyTarget final : public detail::StagedCopyTarget {
 public:
  struct Options {
    unsigned workers = 3;
    unsigned max_delay_us = 200;
    bool lie = false;  // the fence completes at once, the copy "runs" on: the checker's control
    std::size_t fail_at_copy = 0;  // 1-based: copy() throws on that call; 0: never
    bool fail_bind = false;
    bool in_order = false;  // FIFO (with one worker: a CUDA stream's order)
    bool held = false;      // no copy starts (or completes) until open()
  };

  explicit HostCopyTarget(Options options) : options_(options) {
    for (unsigned i = 0; i < options_.workers; ++i) {
      workers_.emplace_back([this, i] { work(i); });
    }
  }
  ~HostCopyTarget() override {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  void bind_thread() override {
    driver_ = std::this_thread::get_id();
    if (options_.fail_bind) throw std::runtime_error("fake: cudaSetDevice failed");
  }

  void begin(const StagerJob& job) override {
    on_driver();
    std::lock_guard lock(mutex_);
    if (job.ticket <= last_ticket_) ++out_of_order_jobs_;
    last_ticket_ = job.ticket;
    current_.clear();
  }

  PendingCopy copy(std::byte* device, PooledStaging& staging) override {
    on_driver();
    auto fence = std::make_shared<FenceState>();
    {
      std::lock_guard lock(mutex_);
      if (++copies_ == options_.fail_at_copy) throw std::runtime_error("fake: copy failed");
      if (in_flight_[staging.data()]++ != 0) ++reused_in_flight_;
      current_.push_back(fence);
    }
    if (options_.lie) {  // copy now (no race on the bytes), stay "in flight" a while
      std::memcpy(device, staging.data(), staging.len());
      enqueue(Task{device, staging.data(), staging.len(), nullptr, fence});
      auto done = std::make_shared<FenceState>();
      done->done = true;
      return WitnessMint::host_copy(staging, HostFence{done});
    }
    enqueue(Task{device, staging.data(), staging.len(), fence, nullptr});
    return WitnessMint::host_copy(staging, HostFence{fence});
  }

  void end(const StagerJob& job) override {
    on_driver();
    std::lock_guard lock(mutex_);
    ready_[job.slot] = Ready{job.ticket, current_};
    current_.clear();
  }

  // The host side of "the slot's ready event": blocks until the copies of job `ticket`
  // completed. Call after the stager's wait_issued(slot, ticket).
  void wait_ready(std::size_t slot, std::uint64_t ticket) {
    std::vector<std::shared_ptr<FenceState>> fences;
    {
      std::lock_guard lock(mutex_);
      auto found = ready_.find(slot);
      ASSERT_NE(found, ready_.end());
      ASSERT_EQ(found->second.ticket, ticket);
      fences = found->second.fences;
    }
    for (auto& fence : fences) HostFence{fence}.wait();
  }

  // Lets the copies of a `held` target run.
  void open() {
    {
      std::lock_guard lock(mutex_);
      options_.held = false;
    }
    wake_.notify_all();
  }

  // Blocks until no copy is in flight (workers idle, queue empty).
  void quiesce() {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [&] { return tasks_.empty() && running_ == 0; });
  }

  std::size_t reused_in_flight() const { return reused_in_flight_.load(); }
  std::size_t refilled_during_copy() const { return refilled_during_copy_.load(); }
  std::size_t off_driver_calls() const { return off_driver_.load(); }
  std::size_t out_of_order_jobs() const {
    std::lock_guard lock(mutex_);
    return out_of_order_jobs_;
  }
  std::size_t copies() const {
    std::lock_guard lock(mutex_);
    return copies_;
  }
  std::size_t in_flight() const {
    std::lock_guard lock(mutex_);
    std::size_t total = 0;
    for (const auto& [pointer, count] : in_flight_) total += count;
    return total;
  }

 private:
  struct Task {
    std::byte* device;
    const std::byte* staging;
    std::size_t bytes;
    std::shared_ptr<FenceState> fence;  // null: lying mode, the fence already completed
    std::shared_ptr<FenceState> unused;
  };
  struct Ready {
    std::uint64_t ticket = 0;
    std::vector<std::shared_ptr<FenceState>> fences;
  };

  void on_driver() {
    if (std::this_thread::get_id() != driver_) ++off_driver_;
  }

  void enqueue(Task task) {
    {
      std::lock_guard lock(mutex_);
      tasks_.push_back(std::move(task));
    }
    wake_.notify_one();
  }

  void work(unsigned seed) {
    std::minstd_rand random(seed * 7919U + 1);
    std::vector<std::byte> snapshot;
    for (;;) {
      Task task;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || (!tasks_.empty() && !options_.held); });
        if (tasks_.empty()) return;
        // Out of order: take any queued copy, not the oldest.
        const std::size_t pick = options_.in_order ? 0 : random() % tasks_.size();
        task = std::move(tasks_[pick]);
        tasks_.erase(tasks_.begin() + static_cast<std::ptrdiff_t>(pick));
        ++running_;
      }
      const auto delay = std::chrono::microseconds(random() % (options_.max_delay_us + 1));
      if (task.fence) {
        snapshot.assign(task.staging, task.staging + task.bytes);
        std::this_thread::sleep_for(delay);
        if (std::memcmp(snapshot.data(), task.staging, task.bytes) != 0) ++refilled_during_copy_;
        std::memcpy(task.device, task.staging, task.bytes);
      } else {
        std::this_thread::sleep_for(delay);
      }
      {
        std::lock_guard lock(mutex_);
        --in_flight_[task.staging];  // before the fence: a reuse after it is legitimate
        --running_;
      }
      if (task.fence) task.fence->finish();
      idle_.notify_all();
    }
  }

  Options options_;
  std::thread::id driver_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::deque<Task> tasks_;
  std::size_t running_ = 0;
  bool stop_ = false;
  std::size_t copies_ = 0;
  std::uint64_t last_ticket_ = 0;
  std::size_t out_of_order_jobs_ = 0;
  std::map<const std::byte*, std::size_t> in_flight_;
  std::vector<std::shared_ptr<FenceState>> current_;
  std::map<std::size_t, Ready> ready_;
  std::atomic<std::size_t> reused_in_flight_{0};
  std::atomic<std::size_t> refilled_during_copy_{0};
  std::atomic<std::size_t> off_driver_{0};
  std::vector<std::thread> workers_;  // last: started after everything they use exists
};

struct Layers {
  std::vector<std::vector<std::byte>> data;
  Layers(std::size_t count, std::size_t base, std::size_t step) {
    std::vector<std::size_t> sizes;
    for (std::size_t layer = 0; layer < count; ++layer) sizes.push_back(base + layer * step);
    fill(sizes);
  }
  explicit Layers(const std::vector<std::size_t>& sizes) { fill(sizes); }
  void fill(const std::vector<std::size_t>& sizes) {
    for (std::size_t layer = 0; layer < sizes.size(); ++layer) {
      data.emplace_back(sizes[layer]);
      for (std::size_t i = 0; i < data.back().size(); ++i) data.back()[i] = pattern(layer, i);
    }
  }
  std::size_t largest() const {
    std::size_t most = 0;
    for (const auto& layer : data) most = std::max(most, layer.size());
    return most;
  }
};

struct StressCase {
  std::size_t layers;
  std::size_t base_bytes;
  std::size_t step_bytes;
  std::size_t chunk_bytes;
  std::size_t staging_buffers;
  unsigned fill_threads;
  std::size_t slots;
  std::size_t depth;  // jobs queued ahead of the one verified (< slots)
  int rounds;
  std::vector<std::size_t> sizes{};  // non-empty: the layers' sizes (layers, base, step unused)
  std::size_t piece_bytes = 0;       // the fill threads' piece; 0: the stager's default
};

// The pager's use: layer i of each round into slot i % slots, up to `depth` page-ins ahead
// of the layer being "acquired" (verified); a slot is refilled only after its previous layer
// was verified (its "release").
void run_stress(const StressCase& c, HostCopyTarget::Options copy_options) {
  const Layers layers =
      c.sizes.empty() ? Layers(c.layers, c.base_bytes, c.step_bytes) : Layers(c.sizes);
  const std::size_t layer_count = layers.data.size();
  const std::size_t slot_bytes = layers.largest();
  std::vector<std::byte> device(c.slots * slot_bytes, std::byte{0xEE});
  HostCopyTarget target(copy_options);
  std::size_t expected_copies = 0;
  {
    PageableStager stager(
        target, PageableStagerOptions{.slot_count = c.slots,
                                      .chunk_bytes = c.chunk_bytes,
                                      .staging_buffers = c.staging_buffers,
                                      .fill_threads = c.fill_threads,
                                      .staging_upstream = std::make_shared<HostMemoryUpstream>(),
                                      .fill_piece_bytes = c.piece_bytes});
    const std::size_t total = layer_count * static_cast<std::size_t>(c.rounds);
    std::vector<std::uint64_t> tickets(total, 0);
    std::uint64_t next_ticket = 0;
    std::size_t queued = 0;
    auto enqueue = [&](std::size_t n) {
      const std::size_t layer = n % layer_count;
      const std::size_t slot = n % c.slots;
      std::byte* at = device.data() + slot * slot_bytes;
      std::fill(at, at + slot_bytes, std::byte{0xEE});  // its previous layer was verified
      tickets[n] = ++next_ticket;
      stager.enqueue(StagerJob{slot, at, layers.data[layer].data(), layers.data[layer].size(),
                               tickets[n], 0, nullptr});
      expected_copies += (layers.data[layer].size() + c.chunk_bytes - 1) / c.chunk_bytes;
    };
    for (std::size_t n = 0; n < total; ++n) {
      while (queued < total && queued <= n + c.depth) enqueue(queued++);
      const std::size_t layer = n % layer_count;
      const std::size_t slot = n % c.slots;
      stager.wait_issued(slot, tickets[n]);
      target.wait_ready(slot, tickets[n]);
      const std::byte* at = device.data() + slot * slot_bytes;
      const auto& want = layers.data[layer];
      ASSERT_EQ(std::memcmp(at, want.data(), want.size()), 0)
          << "layer " << layer << " in slot " << slot << ", page-in " << n;
      if (want.size() < slot_bytes) {
        ASSERT_EQ(at[want.size()], std::byte{0xEE}) << "bytes written past layer " << layer;
      }
    }
    stager.drain();
    EXPECT_EQ(stager.pins_after_load(), 0U) << "every chunk reused a staging buffer";
    EXPECT_EQ(stager.pool_stats().witness_mismatches, 0U);
    if (expected_copies > 1) {
      EXPECT_GE(stager.max_chunks_ahead(), 2U) << "fills never ran ahead of the copy queue";
    }
  }  // stop(): waits for the last copies and retires their buffers
  EXPECT_EQ(target.in_flight(), 0U) << "the stager stopped with copies still reading staging";
  EXPECT_EQ(target.copies(), expected_copies);
  EXPECT_EQ(target.reused_in_flight(), 0U) << "a staging buffer was handed over in flight";
  EXPECT_EQ(target.refilled_during_copy(), 0U) << "a staging buffer was refilled mid-copy";
  EXPECT_EQ(target.out_of_order_jobs(), 0U);
  EXPECT_EQ(target.off_driver_calls(), 0U);
}

TEST(PageableStager, StressManySmallChunksEveryByteAndNoRefillBeforeTheCopyCompleted) {
  // Chunks of 8 KiB, layers of 5-100 KiB: thousands of buffer reuses, copies out of order.
  for (std::size_t buffers : {2U, 3U}) {
    SCOPED_TRACE("staging_buffers " + std::to_string(buffers));
    run_stress(StressCase{.layers = 48,
                          .base_bytes = 5_KiB + 3,
                          .step_bytes = 2_KiB + 1,
                          .chunk_bytes = 8_KiB,
                          .staging_buffers = buffers,
                          .fill_threads = 3,
                          .slots = 4,
                          .depth = 3,
                          .rounds = 3},
               HostCopyTarget::Options{.workers = 3, .max_delay_us = 100});
  }
}

TEST(PageableStager, StressLargeChunksSplitOverTheFillThreads) {
  // Chunks of 2 MiB: each is filled in two pieces of 1 MiB by the fill threads.
  run_stress(StressCase{.layers = 6,
                        .base_bytes = 3_MiB + 5,
                        .step_bytes = 300_KiB + 7,
                        .chunk_bytes = 2_MiB,
                        .staging_buffers = 3,
                        .fill_threads = 4,
                        .slots = 3,
                        .depth = 2,
                        .rounds = 2},
             HostCopyTarget::Options{.workers = 2, .max_delay_us = 300});
}

TEST(PageableStager, StressMixedSmallAndLargePageInsPipelineAcrossJobs) {
  // A Mixtral-style layer scaled down: four attention pieces (2-8 "MiB" -> 2-8 KiB plus odd
  // bytes) and one joined expert piece (168 -> 168 KiB), chunks of 16 KiB in 16 buffers,
  // pieces of 1 KiB (a chunk is filled by several threads at once, several chunks at
  // once), page-ins queued up to 9 ahead through 10 slots: the fills of the next page-ins
  // run while earlier copies are in flight, out of order and late.
  std::vector<std::size_t> sizes;
  for (std::size_t layer = 0; layer < 4; ++layer) {
    for (std::size_t piece : {2_KiB + 3, 8_KiB + 1, 4_KiB, 6_KiB + 7}) sizes.push_back(piece);
    sizes.push_back(168_KiB + 5 + layer);
  }
  for (unsigned threads : {1U, 4U}) {
    SCOPED_TRACE("fill_threads " + std::to_string(threads));
    run_stress(StressCase{.layers = 0,
                          .base_bytes = 0,
                          .step_bytes = 0,
                          .chunk_bytes = 16_KiB,
                          .staging_buffers = 16,
                          .fill_threads = threads,
                          .slots = 10,
                          .depth = 9,
                          .rounds = 3,
                          .sizes = sizes,
                          .piece_bytes = 1_KiB},
               HostCopyTarget::Options{.workers = 3, .max_delay_us = 100});
  }
  // Many tiny page-ins (each below one piece and one chunk), a CUDA stream's FIFO order.
  run_stress(StressCase{.layers = 40,
                        .base_bytes = 300,
                        .step_bytes = 61,
                        .chunk_bytes = 4_KiB,
                        .staging_buffers = 5,
                        .fill_threads = 3,
                        .slots = 6,
                        .depth = 5,
                        .rounds = 4,
                        .piece_bytes = 512},
             HostCopyTarget::Options{.workers = 1, .max_delay_us = 50, .in_order = true});
}

TEST(PageableStager, FillsRunAheadOfCopiesButNoBufferIsReusedBeforeItsCopyCompleted) {
  // The copies are held (none completes): the stager fills and queues page-in 1, 2, 3, 4
  // (one chunk each) into the 4 buffers without waiting for any copy, page-in 1's copy
  // still in flight, and then dispatches nothing more: chunk 5 needs a buffer, which only
  // a completed copy gives back. Opened, everything arrives intact.
  constexpr std::size_t kJobs = 12;
  const Layers layers(kJobs, 3_KiB + 1, 257);
  std::vector<std::vector<std::byte>> device(kJobs);
  for (std::size_t i = 0; i < kJobs; ++i) device[i].assign(layers.data[i].size(), {});
  HostCopyTarget target(HostCopyTarget::Options{.workers = 2, .max_delay_us = 50, .held = true});
  {
    PageableStager stager(
        target, PageableStagerOptions{.slot_count = kJobs,
                                      .chunk_bytes = 8_KiB,
                                      .staging_buffers = 4,
                                      .fill_threads = 3,
                                      .staging_upstream = std::make_shared<HostMemoryUpstream>(),
                                      .fill_piece_bytes = 1_KiB});
    for (std::size_t i = 0; i < kJobs; ++i) {
      stager.enqueue(StagerJob{i, device[i].data(), layers.data[i].data(), layers.data[i].size(),
                               i + 1, 0, nullptr});
    }
    for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(stager.wait_issued(i, i + 1) >= 0, true);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    EXPECT_EQ(target.copies(), 4U) << "a buffer was refilled before its copy completed";
    EXPECT_EQ(target.in_flight(), 4U);
    target.open();
    for (std::size_t i = 0; i < kJobs; ++i) {
      (void)stager.wait_issued(i, i + 1);
      target.wait_ready(i, i + 1);
      ASSERT_EQ(device[i], layers.data[i]) << "job " << i;
    }
    EXPECT_EQ(stager.pins_after_load(), 0U);
  }
  EXPECT_EQ(target.copies(), kJobs);
  EXPECT_EQ(target.in_flight(), 0U);
  EXPECT_EQ(target.reused_in_flight(), 0U);
  EXPECT_EQ(target.refilled_during_copy(), 0U);
  EXPECT_EQ(target.out_of_order_jobs(), 0U);
  EXPECT_EQ(target.off_driver_calls(), 0U);
}

TEST(PageableStager, CheckerCatchesABufferReusedBeforeItsCopyCompleted) {
  // The control: a target whose witnesses lie (complete before the copy does). The stager
  // then reuses buffers still "in flight", and the checker of the stress tests must see it.
  const Layers layers(1, 256_KiB, 0);
  std::vector<std::byte> device(256_KiB);
  HostCopyTarget target(HostCopyTarget::Options{.workers = 1, .max_delay_us = 2000, .lie = true});
  {
    PageableStager stager(
        target, PageableStagerOptions{.slot_count = 1,
                                      .chunk_bytes = 4_KiB,
                                      .staging_buffers = 2,
                                      .fill_threads = 1,
                                      .staging_upstream = std::make_shared<HostMemoryUpstream>()});
    stager.enqueue(StagerJob{0, device.data(), layers.data[0].data(), 256_KiB, 1, 0, nullptr});
    stager.wait_issued(0, 1);
  }
  target.quiesce();
  EXPECT_GT(target.reused_in_flight(), 0U);
  EXPECT_EQ(std::memcmp(device.data(), layers.data[0].data(), device.size()), 0);
}

// The pager end to end on the staged path: a PagerDevice whose page-ins go through the
// PageableStager (the CUDA device's ticket scheme, host copies in stream order), driven by
// the real plan and schedule with prefetch, so prefetched, evicted and re-paged slots run
// concurrently with the fill threads and copies.
struct StagedHostReport {
  bool staged = false;
  bool shut_down = false;
  std::size_t in_flight_at_shutdown = 0;
  std::size_t violations = 0;
};

class StagedHostPagerDevice final : public PagerDevice {
 public:
  explicit StagedHostPagerDevice(std::shared_ptr<StagedHostReport> report)
      : report_(std::move(report)) {}
  std::string pin_host(std::span<const HostRange>, std::size_t, WeightPagerLoad&) override {
    return "fake: staged";
  }
  void* allocate_arena(std::size_t bytes) override {
    arena_.assign(bytes, std::byte{0xEE});
    return arena_.data();
  }
  void upload(void* device, const void* host, std::size_t bytes) override {
    std::memcpy(device, host, bytes);
  }
  void configure(std::size_t slots, bool staged, const WeightPagerOptions& options) override {
    report_->staged = staged;
    wanted_.assign(slots, 0);
    target_ = std::make_unique<HostCopyTarget>(
        HostCopyTarget::Options{.workers = 1, .max_delay_us = 50, .in_order = true});
    stager_ = std::make_unique<PageableStager>(
        *target_,
        PageableStagerOptions{.slot_count = slots,
                              .chunk_bytes = options.staging_chunk_bytes,
                              .staging_buffers = options.staging_buffers,
                              .fill_threads = options.fill_threads,
                              .staging_upstream = std::make_shared<HostMemoryUpstream>()});
  }
  void page_in(std::size_t slot, void* device, const void* host, std::size_t bytes) override {
    wanted_[slot] = ++tickets_;
    stager_->enqueue(StagerJob{slot, static_cast<std::byte*>(device),
                               static_cast<const std::byte*>(host), bytes, wanted_[slot], 0,
                               nullptr});
  }
  void wait_ready(std::size_t slot, cudaStream_t) override {
    (void)stager_->wait_issued(slot, wanted_[slot]);
    target_->wait_ready(slot, wanted_[slot]);
  }
  void record_release(std::size_t, cudaStream_t) override {}  // the host "compute" is done
  void collect(WeightPagerStats& stats) override {
    stats.staging_pin_calls = stager_->pins_after_load();
  }
  void synchronize() override {
    stager_->drain();
    target_->quiesce();
  }
  void shutdown(void*, std::size_t) noexcept override {
    if (stager_) stager_->stop();
    if (target_) {
      target_->quiesce();
      report_->in_flight_at_shutdown = target_->in_flight();
      report_->violations = target_->reused_in_flight() + target_->refilled_during_copy();
    }
    report_->shut_down = true;
    stager_.reset();
  }

 private:
  std::shared_ptr<StagedHostReport> report_;
  std::vector<std::byte> arena_;
  std::vector<std::uint64_t> wanted_;
  std::uint64_t tickets_ = 0;
  std::unique_ptr<HostCopyTarget> target_;
  std::unique_ptr<PageableStager> stager_;
};

TEST(PageableStager, StressWeightPagerPageableEndToEndWithPrefetch) {
  const Layers layers(16, 20_KiB + 5, 3_KiB + 3);
  std::vector<WeightLayer> list;
  for (std::size_t i = 0; i < layers.data.size(); ++i) {
    list.push_back({"layer." + std::to_string(i), layers.data[i].data(), layers.data[i].size()});
  }
  for (std::size_t depth : {1U, 2U, 3U}) {
    SCOPED_TRACE("prefetch_depth " + std::to_string(depth));
    auto report = std::make_shared<StagedHostReport>();
    {
      WeightPager pager(list,
                        WeightPagerOptions{
                            .plan = {.budget_bytes = 8 * layers.largest(), .prefetch_depth = depth},
                            .host = HostWeights::pageable,
                            .staging_chunk_bytes = 8_KiB,
                            .staging_buffers = 2,
                            .fill_threads = 2,
                            .print_plan_warnings = false},
                        std::make_unique<StagedHostPagerDevice>(report));
      ASSERT_TRUE(report->staged);
      ASSERT_GT(pager.plan().streamed_layers(), 4U);
      for (int step = 0; step < 4; ++step) {
        for (std::size_t i = 0; i < layers.data.size(); ++i) {
          const void* at = pager.acquire(i, nullptr);
          ASSERT_EQ(std::memcmp(at, layers.data[i].data(), layers.data[i].size()), 0)
              << "layer " << i << " step " << step;
          pager.release(i, nullptr);
        }
      }
      const auto stats = pager.stats();
      EXPECT_GT(stats.prefetches, 0U);
      EXPECT_EQ(stats.staging_pin_calls, 0U);
      EXPECT_FALSE(pager.load().pinned);
    }  // destroyed while the last prefetches may still be staging
    EXPECT_TRUE(report->shut_down);
    EXPECT_EQ(report->in_flight_at_shutdown, 0U);
    EXPECT_EQ(report->violations, 0U);
  }
}

TEST(PageableStager, StressStopWhileStagingIssuesWhatWasQueuedAndWaitsForItsCopies) {
  // 60 jobs through 2 slots (a queue of 8: enqueue blocks on a full queue), slow copies,
  // then the stager is destroyed at once: stop() must issue the queued jobs, wait for every
  // copy still reading a staging buffer, and return.
  const Layers layers(60, 9_KiB + 1, 97);
  std::vector<std::vector<std::byte>> device(layers.data.size());
  for (std::size_t i = 0; i < device.size(); ++i) device[i].assign(layers.data[i].size(), {});
  HostCopyTarget target(HostCopyTarget::Options{.workers = 2, .max_delay_us = 300});
  {
    PageableStager stager(
        target, PageableStagerOptions{.slot_count = 2,
                                      .chunk_bytes = 4_KiB,
                                      .staging_buffers = 3,
                                      .fill_threads = 2,
                                      .staging_upstream = std::make_shared<HostMemoryUpstream>()});
    for (std::size_t i = 0; i < layers.data.size(); ++i) {
      stager.enqueue(StagerJob{i % 2, device[i].data(), layers.data[i].data(),
                               layers.data[i].size(), i + 1, 0, nullptr});
    }
  }
  EXPECT_EQ(target.in_flight(), 0U);
  for (std::size_t i = 0; i < device.size(); ++i) {
    ASSERT_EQ(device[i], layers.data[i]) << "job " << i;
  }
  EXPECT_EQ(target.reused_in_flight(), 0U);
  EXPECT_EQ(target.refilled_during_copy(), 0U);
  EXPECT_EQ(target.out_of_order_jobs(), 0U);
}

TEST(PageableStager, BadInputAndEnqueueAfterStopThrowAndChangeNothing) {
  HostCopyTarget target(HostCopyTarget::Options{.workers = 1, .max_delay_us = 0});
  std::vector<std::byte> host(10_KiB, std::byte{7});
  std::vector<std::byte> device(10_KiB);
  PageableStager stager(
      target, PageableStagerOptions{.slot_count = 2,
                                    .chunk_bytes = 4_KiB,
                                    .staging_buffers = 2,
                                    .fill_threads = 1,
                                    .staging_upstream = std::make_shared<HostMemoryUpstream>()});
  EXPECT_THROW(stager.enqueue(StagerJob{2, device.data(), host.data(), host.size(), 1, 0, nullptr}),
               InvalidArgument);
  stager.enqueue(StagerJob{1, device.data(), host.data(), host.size(), 1, 0, nullptr});
  EXPECT_GE(stager.wait_issued(1, 1), 0.0);
  target.wait_ready(1, 1);
  EXPECT_EQ(device, host);
  EXPECT_EQ(target.copies(), 3U);
  stager.stop();
  EXPECT_THROW(stager.enqueue(StagerJob{0, device.data(), host.data(), host.size(), 2, 0, nullptr}),
               InvalidArgument);
  stager.stop();  // idempotent
  EXPECT_EQ(target.in_flight(), 0U);
}

TEST(PageableStager, AFailedCopyIsRethrownToEveryWaiterAndStopStillWaits) {
  HostCopyTarget target(
      HostCopyTarget::Options{.workers = 2, .max_delay_us = 200, .fail_at_copy = 5});
  const Layers layers(4, 12_KiB, 0);
  std::vector<std::byte> device(4 * 12_KiB);
  {
    PageableStager stager(
        target, PageableStagerOptions{.slot_count = 4,
                                      .chunk_bytes = 4_KiB,
                                      .staging_buffers = 2,
                                      .fill_threads = 1,
                                      .staging_upstream = std::make_shared<HostMemoryUpstream>()});
    // Job 1: copies 1-3, issued; job 2: copies 4-6, the 5th fails.
    stager.enqueue(StagerJob{0, device.data(), layers.data[0].data(), 12_KiB, 1, 0, nullptr});
    EXPECT_GE(stager.wait_issued(0, 1), 0.0);
    stager.enqueue(
        StagerJob{1, device.data() + 12_KiB, layers.data[1].data(), 12_KiB, 2, 0, nullptr});
    EXPECT_THROW((void)stager.wait_issued(1, 2), std::runtime_error);
    EXPECT_THROW(stager.drain(), std::runtime_error);
    EXPECT_THROW(stager.enqueue(StagerJob{2, device.data() + 2 * 12_KiB, layers.data[2].data(),
                                          12_KiB, 3, 0, nullptr}),
                 std::runtime_error);
    EXPECT_THROW((void)stager.wait_issued(0, 1), std::runtime_error) << "the stager stays failed";
  }
  EXPECT_EQ(target.copies(), 5U) << "nothing issued after the failure";
  EXPECT_EQ(target.in_flight(), 0U) << "stop() waited for the copies issued before it";
  EXPECT_EQ(target.reused_in_flight(), 0U);
}

TEST(PageableStager, AFailureToBindTheDriverThreadIsRethrown) {
  HostCopyTarget target(HostCopyTarget::Options{.workers = 1, .fail_bind = true});
  std::vector<std::byte> host(4_KiB), device(4_KiB);
  PageableStager stager(
      target, PageableStagerOptions{.slot_count = 1,
                                    .chunk_bytes = 4_KiB,
                                    .staging_buffers = 2,
                                    .fill_threads = 1,
                                    .staging_upstream = std::make_shared<HostMemoryUpstream>()});
  // The failure may land before or after this enqueue; either way the waiter sees it.
  try {
    stager.enqueue(StagerJob{0, device.data(), host.data(), host.size(), 1, 0, nullptr});
  } catch (const std::runtime_error&) {
  }
  EXPECT_THROW((void)stager.wait_issued(0, 1), std::runtime_error);
  EXPECT_EQ(target.copies(), 0U);
}

}  // namespace
}  // namespace vram::testing
