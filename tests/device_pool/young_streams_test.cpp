// Young streams (src/device_pool/stream_ages.hpp): a free on a stream the thread has not freed
// on often records a marker on it first and files the block pending under that marker. Here:
// two threads freeing on one stream, a stream's own growth, and a pool of streams used in turns.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "device_pool/stream_ages.hpp"
#include "emulated_device.hpp"
#include "test_fences.hpp"
#include "test_upstreams.hpp"
#include "vram/device_pool.hpp"
#include "vram/units.hpp"
#include "vram/upstream.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

// A StreamLifetimeFence whose record() on the thread named by gate() stops after the record
// until open(): that free's marker is recorded, its block not yet in its tier.
class GatedFence final : public StreamFence {
 public:
  StreamLifetimeFence inner;
  std::uint64_t record(cudaStream_t stream) override {
    const std::uint64_t marker = inner.record(stream);
    if (gated_.load() == std::this_thread::get_id()) {
      std::unique_lock lock(mutex_);
      recorded_ = true;
      cv_.notify_all();
      cv_.wait(lock, [&] { return open_; });
    }
    return marker;
  }
  bool completed(std::uint64_t marker) noexcept override { return inner.completed(marker); }
  void wait(std::uint64_t marker) noexcept override { inner.wait(marker); }
  void release(std::uint64_t marker) noexcept override { inner.release(marker); }
  void quiesce() noexcept override { inner.quiesce(); }
  std::uint64_t stream_id(cudaStream_t stream) noexcept override { return inner.stream_id(stream); }
  void gate(std::thread::id id) { gated_.store(id); }
  void wait_recorded() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return recorded_; });
  }
  void open() {
    std::lock_guard lock(mutex_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  std::atomic<std::thread::id> gated_{};
  std::mutex mutex_;
  std::condition_variable cv_;
  bool recorded_ = false;
  bool open_ = false;
};

DevicePool::Options options_for(std::shared_ptr<StreamFence> fence, bool virtual_memory) {
  DevicePool::Options options = emulated(std::move(fence), virtual_memory);
  options.large_tier.segment_bytes = 4_MiB;
  return options;
}

// Two threads free on one young stream s. A records its marker M_A and stops before its block
// reaches the tier; B queues work on its block b on s and frees b (M_B, after that work). A's
// block then lands beside b: M_A was recorded before B's work, so it must not stand for b.
TEST(DevicePoolYoungStreams, TwoThreadsFreeingOnOneStreamKeepEachOthersMarkers) {
  for (const bool virtual_memory : {false, true}) {
    SCOPED_TRACE(virtual_memory ? "virtual memory" : "segments");
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto fence = std::make_shared<GatedFence>();
    {
      DevicePool pool(upstream, options_for(fence, virtual_memory));
      const cudaStream_t s = fence->inner.create();
      const cudaStream_t s2 = fence->inner.create();
      void* a = pool.allocate_async(4_MiB, s);
      void* b = pool.allocate_async(4_MiB, s);
      std::atomic<bool> b_work_ran{false};
      std::thread ta([&] {
        fence->gate(std::this_thread::get_id());
        pool.deallocate_async(a, 4_MiB, s);  // M_A: nothing queued on s yet, complete
      });
      fence->wait_recorded();
      fence->inner.enqueue(s, [&] { b_work_ran = true; });  // B's work on b, after M_A
      pool.deallocate_async(b, 4_MiB, s);
      fence->open();
      ta.join();
      std::vector<void*> got;
      for (int i = 0; i < 2; ++i) got.push_back(pool.allocate_async(4_MiB, s2));
      for (void* g : got) {
        EXPECT_FALSE(g == b && !b_work_ran.load())
            << "b reached s2 while B's work on it was still queued on s";
      }
      fence->inner.synchronize(s);
      for (void* g : got) pool.deallocate_async(g, 4_MiB, s2);
      fence->inner.synchronize(s2);
    }
    EXPECT_EQ(upstream->live_bytes(), 0U);
  }
}

// A young stream's own growth takes back only the pending ranges of wants and fences: its frees
// keep their markers, so once it is synchronized and destroyed they reach another stream with
// no quiesce.
TEST(DevicePoolYoungStreams, AStreamsOwnGrowthKeepsItsFreesMarkers) {
  for (const bool virtual_memory : {false, true}) {
    SCOPED_TRACE(virtual_memory ? "virtual memory" : "segments");
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto fence = std::make_shared<StreamLifetimeFence>();
    {
      DevicePool pool(upstream, options_for(fence, virtual_memory));
      const cudaStream_t s2 = fence->create();
      void* keep = pool.allocate_async(4_MiB, s2);
      const cudaStream_t s = fence->create();
      void* a = pool.allocate_async(4_MiB, s);
      fence->enqueue(s, [] {});            // s's work on a: its marker waits for it
      pool.deallocate_async(a, 4_MiB, s);  // young: pending under its marker
      void* big = pool.allocate_async(8_MiB, s);
      pool.deallocate_async(big, 8_MiB, s);
      fence->synchronize(s);
      fence->destroy(s);
      void* c = pool.allocate_async(4_MiB, s2);
      void* d = pool.allocate_async(8_MiB, s2);
      EXPECT_EQ(pool.stats().stream_quiesces, 0U) << "a young stream's frees needed a quiesce";
      EXPECT_EQ(fence->records_on_destroyed(), 0U);
      for (void* g : {keep, c}) pool.deallocate_async(g, 4_MiB, s2);
      pool.deallocate_async(d, 8_MiB, s2);
      fence->synchronize(s2);
    }
    EXPECT_EQ(upstream->live_bytes(), 0U);
  }
}

// A pool of streams used in turns, up to one more than the thread's table holds: most turn
// steady (their frees keep the warm path and record nothing).
TEST(DevicePoolYoungStreams, StreamsUsedInTurnsTurnSteady) {
  for (const int count : {16, static_cast<int>(detail::StreamAges::kTracked) + 1}) {
    SCOPED_TRACE(count);
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto fence = std::make_shared<StreamLifetimeFence>();
    DevicePool pool(upstream, options_for(fence, true));
    std::vector<cudaStream_t> streams;
    for (int i = 0; i < count; ++i) streams.push_back(fence->create());
    constexpr int kRounds = 200;
    for (int round = 0; round < kRounds; ++round) {
      for (cudaStream_t s : streams) pool.deallocate_async(pool.allocate_async(256, s), 256, s);
      if (round % 8 == 0) {
        for (cudaStream_t s : streams) fence->synchronize(s);
      }
    }
    EXPECT_LT(pool.stats().stream_markers, static_cast<std::uint64_t>(count) * kRounds / 2)
        << "streams used in turns stayed young";
    for (cudaStream_t s : streams) fence->synchronize(s);
  }
}

}  // namespace
}  // namespace vram::testing

