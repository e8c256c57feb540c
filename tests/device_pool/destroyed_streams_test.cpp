// Streams the caller destroys: a stream synchronized and then destroyed (as a request
// handler does when done) never has a marker recorded on it later, and its freed blocks
// reach other streams only after its work completed (a marker recorded by one of its own
// calls, or a device-wide quiesce). Host-only with an emulated device (StreamLifetimeFence:
// work runs when its stream is synchronized, records on destroyed streams are counted);
// on a GPU with kernels that write and check owner tags.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "emulated_device.hpp"
#include "gpu_test_policy.hpp"
#include "steady_stream.hpp"
#include "test_fences.hpp"
#include "test_upstreams.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/device_pool.hpp"
#include "vram/units.hpp"
#include "vram/upstream.hpp"
#ifdef VRAM_HAVE_TEST_KERNELS
#include "test_kernels.hpp"
#endif

namespace vram::testing {
namespace {

using namespace vram::literals;

// s1 frees a block, synchronizes and is destroyed; s2 then needs the memory past the
// growth budget. A young s1 (a stream per request) recorded a marker in its free, which has
// completed: s2 gets the block with no quiesce. A steady s1 recorded none: the pool quiesces
// (once) instead of recording on s1, and s2 gets the block.
TEST(DevicePoolDestroyedStreams, AStreamDestroyedAfterSynchronizingIsNeverRecordedOn) {
  for (const bool virtual_memory : {true, false}) {
    for (const bool steady : {false, true}) {
      SCOPED_TRACE(virtual_memory ? "virtual memory" : "segments");
      SCOPED_TRACE(steady ? "s1 steady" : "s1 young");
      auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
      auto fence = std::make_shared<StreamLifetimeFence>();
      auto options = emulated(fence, virtual_memory);
      options.large_tier.segment_bytes = 4_MiB;  // a 4 MiB block fills its segment
      {
        DevicePool pool(upstream, options);
        const cudaStream_t s2 = fence->create();
        void* b = pool.allocate_async(4_MiB, s2);
        const cudaStream_t s1 = fence->create();
        if (steady) free_often_on(pool, s1);
        void* a = pool.allocate_async(4_MiB, s1);
        const std::uint64_t markers = pool.stats().stream_markers;
        pool.deallocate_async(a, 4_MiB, s1);
        EXPECT_EQ(pool.stats().stream_markers, markers + (steady ? 0 : 1));
        fence->synchronize(s1);
        fence->destroy(s1);
        const std::size_t reserved = pool.stats().bytes_reserved;
        void* c = pool.allocate_async(4_MiB, s2);
        EXPECT_EQ(fence->records_on_destroyed(), 0U) << "a marker on the destroyed s1";
        EXPECT_EQ(c, a) << "s1's block, after its marker or the quiesce";
        EXPECT_EQ(pool.stats().stream_quiesces, steady ? 1U : 0U);
        EXPECT_EQ(fence->quiesces(), steady ? 1U : 0U);
        EXPECT_LE(pool.stats().bytes_reserved, reserved) << "nothing new taken";
        pool.deallocate_async(b, 4_MiB, s2);
        pool.deallocate_async(c, 4_MiB, s2);
        fence->synchronize(s2);
        fence->destroy(s2);
        pool.trim(0);
        EXPECT_EQ(fence->records_on_destroyed(), 0U) << "trim recorded on a destroyed stream";
        EXPECT_EQ(pool.stats().bytes_in_use, 0U);
      }
      EXPECT_EQ(fence->records_on_destroyed(), 0U) << "destruction recorded on a destroyed stream";
      EXPECT_EQ(upstream->live_bytes(), 0U);
      EXPECT_EQ(upstream->bad_frees(), 0U);
    }
  }
}

// Within the budget and below the peak of reserved bytes, a request on s2 only wants s1's
// marker; s1's next call records it (one marker for all of s1's earlier frees), and once
// s1's work has run a third stream reuses s1's block with no quiesce.
TEST(DevicePoolDestroyedStreams, AWantedMarkerIsRecordedByTheStreamsNextCall) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<StreamLifetimeFence>();
  auto options = emulated(fence, true);
  options.growth_headroom = 1.0;  // s2's growth stays within the budget
  DevicePool pool(upstream, options);
  const cudaStream_t s1 = fence->create();
  const cudaStream_t s2 = fence->create();
  const cudaStream_t s3 = fence->create();
  pool.deallocate(pool.allocate(16_MiB), 16_MiB);
  pool.trim(0);  // the peak of reserved bytes stays 16 MiB
  ASSERT_EQ(pool.stats().bytes_reserved, 0U);
  const std::uint64_t quiesces = pool.stats().quiesces;
  free_often_on(pool, s1);  // steady: its frees record nothing of their own
  fence->synchronize(s1);
  const std::uint64_t records = fence->records();
  void* keep = pool.allocate_async(4_MiB, s2);
  void* a = pool.allocate_async(4_MiB, s1);
  pool.deallocate_async(a, 4_MiB, s1);
  void* b = pool.allocate_async(4_MiB, s2);
  EXPECT_NE(b, a) << "s1's work may still use a";
  EXPECT_EQ(fence->records(), records) << "nothing recorded on s1 inside a call on s2";
  EXPECT_EQ(pool.stats().stream_marker_wants, 1U);
  void* t = pool.allocate_async(256, s1);  // s1's next call records its marker
  EXPECT_EQ(fence->records(), records + 1);
  pool.deallocate_async(t, 256, s1);
  fence->synchronize(s1);  // s1's work has run: the marker completes
  void* d = pool.allocate_async(4_MiB, s3);
  EXPECT_EQ(d, a) << "s1's block once its marker completed";
  EXPECT_EQ(pool.stats().quiesces, quiesces) << "no quiesce after the trim";
  for (void* block : {keep, b, d}) pool.deallocate(block, 4_MiB);
  pool.trim(0);
  EXPECT_EQ(fence->records_on_destroyed(), 0U);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// A request on a stream being captured (no scope: the pool routes it to the capture's own
// graph pool) that would grow past the budget while a destroyed stream's block waits: no
// quiesce during the capture (a device synchronize would invalidate it); the next request
// after the capture quiesces and takes the block.
TEST(DevicePoolDestroyedStreams, AStreamBeingCapturedNeverMakesThePoolQuiesce) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<ManualFence>();
  {
    DevicePool::Options options = emulated(fence, true);
    options.detect_unscoped_capture = true;  // the pool sees the capture (off by default)
    DevicePool pool(upstream, options);
    const auto s1 = reinterpret_cast<cudaStream_t>(0x1000);
    const auto s2 = reinterpret_cast<cudaStream_t>(0x2000);
    const auto s3 = reinterpret_cast<cudaStream_t>(0x3000);
    free_often_on(pool, s1);  // steady: its frees record nothing of their own
    fence->complete_all();    // the emulated device ran s1's work
    const std::uint64_t recorded = fence->recorded();
    void* b = pool.allocate_async(4_MiB, s2);
    void* a = pool.allocate_async(4_MiB, s1);
    pool.deallocate_async(a, 4_MiB, s1);  // s1 is then destroyed
    fence->set_capture(s2, 7);
    void* c = pool.allocate_async(4_MiB, s2);
    EXPECT_EQ(fence->quiesces(), 0U) << "a device synchronize during the capture";
    EXPECT_NE(c, a);
    fence->set_capture(s2, 0);
    void* d = pool.allocate_async(4_MiB, s3);
    EXPECT_EQ(pool.stats().stream_quiesces, 1U);
    EXPECT_EQ(d, a) << "s1's block after the quiesce";
    EXPECT_EQ(fence->recorded(), recorded) << "a marker on s1 outside a call on s1";
    pool.deallocate_async(b, 4_MiB, s2);
    pool.deallocate_async(c, 4_MiB, s2);
    pool.deallocate_async(d, 4_MiB, s3);
  }
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

// A block in flight between threads: freed by the receiver on its own stream, once the
// owner's stream has run the owner's work on it.
struct Handoff {
  void* block;
  std::size_t bytes;
  std::uint64_t tag;
};

class HandoffQueue {
 public:
  void push(Handoff h) {
    std::lock_guard lock(mutex_);
    queue_.push_back(h);
  }
  bool pop(Handoff& h) {
    std::lock_guard lock(mutex_);
    if (queue_.empty()) return false;
    h = queue_.front();
    queue_.pop_front();
    return true;
  }