namespace vram::testing {
namespace {

// A new stream of `fence`, freed on kLoneSteadyFrees times (steady from then on), then
// `large_frees` more times on the slow path (8 MiB blocks).
cudaStream_t steady_stream(DevicePool& pool, StreamLifetimeFence& fence,
                           std::uint32_t large_frees) {
  const cudaStream_t s = fence.create();
  for (std::uint32_t i = 0; i < detail::StreamAges::kLoneSteadyFrees; ++i) {
    pool.deallocate_async(pool.allocate_async(256, s), 256, s);
  }
  for (std::uint32_t i = 0; i < large_frees; ++i) {
    pool.deallocate_async(pool.allocate_async(8_MiB, s), 8_MiB, s);
  }
  return s;
}

// `s` destroyed once its work is done, and a new stream made (the emulated driver gives it
// `s`'s handle).
cudaStream_t replace_stream(StreamLifetimeFence& fence, cudaStream_t s) {
  fence.synchronize(s);
  fence.destroy(s);
  return fence.create();
}

// `free_once` (one slow-path free on the new stream behind a steady handle, `markers`: the
// pool's stream_markers before it) until the pool records a marker, at most
// kMostRenameFrees + 1 times: the new stream is found within kMostRenameFrees, and nothing is
// named or recorded on the destroyed stream meanwhile.
template <class FreeOnce>
void expect_found_within_longest_gap(DevicePool& pool, StreamLifetimeFence& fence,
                                     std::uint64_t markers, FreeOnce free_once) {
  std::uint32_t frees = 0;
  while (pool.stats().stream_markers == markers && frees <= detail::StreamAges::kMostRenameFrees) {
    free_once();
    ++frees;
  }
  EXPECT_GT(pool.stats().stream_markers, markers) << "the new stream was never found";
  EXPECT_LE(frees, detail::StreamAges::kMostRenameFrees);
  EXPECT_EQ(fence.ids_of_destroyed(), 0U);
  EXPECT_EQ(fence.records_on_destroyed(), 0U);
}

// A thread cache emptied while tagged with one steady stream takes the next small block freed
// on another steady stream: cached under the new stream without a marker, served back to that
// stream at once and never to the first before its frees are known complete.
TEST(DevicePoolYoungStreams, AnEmptyCacheTaggedWithOneSteadyStreamTakesAnothersBlock) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<StreamLifetimeFence>();
  DevicePool pool(upstream, options_for(fence, false));
  const cudaStream_t second = steady_stream(pool, *fence, 0);
  const cudaStream_t first = steady_stream(pool, *fence, 0);
  // A steady free on first tags the cache with first; taking that block back empties it.
  void* warm = pool.allocate_async(256, first);
  pool.deallocate_async(warm, 256, first);
  void* held = pool.allocate_async(256, first);
  ASSERT_EQ(held, warm) << "served from the cache tagged with first";
  void* block = pool.allocate_async(256, second);
  ASSERT_NE(block, held);
  const std::uint64_t records = fence->records();
  const std::uint64_t markers = pool.stats().stream_markers;
  pool.deallocate_async(block, 256, second);
  EXPECT_EQ(fence->records(), records) << "a steady stream's free records no marker";
  EXPECT_EQ(pool.stats().stream_markers, markers);
  void* on_first = pool.allocate_async(256, first);
  EXPECT_NE(on_first, block) << "second's work may still use it";
  EXPECT_EQ(pool.allocate_async(256, second), block) << "cached for its own stream";
  pool.deallocate_async(on_first, 256, first);
  pool.deallocate_async(held, 256, first);
  pool.deallocate_async(block, 256, second);
  fence->synchronize(first);
  fence->synchronize(second);
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

// A new stream behind a steady handle is found also when each of its small frees meets the
// thread's cache empty and tagged with another steady stream: such a free takes the slow path,
// where it is counted and the handle named within the gap then running; it never retags the
// cache unnamed.
TEST(DevicePoolYoungStreams, ANewStreamBehindASteadyHandleIsFoundThroughAnotherStreamsEmptyCache) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<StreamLifetimeFence>(/*recycle_handles=*/true);
  {
    DevicePool pool(upstream, options_for(fence, false));
    const cudaStream_t first = steady_stream(pool, *fence, 0);
    const cudaStream_t s = steady_stream(pool, *fence, 0);
    const std::uint64_t markers = pool.stats().stream_markers;
    const cudaStream_t s2 = replace_stream(*fence, s);
    ASSERT_EQ(s2, s) << "the emulated driver gives the handle back";
    expect_found_within_longest_gap(pool, *fence, markers, [&] {
      // The cache tagged with first and empty: first's block filed in it, then taken back.
      void* warm = pool.allocate_async(256, first);
      pool.deallocate_async(warm, 256, first);
      void* held = pool.allocate_async(256, first);
      ASSERT_EQ(held, warm) << "served from the cache tagged with first";
      void* block = pool.allocate_async(256, s2);
      pool.deallocate_async(block, 256, s2);
      pool.deallocate_async(held, 256, first);
    });
    fence->synchronize(first);
    fence->synchronize(s2);
  }
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// A steady stream destroyed, and the driver gives its handle to a new stream: once the pool
// names the new stream (kRenameFrees slow-path frees after it turned steady), the key is young
// again, the blocks cached under it go to their tiers and the new stream's small frees record
// markers.
TEST(DevicePoolYoungStreams, ANewStreamBehindASteadyHandleTurnsYoung) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<StreamLifetimeFence>(/*recycle_handles=*/true);
  {
    DevicePool pool(upstream, options_for(fence, true));
    const cudaStream_t s = steady_stream(pool, *fence, 0);
    void* cached = pool.allocate_async(256, s);
    pool.deallocate_async(cached, 256, s);  // steady: into the thread's cache
    const std::uint64_t markers = pool.stats().stream_markers;
    EXPECT_GT(pool.stats().bytes_cached_in_threads, 0U);
    const cudaStream_t s2 = replace_stream(*fence, s);
    ASSERT_EQ(s2, s) << "the emulated driver gives the handle back";
    for (std::uint32_t i = 0; i < detail::StreamAges::kRenameFrees; ++i) {
      pool.deallocate_async(pool.allocate_async(8_MiB, s2), 8_MiB, s2);  // slow-path frees
    }
    EXPECT_EQ(pool.stats().bytes_cached_in_threads, 0U) << "the old stream's cached blocks stayed";
    const std::uint64_t renamed = pool.stats().stream_markers;
    EXPECT_GT(renamed, markers) << "the new stream's frees took the steady path";
    pool.deallocate_async(pool.allocate_async(256, s2), 256, s2);
    EXPECT_GT(pool.stats().stream_markers, renamed) << "a small free on the new stream was cached";
    EXPECT_EQ(fence->ids_of_destroyed(), 0U);
    EXPECT_EQ(fence->records_on_destroyed(), 0U);
    fence->synchronize(s2);
  }
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// The same after a long steady life, when the stream is named only every kMostRenameFrees
// slow-path frees: the new stream behind the handle is found at the next naming, within
// kMostRenameFrees, and no call names or records on the destroyed stream meanwhile.
TEST(DevicePoolYoungStreams, ANewStreamBehindALongSteadyHandleTurnsYoungWithinTheLongestGap) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<StreamLifetimeFence>(/*recycle_handles=*/true);
  {
    DevicePool pool(upstream, options_for(fence, true));
    // Steady for long enough that the gap between namings is the longest.
    const cudaStream_t s = steady_stream(pool, *fence, 4 * detail::StreamAges::kMostRenameFrees);
    const std::uint64_t markers = pool.stats().stream_markers;
    const cudaStream_t s2 = replace_stream(*fence, s);
    ASSERT_EQ(s2, s) << "the emulated driver gives the handle back";
    expect_found_within_longest_gap(pool, *fence, markers, [&] {
      pool.deallocate_async(pool.allocate_async(8_MiB, s2), 8_MiB, s2);
    });
    fence->synchronize(s2);
  }
  EXPECT_EQ(upstream->live_bytes(), 0U);
}
}  // namespace
}  // namespace vram::testing