 private:
  std::mutex mutex_;
  std::deque<Handoff> queue_;
};

std::size_t random_bytes(std::mt19937_64& random) {
  // Mostly small classes (thread caches, rings, the small tier), a quarter large blocks.
  if (random() % 4 == 0) return 1_MiB + 512 * (random() % 6144);  // 1 .. 4 MiB
  return 256 + 256 * (random() % 1024);                           // 256 B .. 256 KiB
}

// 16 threads, each creating a stream per batch, allocating on it, writing its tag into
// every block and queueing a check of the tag on the stream (the emulated kernel), then
// freeing 80% of the blocks on the stream before its work ran, synchronizing and destroying
// it. The other 20% go to another thread, which checks the tag and frees them on its own
// stream. Asserted: no record on a destroyed stream, no tag overwritten before its check,
// every block back, and memory bounded although most frees are on streams never seen again.
// recycle_handles: later streams may get a destroyed stream's handle, as from the driver
// (they then take its freed blocks as their own at once); without it, none is seen again.
// names_streams: the fence tells the streams behind a handle apart (without it, a handle that
// comes back to a thread adds up to a steady stream: wants and quiesces serve its frees).
// blocks: per batch (above StreamAges::kSteadyFrees: a stream per request that frees more
// than that, still young).
struct ChurnShape {
  bool virtual_memory;
  bool recycle_handles;
  bool names_streams = true;
  int threads = 16;
  int batches = 100;
  int blocks = 8;
};

void run_destroyed_streams(const ChurnShape& shape) {
  const bool virtual_memory = shape.virtual_memory;
  const bool recycle_handles = shape.recycle_handles;
  const int kThreads = shape.threads;
  const int kBatches = shape.batches;
  const int kBlocks = shape.blocks;
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<StreamLifetimeFence>(recycle_handles, shape.names_streams);
  auto options = emulated(fence, virtual_memory);
  // The threads' caches and heaps kept small: the bound below is on what the destroyed
  // streams' frees hold, not on what each thread may keep for its steady streams
  // (thread_cache.large_bytes apiece).
  options.thread_cache.max_bytes = 1_MiB;
  options.thread_cache.contended_max_bytes = 0;  // also once the threads have met
  options.thread_cache.large_bytes = 8_MiB;
  std::atomic<std::uint64_t> mismatches{0};
  std::atomic<std::int64_t> live{0};
  std::atomic<std::int64_t> peak_live{0};
  std::atomic<std::uint64_t> frees_on_destroyed_streams{0};
  // Streams that took more frees than a stream per request stays young for
  // (StreamAges::kLoneSteadyFrees): the rest of theirs are a steady stream's.
  std::atomic<std::uint64_t> long_streams{0};
  HandoffQueue handoffs;
  auto note_live = [&](std::int64_t delta) {
    const std::int64_t now = live.fetch_add(delta) + delta;
    std::int64_t peak = peak_live.load();
    while (now > peak && !peak_live.compare_exchange_weak(peak, now)) {
    }
  };
  auto check = [&mismatches](void* block, std::uint64_t tag) {
    std::uint64_t seen = 0;
    std::memcpy(&seen, block, sizeof seen);
    if (seen != tag) mismatches.fetch_add(1);
  };
  DevicePoolStats stats;
  {
    DevicePool pool(upstream, options);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 random(0x5eed + static_cast<std::uint64_t>(t));
        std::uint64_t tag = static_cast<std::uint64_t>(t + 1) << 40;
        for (int batch = 0; batch < kBatches; ++batch) {
          const cudaStream_t s = fence->create();
          std::vector<Handoff> mine;
          for (int i = 0; i < kBlocks; ++i) {
            const std::size_t bytes = random_bytes(random);
            void* block = pool.allocate_async(bytes, s);
            note_live(static_cast<std::int64_t>(bytes));
            ++tag;
            std::memcpy(block, &tag, sizeof tag);  // the "kernel" writes the owner tag now
            fence->enqueue(s, [&check, block, tag] { check(block, tag); });  // and checks later
            mine.push_back({block, bytes, tag});
          }
          // Blocks another thread handed over: still this tag's (live), freed on s.
          std::uint32_t frees_on_s = 0;
          for (Handoff h; handoffs.pop(h);) {
            fence->enqueue(s, [&check, h] { check(h.block, h.tag); });
            pool.deallocate_async(h.block, h.bytes, s);
            note_live(-static_cast<std::int64_t>(h.bytes));
            ++frees_on_s;
          }
          std::vector<Handoff> handed;
          for (const Handoff& h : mine) {
            if (random() % 5 == 0) {
              handed.push_back(h);
            } else {
              pool.deallocate_async(h.block, h.bytes, s);  // s's check has not run yet
              note_live(-static_cast<std::int64_t>(h.bytes));
              frees_on_destroyed_streams.fetch_add(1);
              ++frees_on_s;
            }
          }
          if (frees_on_s > detail::StreamAges::kLoneSteadyFrees) long_streams.fetch_add(1);
          fence->synchronize(s);
          fence->destroy(s);
          for (const Handoff& h : handed) handoffs.push(h);
        }
      });
    }
    for (auto& thread : threads) thread.join();
    for (Handoff h; handoffs.pop(h);) {
      check(h.block, h.tag);
      pool.deallocate(h.block, h.bytes);
      note_live(-static_cast<std::int64_t>(h.bytes));
    }
    stats = pool.stats();
    EXPECT_EQ(stats.bytes_in_use, 0U);
    EXPECT_EQ(stats.acquires, stats.deallocations);
    pool.trim(0);
    EXPECT_EQ(pool.stats().bytes_reserved, 0U);
  }
  std::printf(
      "[destroyed-streams] %s, %s%s, %d threads, %d blocks a stream: %llu streams, %llu frees on "
      "streams then destroyed, peak live %.1f MiB, peak reserved %.1f MiB, %llu markers, %llu "
      "wanted, %llu quiesces (%llu for growth), %llu streams past the young threshold\n",
      virtual_memory ? "virtual" : "segments", recycle_handles ? "handles recycled" : "new handles",
      shape.names_streams ? "" : ", streams not named", kThreads, kBlocks,
      static_cast<unsigned long long>(fence->streams_created()),
      static_cast<unsigned long long>(frees_on_destroyed_streams.load()),
      static_cast<double>(peak_live.load()) / (1 << 20),
      static_cast<double>(stats.peak_bytes_reserved) / (1 << 20),
      static_cast<unsigned long long>(fence->records()),
      static_cast<unsigned long long>(stats.stream_marker_wants),
      static_cast<unsigned long long>(stats.quiesces),
      static_cast<unsigned long long>(stats.stream_quiesces),
      static_cast<unsigned long long>(long_streams.load()));
  EXPECT_EQ(fence->records_on_destroyed(), 0U) << "a marker recorded on a destroyed stream";
  EXPECT_EQ(mismatches.load(), 0U) << "a block reached another owner before its stream's work ran";
  EXPECT_EQ(live.load(), 0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
  // Bounded: the frees on destroyed streams came to far more than this (each batch frees
  // about 1 MiB on a stream never seen again: some 10 GiB in all), and only their markers or
  // quiesces could give them back. How far above peak live it goes depends on the threads'
  // interleaving, hence the margin.
  const std::size_t bound = 4 * static_cast<std::size_t>(peak_live.load()) + 256_MiB;
  EXPECT_LE(stats.peak_bytes_reserved, bound);
  EXPECT_LE(stats.stream_quiesces, stats.quiesces);
  EXPECT_LE(stats.quiesces, fence->quiesces()) << "a quiesce counted that did not happen";
  if (shape.names_streams) {
    // Each stream is young (a stream per batch): its frees are filed under their own markers,
    // so other streams take its blocks once its work ran, without a quiesce. A stream that
    // took more frees than kLoneSteadyFrees (its own and those handed over) turned steady:
    // its last frees may wait for a quiesce.
    EXPECT_LE(stats.stream_quiesces, fence->streams_created() / 40 + long_streams.load())
        << "a quiesce for every 40 streams or more, beside the streams past the threshold";
  } else {
    // Handles that come back add up to steady streams: their frees are cached and reach
    // other streams through wants (and quiesces), the path of a steady stream destroyed.
    EXPECT_GT(stats.stream_marker_wants, 0U) << "no steady stream's marker was wanted";
  }
}

TEST(DevicePoolDestroyedStreams, SixteenThreadsCreateAndDestroyStreamsPerBatchVirtual) {
  run_destroyed_streams({.virtual_memory = true, .recycle_handles = true});
  run_destroyed_streams({.virtual_memory = true, .recycle_handles = false});
}
TEST(DevicePoolDestroyedStreams, SixteenThreadsCreateAndDestroyStreamsPerBatchSegments) {
  run_destroyed_streams({.virtual_memory = false, .recycle_handles = true});
  run_destroyed_streams({.virtual_memory = false, .recycle_handles = false});
}
// Streams that free more than kSteadyFrees blocks each, fewer than kLoneSteadyFrees: young to
// their end (thread heaps would serve a stream asked on 16 times in a row, and a stream that
// turned steady at 32 frees would cache the rest).
TEST(DevicePoolDestroyedStreams, EightThreadsCreateAndDestroyStreamsOfFortyBlocks) {
  for (const bool virtual_memory : {true, false}) {
    run_destroyed_streams({.virtual_memory = virtual_memory,
                           .recycle_handles = false,
                           .threads = 8,
                           .batches = 25,
                           .blocks = 40});
  }
}
// A fence that cannot name streams, with handles that come back: steady streams destroyed
// with frees cached, under 16 threads.
TEST(DevicePoolDestroyedStreams, SixteenThreadsOnHandlesThatComeBackUnnamed) {
  // 250 batches: a thread that gets its last handle back each time frees on it past
  // StreamAges::kSteadyFrees with no other stream between.
  run_destroyed_streams(
      {.virtual_memory = true, .recycle_handles = true, .names_streams = false, .batches = 250});
}