namespace vram::testing {
namespace {

// A young stream's frees side by side are one range under its marker: its own larger request
// takes them at once, with nothing new reserved (its work on them may still be queued: stream
// order makes that safe).
TEST(DevicePoolYoungStreams, AStreamsNeighbouringFreesServeItsOwnLargerRequest) {
  for (const bool virtual_memory : {false, true}) {
    SCOPED_TRACE(virtual_memory ? "virtual memory" : "segments");
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto fence = std::make_shared<StreamLifetimeFence>();
    auto options = options_for(fence, virtual_memory);
    options.large_tier.segment_bytes = 8_MiB;
    {
      DevicePool pool(upstream, options);
      const cudaStream_t s = fence->create();
      pool.deallocate(pool.allocate(8_MiB), 8_MiB);  // one free 8 MiB range for both
      char* a = static_cast<char*>(pool.allocate_async(4_MiB, s));
      char* b = static_cast<char*>(pool.allocate_async(4_MiB, s));
      ASSERT_EQ(b, a + 4_MiB) << "the test needs them side by side";
      fence->enqueue(s, [] {});  // s's work on both, still queued
      pool.deallocate_async(a, 4_MiB, s);
      pool.deallocate_async(b, 4_MiB, s);
      const std::size_t reserved = pool.stats().bytes_reserved;
      void* both = pool.allocate_async(8_MiB, s);
      EXPECT_EQ(both, a);
      EXPECT_EQ(pool.stats().bytes_reserved, reserved) << "grew for its own freed memory";
      pool.deallocate_async(both, 8_MiB, s);
      fence->synchronize(s);
    }
    EXPECT_EQ(upstream->live_bytes(), 0U);
  }
}

// A young stream's freed block (pending under its marker) and the free memory after it serve
// the stream's own larger request together, with nothing new reserved; what is left of that
// free memory serves another stream at once.
TEST(DevicePoolYoungStreams, AStreamsFreedBlockAndTheFreeMemoryAfterItServeItsOwnLargerRequest) {
  for (const bool virtual_memory : {false, true}) {
    SCOPED_TRACE(virtual_memory ? "virtual memory" : "segments");
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto fence = std::make_shared<StreamLifetimeFence>();
    auto options = options_for(fence, virtual_memory);
    options.large_tier.segment_bytes = 16_MiB;
    {
      DevicePool pool(upstream, options);
      pool.deallocate(pool.allocate(16_MiB), 16_MiB);  // one free 16 MiB range
      const cudaStream_t s = fence->create();
      char* a = static_cast<char*>(pool.allocate_async(4_MiB, s));
      fence->enqueue(s, [] {});  // s's work on a, still queued
      pool.deallocate_async(a, 4_MiB, s);
      const std::size_t reserved = pool.stats().bytes_reserved;
      char* big = static_cast<char*>(pool.allocate_async(14_MiB, s));
      EXPECT_EQ(big, a) << "s's freed block and the free memory after it";
      EXPECT_EQ(pool.stats().bytes_reserved, reserved) << "grew for memory it had";
      const cudaStream_t s2 = fence->create();
      void* rest = pool.allocate_async(2_MiB, s2);
      EXPECT_EQ(rest, big + 14_MiB) << "the rest of the free memory is any stream's";
      EXPECT_EQ(pool.stats().bytes_reserved, reserved);
      pool.deallocate_async(rest, 2_MiB, s2);
      pool.deallocate_async(big, 14_MiB, s);
      fence->synchronize(s);
      fence->synchronize(s2);
    }
    EXPECT_EQ(upstream->live_bytes(), 0U);
  }
}

// A stream per request (four blocks of fresh sizes, each freed on the stream while its work is
// queued, then the stream synchronized and destroyed): the pool reserves about what the same
// requests reserve on the legacy stream, where no marker holds a freed block back.
TEST(DevicePoolYoungStreams, AStreamPerRequestReservesAboutWhatTheLegacyStreamDoes) {
  for (const bool virtual_memory : {false, true}) {
    SCOPED_TRACE(virtual_memory ? "virtual memory" : "segments");
    auto peak_reserved = [virtual_memory](bool stream_per_request) {
      auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
      auto fence = std::make_shared<StreamLifetimeFence>();
      DevicePool pool(upstream, emulated(fence, virtual_memory));
      std::mt19937_64 random(0xc4a2);
      std::uniform_real_distribution<double> exponent(8.0, 26.0);  // 256 B to 64 MiB
      for (int request = 0; request < 2000; ++request) {
        const cudaStream_t s = stream_per_request ? fence->create() : cudaStreamLegacy;
        for (int i = 0; i < 4; ++i) {
          const auto bytes = static_cast<std::size_t>(std::exp2(exponent(random)));
          void* block = pool.allocate_async(bytes, s);
          if (stream_per_request) fence->enqueue(s, [] {});
          pool.deallocate_async(block, bytes, s);
        }
        if (stream_per_request) {
          fence->synchronize(s);
          fence->destroy(s);
        }
      }
      EXPECT_EQ(pool.stats().stream_quiesces, 0U);
      return pool.stats().peak_bytes_reserved;
    };
    const std::size_t legacy = peak_reserved(false);
    const std::size_t per_request = peak_reserved(true);
    EXPECT_LE(per_request, legacy + legacy / 2)
        << "legacy stream " << legacy << " B, a stream per request " << per_request << " B";
  }
}

}  // namespace
}  // namespace vram::testing