#ifdef VRAM_HAVE_TEST_KERNELS
double gpu_seconds() {
  const char* text = std::getenv("VRAM_STRESS_SECONDS");
  return text ? std::atof(text) : 2.0;
}

struct GpuHandoff {
  void* block;
  std::size_t bytes;
  std::uint32_t tag;
};

// The same pattern on a GPU: 16 threads, a CUDA stream created and destroyed per batch,
// kernels fill every block with the owner's tag and, after a spin that keeps the work
// queued past the free, count the words that differ. 20% of the blocks go to another thread
// once the owner's stream is synchronized; it checks the tag on its own stream and frees them
// there.
TEST(DevicePoolDestroyedStreamsGpu, SixteenThreadsKernelsCheckOwnerTagsOnStreamsDestroyedPerBatch) {
  VRAM_GPU_TEST_OR_SKIP();
  constexpr int kThreads = 16;
  constexpr int kBlocks = 8;
  constexpr std::size_t kCheckedBytes = 1_MiB;  // of each block, from its start
  DevicePool pool(0, DevicePool::Options{.max_cached_bytes = 256_MiB});
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> batches{0};
  std::atomic<std::uint64_t> blocks{0};
  std::mutex handoff_mutex;
  std::deque<GpuHandoff> handoffs;
  std::vector<unsigned long long> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 random(0xbeef + static_cast<std::uint64_t>(t));
      unsigned long long* counter = nullptr;
      cuda::check(cudaMalloc(reinterpret_cast<void**>(&counter), sizeof *counter), "cudaMalloc");
      cuda::check(cudaMemset(counter, 0, sizeof *counter), "cudaMemset");
      std::uint32_t tag = static_cast<std::uint32_t>(t + 1) << 24;
      while (!stop.load(std::memory_order_relaxed)) {
        std::vector<GpuHandoff> handed;
        {
          cuda::Stream stream;
          const cudaStream_t s = stream.get();
          for (int i = 0; i < kBlocks; ++i) {
            const std::size_t bytes = random() % 4 == 0 ? 1_MiB + 512 * (random() % 14336)
                                                        : 256 + 256 * (random() % 4096);
            void* block = pool.allocate_async(bytes, s);
            const std::size_t words = std::min(bytes, kCheckedBytes) / 4;
            ++tag;
            launch_fill(block, words, tag, s);
            launch_spin_then_fill(counter, 0, 0, 2'000, s);  // keeps the check queued
            launch_count_mismatches(block, words, tag, counter, s);
            if (random() % 5 == 0) {
              handed.push_back({block, bytes, tag});
            } else {
              pool.deallocate_async(block, bytes, s);  // the check may still be queued
            }
            blocks.fetch_add(1, std::memory_order_relaxed);
          }
          // Blocks other threads handed over: their owners' streams are synchronized; the
          // block is still theirs (live), so it still holds their tag.
          for (;;) {
            GpuHandoff h;
            {
              std::lock_guard lock(handoff_mutex);
              if (handoffs.empty()) break;
              h = handoffs.front();
              handoffs.pop_front();
            }
            launch_count_mismatches(h.block, std::min(h.bytes, kCheckedBytes) / 4, h.tag, counter,
                                    s);
            pool.deallocate_async(h.block, h.bytes, s);
          }
          stream.synchronize();
        }  // the stream is destroyed here, synchronized, as a request handler does
        {
          std::lock_guard lock(handoff_mutex);
          for (const GpuHandoff& h : handed) handoffs.push_back(h);
        }
        batches.fetch_add(1, std::memory_order_relaxed);
      }
      cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      cuda::check(cudaMemcpy(&mismatches[t], counter, sizeof *counter, cudaMemcpyDeviceToHost),
                  "cudaMemcpy");
      cudaFree(counter);
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(gpu_seconds()));
  stop = true;
  for (auto& thread : threads) thread.join();
  // What is left in flight: the owners' streams ran their work; freed with no stream.
  for (const GpuHandoff& h : handoffs) pool.deallocate(h.block, h.bytes);
  handoffs.clear();
  const DevicePoolStats stats = pool.stats();
  std::printf(
      "[destroyed-streams-gpu] %llu batches (a stream each), %llu blocks, peak reserved %.1f "
      "MiB, %llu wanted markers, %llu quiesces (%llu for growth)\n",
      static_cast<unsigned long long>(batches.load()),
      static_cast<unsigned long long>(blocks.load()),
      static_cast<double>(stats.peak_bytes_reserved) / (1 << 20),
      static_cast<unsigned long long>(stats.stream_marker_wants),
      static_cast<unsigned long long>(stats.quiesces),
      static_cast<unsigned long long>(stats.stream_quiesces));
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(mismatches[t], 0U) << "thread " << t << " saw a block overwritten";
  }
  EXPECT_EQ(stats.bytes_in_use, 0U);
  EXPECT_EQ(stats.acquires, stats.deallocations);
  EXPECT_GT(batches.load(), static_cast<std::uint64_t>(kThreads));
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}
#endif