namespace vram::testing {
namespace {

// A large block the thread's cache holds (freed once with deallocate) freed again on a young
// stream, and the reverse order: the second deallocation is rejected in both, so no two
// requests get the block. Without validation (the shipped path) the thread's record of its
// large blocks is what catches it; a young free skips the cache but still asks it.
TEST(DevicePoolYoungStreams, ADoubleFreeOfACachedLargeBlockOnAYoungStreamIsRejected) {
  for (const bool young_first : {false, true}) {
    for (const bool virtual_memory : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << "young first " << young_first << ", virtual memory " << virtual_memory);
      auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
      auto fence = std::make_shared<StreamLifetimeFence>();
      DevicePool::Options options;
      options.validate_deallocations = false;
      options.large_tier.memory =
          virtual_memory ? LargeTierMemory::virtual_memory : LargeTierMemory::segments;
      options.thread_cache.large_from_start = true;  // the thread's large cache keeps blocks
      options.thread_cache.large_chunk_bytes = 0;    // no heap: the tier places the blocks
      options.fence = fence;
      {
        DevicePool pool(upstream, options);
        const cudaStream_t y = fence->create();
        void* x = pool.allocate(8_MiB);
        if (young_first) {
          pool.deallocate_async(x, 8_MiB, y);  // young: to the tier, pending under its marker
          pool.deallocate(x, 8_MiB);           // the double free
        } else {
          pool.deallocate(x, 8_MiB);  // into the thread's large cache
          ASSERT_GT(pool.stats().bytes_cached_in_threads, 0U);
          pool.deallocate_async(x, 8_MiB, y);  // the double free, on a young stream
        }
        EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
        fence->synchronize(y);
        void* a = pool.allocate(8_MiB);
        void* b = pool.allocate_async(8_MiB, y);
        EXPECT_NE(a, b) << "one block handed to two owners";
        pool.deallocate(a, 8_MiB);
        pool.deallocate_async(b, 8_MiB, y);
        fence->synchronize(y);
        EXPECT_EQ(pool.stats().bytes_in_use, 0U);
      }
      EXPECT_EQ(upstream->live_bytes(), 0U);
      EXPECT_EQ(fence->records(), fence->released()) << "a marker leaked or went back twice";
    }
  }
}

}  // namespace
}  // namespace vram::testing