// The rule that quiesces rather than raise the tiers' peak of reserved bytes reads the
// tiers' own peak: a sleep tag's mapped granules (in the pool's reserved bytes and their
// peak) do not make room for a growth where a destroyed steady stream's block would serve.
TEST(DevicePoolDestroyedStreams, ATagsGranulesLeaveTheTiersPeakRuleAlone) {
  for (const bool with_tag : {false, true}) {
    SCOPED_TRACE(with_tag ? "a tag holds 64 MiB" : "no tag");
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto fence = std::make_shared<StreamLifetimeFence>();
    auto options = emulated(fence, true);
    options.growth_headroom = 100.0;  // within the budget: only the peak rule may quiesce
    DevicePool pool(upstream, options);
    void* tagged = nullptr;
    SleepTag tag;
    if (with_tag) {
      tag = pool.create_tag("weights", SleepTagOptions{});
      tagged = pool.allocate_tagged(64_MiB, tag);
    }
    const cudaStream_t s2 = fence->create();
    void* b = pool.allocate_async(4_MiB, s2);
    const cudaStream_t s1 = fence->create();
    free_often_on(pool, s1);
    void* a = pool.allocate_async(4_MiB, s1);
    pool.deallocate_async(a, 4_MiB, s1);
    fence->synchronize(s1);
    fence->destroy(s1);
    const std::size_t reserved = pool.stats().bytes_reserved;
    void* c = pool.allocate_async(4_MiB, s2);
    EXPECT_EQ(c, a) << "the destroyed stream's block was not reused";
    EXPECT_EQ(pool.stats().stream_quiesces, 1U);
    EXPECT_EQ(pool.stats().bytes_reserved, reserved);
    pool.deallocate_async(b, 4_MiB, s2);
    pool.deallocate_async(c, 4_MiB, s2);
    fence->synchronize(s2);
    fence->destroy(s2);
    if (tagged != nullptr) pool.deallocate(tagged, 64_MiB);
  }
}

}  // namespace
}  // namespace vram::testing
