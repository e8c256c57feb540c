// DevicePool behaviour beyond the contract: validation of releases, the per-thread tier
// (trim epochs, thread exit), destruction with live leases, moves, peaks.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "gpu_test_policy.hpp"
#include "steady_stream.hpp"
#include "test_upstreams.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/device_pool.hpp"
#include "vram/units.hpp"
#include "vram/virtual_memory.hpp"
#ifdef VRAM_HAVE_TEST_KERNELS
#include "test_kernels.hpp"
#endif

namespace vram::testing {
namespace {

using namespace vram::literals;

DevicePool::Options validating() {
  DevicePool::Options o;
  o.validate_deallocations = true;
  return o;
}

TEST(DevicePool, DoubleReleaseIsRejectedAndCounted) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, validating());
  void* block = pool.allocate(4096);
  pool.deallocate(block, 4096);
  ::testing::internal::CaptureStderr();
  pool.deallocate(block, 4096);
  const std::string message = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(message.find("double deallocation"), std::string::npos) << message;
  EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
  // The block was cached once, not twice: two acquires give two different blocks.
  void* a = pool.allocate(4096);
  void* b = pool.allocate(4096);
  EXPECT_NE(a, b);
  pool.deallocate(a, 4096);
  pool.deallocate(b, 4096);
}

TEST(DevicePool, ForeignPointerAndWrongSizeAreRejected) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), validating());
  int local = 0;
  ::testing::internal::CaptureStderr();
  pool.deallocate(&local, sizeof local);
  void* block = pool.allocate(4096);
  pool.deallocate(block, 64_KiB);  // wrong size class
  const std::string message = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(message.find("never handed out"), std::string::npos) << message;
  EXPECT_NE(message.find("does not match"), std::string::npos) << message;
  EXPECT_EQ(pool.stats().invalid_deallocations, 2U);
  EXPECT_EQ(pool.stats().bytes_cached_in_threads + pool.stats().bytes_cached_in_rings, 0U);
  pool.deallocate(block, 4096);  // the right release still works
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

TEST(DevicePool, TrimOnAnotherThreadReachesThisThreadsIdleCacheAtOnce) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, validating());
  pool.deallocate(pool.allocate(4096), 4096);  // parked in this thread's cache
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 4096U);
  std::thread([&] { pool.trim(0); }).join();
  EXPECT_EQ(upstream->live_bytes(), 0U);  // taken from this (idle) thread's cache
  EXPECT_EQ(pool.stats().bytes_cached, 0U);
  pool.deallocate(pool.allocate(256), 256);  // this thread's cache still works
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 256U);
}

TEST(DevicePool, ThreadExitHandsItsCacheToTheSharedTier) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, validating());
  std::thread([&] { pool.deallocate(pool.allocate(4096), 4096); }).join();
  const auto s = pool.stats();
  EXPECT_EQ(s.bytes_cached_in_threads, 0U);
  EXPECT_EQ(s.bytes_in_use, 0U);
  EXPECT_EQ(s.acquires, 1U);          // counters of the exited thread are kept
  void* again = pool.allocate(4096);  // served from the shared segments
  EXPECT_EQ(upstream->allocations(), 1U);
  pool.deallocate(again, 4096);
}

TEST(DevicePool, DestroyedWithLiveLeasesKeepsThemSafe) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Lease survivor;
  DevicePool::Lease other_thread_survivor;
  {
    DevicePool pool(upstream, validating());
    survivor = pool.acquire(4096);
    other_thread_survivor = pool.acquire(8192);
    pool.deallocate(pool.allocate(256), 256);  // something cached
    ::testing::internal::CaptureStderr();
  }
  const std::string warning = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warning.find("still leased"), std::string::npos) << warning;
  // Cache freed; the leases' segment (one 2 MiB segment holds both) stays.
  EXPECT_EQ(upstream->live_bytes(), 2_MiB);
  std::thread([&] { other_thread_survivor.reset(); }).join();
  EXPECT_EQ(upstream->live_bytes(), 2_MiB);
  survivor.reset();  // last one: memory back upstream, bookkeeping freed
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(DevicePool, MovedPoolKeepsItsBlocksAndLeases) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool first(upstream, validating());
  auto lease = first.acquire(4096);
  DevicePool second(std::move(first));
  lease.reset();
  EXPECT_EQ(second.stats().bytes_cached_in_threads, 4096U);
  DevicePool third(std::make_shared<HostMemoryUpstream>());
  third = std::move(second);
  EXPECT_EQ(third.stats().bytes_cached_in_threads, 4096U);
}

TEST(DevicePool, MemoryMapCoversEveryReservedByteAndShowsWhatIsHandedOut) {
  DevicePool::Options options;
  options.thread_cache.blocks = 0;  // a freed large block goes straight back to its tier
  options.thread_cache.large_bytes = 0;
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), options);
  void* small = pool.allocate(1000);
  void* large = pool.allocate(3_MiB);
  void* gone = pool.allocate(5_MiB);
  pool.deallocate(gone, 5_MiB);
  const std::vector<DevicePoolSegment> map = pool.memory_map();
  std::size_t total = 0;
  bool saw_small = false, saw_large = false;
  for (const DevicePoolSegment& segment : map) {
    std::uintptr_t at = segment.address;
    for (const auto& range : segment.ranges) {
      EXPECT_EQ(range.address, at);  // in address order, no gaps
      at += range.bytes;
      if (range.address == reinterpret_cast<std::uintptr_t>(small)) {
        saw_small = range.used && !segment.large;
      }
      if (range.address == reinterpret_cast<std::uintptr_t>(large)) {
        saw_large = range.used && segment.large && range.bytes == pool.block_bytes(3_MiB);
      }
      if (range.address == reinterpret_cast<std::uintptr_t>(gone)) EXPECT_FALSE(range.used);
    }
    EXPECT_EQ(at - segment.address, segment.bytes);
    total += segment.bytes;
  }
  EXPECT_TRUE(saw_small);
  EXPECT_TRUE(saw_large);
  EXPECT_EQ(total, pool.stats().bytes_reserved);
  pool.deallocate(small, 1000);
  pool.deallocate(large, 3_MiB);
}

TEST(DevicePool, ResetPeakStartsANewWindow) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), validating());
  std::size_t big_reserved = 0;
  {
    auto big = pool.acquire(8_MiB);
    big_reserved = pool.stats().bytes_reserved;
  }
  pool.trim(0);
  EXPECT_EQ(pool.stats().peak_bytes_reserved, big_reserved);
  pool.reset_peak();
  EXPECT_EQ(pool.stats().peak_bytes_reserved, 0U);
  auto small = pool.acquire(4096);
  EXPECT_EQ(pool.stats().peak_bytes_reserved, pool.stats().bytes_reserved);
  EXPECT_LT(pool.stats().peak_bytes_reserved, big_reserved);
}

TEST(DevicePool, LeaseReleaseHandsOwnershipToTheCaller) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), validating());
  auto lease = pool.acquire(1000);
  EXPECT_EQ(lease.size(), 1000U);
  void* raw = lease.release();
  EXPECT_FALSE(lease);
  EXPECT_EQ(pool.stats().bytes_in_use, 1024U);
  pool.deallocate(raw, 1000);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

TEST(DevicePool, ThreadCacheCanBeTurnedOff) {
  DevicePool::Options options = validating();
  options.thread_cache.blocks = 0;
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), options);
  pool.deallocate(pool.allocate(4096), 4096);
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 0U);
  EXPECT_EQ(pool.stats().bytes_cached_in_rings, 4096U);
}

}  // namespace
}  // namespace vram::testing

namespace vram::testing {
namespace {

TEST(DevicePool, ThreadCacheIsBoundedInBytes) {
  DevicePool::Options options;
  options.validate_deallocations = true;
  options.thread_cache.max_bytes = 8192;
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), options);
  std::vector<DevicePool::Lease> leases;
  for (int i = 0; i < 4; ++i) leases.push_back(pool.acquire(4096));
  leases.clear();
  const auto s = pool.stats();
  EXPECT_EQ(s.bytes_cached_in_threads, 8192U);
  EXPECT_EQ(s.bytes_cached_in_rings, 2U * 4096);
}

}  // namespace
}  // namespace vram::testing

// Lifetime and cross-thread reclamation.
namespace vram::testing {
namespace {

using namespace vram::literals;

// A thread that caches blocks and then stays alive and idle (parked on a flag).
class IdleThread {
 public:
  IdleThread(DevicePool& pool, std::size_t bytes, int blocks) {
    thread_ = std::thread([this, &pool, bytes, blocks] {
      std::vector<DevicePool::Lease> leases;
      for (int i = 0; i < blocks; ++i) leases.push_back(pool.acquire(bytes));
      leases.clear();  // into this thread's cache
      parked_.store(true);
      while (!leave_.load()) std::this_thread::yield();
    });
    while (!parked_.load()) std::this_thread::yield();
  }
  ~IdleThread() {
    leave_.store(true);
    thread_.join();
  }

 private:
  std::atomic<bool> parked_{false};
  std::atomic<bool> leave_{false};
  std::thread thread_;
};

TEST(DevicePoolLifetime, TrimReachesTheCachesOfIdleLiveThreads) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream);  // validate_deallocations as shipped in this build type
  IdleThread first(pool, 64_KiB, 3);
  IdleThread second(pool, 1_MiB, 2);
  ASSERT_EQ(pool.stats().bytes_cached_in_threads, 3 * 64_KiB + 2 * 1_MiB);
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_cached, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(DevicePoolLifetime, OutOfMemoryRetryReclaimsOtherThreadsCaches) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(),
                                                 TestUpstream::Options{.capacity_bytes = 4_MiB});
  DevicePool pool(upstream);
  IdleThread idle(pool, 1_MiB, 2);  // a 2 MiB segment pinned by an idle thread's cache
  ASSERT_EQ(upstream->live_bytes(), 2_MiB);
  auto big = pool.acquire(3_MiB);  // fits only once the idle thread's cache is freed
  EXPECT_TRUE(big);
  EXPECT_EQ(pool.stats().oom_retries, 1U);
  EXPECT_EQ(upstream->live_bytes(), 3_MiB);
}

// A thread_local made before the thread first uses the pool is destroyed after the pool's
// per-thread directory: its release must still reach a place trim() can free.
struct LateReleaser {
  DevicePool::Lease lease;
};

TEST(DevicePoolLifetime, ReleasesDuringThreadLocalTeardownAreNotStranded) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream);
  std::thread([&] {
    thread_local LateReleaser late;  // constructed first, destroyed last
    late.lease = pool.acquire(4096);
    pool.deallocate(pool.allocate(8192), 8192);  // this thread's cache
  }).join();
  const auto s = pool.stats();
  EXPECT_EQ(s.bytes_in_use, 0U);
  EXPECT_EQ(s.acquires, s.deallocations);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(DevicePoolLifetime, ExitedThreadCachesAreReusedNotAccumulated) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream);
  for (int i = 0; i < 50; ++i) {
    std::thread([&] { pool.deallocate(pool.allocate(4096), 4096); }).join();
  }
  const auto s = pool.stats();
  EXPECT_EQ(s.acquires, 50U);
  EXPECT_EQ(s.deallocations, 50U);
  EXPECT_EQ(s.bytes_cached_in_threads, 0U);
  EXPECT_EQ(upstream->allocations(), 1U);  // one block went round all 50 threads
}

std::uint64_t destroy_rounds() {
  const char* text = std::getenv("VRAM_DESTROY_ROUNDS");
  return text ? std::strtoull(text, nullptr, 10) : 2000;
}

// Destroys pools while other threads return their leases: every block goes back to the
// upstream exactly once (TestUpstream counts foreign and double frees), nothing leaks, no
// use after free (ASan/TSan builds).
TEST(DevicePoolLifetime, DestroyWhileOtherThreadsRelease) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  constexpr int kReleasers = 3;
  constexpr int kLeasesEach = 4;
  const std::uint64_t rounds = destroy_rounds();
  std::vector<std::vector<DevicePool::Lease>> handed(kReleasers);
  std::atomic<std::uint64_t> round_go{0};
  std::atomic<int> done{0};
  std::vector<std::thread> releasers;
  for (int t = 0; t < kReleasers; ++t) {
    releasers.emplace_back([&, t] {
      for (std::uint64_t round = 1; round <= rounds; ++round) {
        for (std::uint64_t seen = round_go.load(std::memory_order_acquire); seen < round;
             seen = round_go.load(std::memory_order_acquire)) {
          round_go.wait(seen, std::memory_order_acquire);
        }
        // Some releases go through this thread's cache, some after the pool is gone.
        for (auto& lease : handed[t]) {
          lease.reset();
          if ((round + t) % 3 == 0) {  // vary the interleaving without leaving the CPU
            volatile int sink = 0;
            for (int spin = 0; spin < 200; ++spin) sink = spin;
          }
        }
        handed[t].clear();
        done.fetch_add(1, std::memory_order_acq_rel);
        done.notify_all();
      }
    });
  }
  std::uint64_t warnings = 0;
  for (std::uint64_t round = 1; round <= rounds; ++round) {
    auto options = DevicePool::Options{};
    options.validate_deallocations = round % 2 == 0;
    auto pool = std::make_unique<DevicePool>(upstream, options);
    for (int t = 0; t < kReleasers; ++t) {
      for (int i = 0; i < kLeasesEach; ++i) handed[t].push_back(pool->acquire(256 << (i % 4)));
    }
    pool->deallocate(pool->allocate(4096), 4096);  // something cached
    ::testing::internal::CaptureStderr();
    round_go.store(round, std::memory_order_release);
    round_go.notify_all();
    if (round % 2 == 1) std::this_thread::yield();
    pool.reset();  // races the releasers
    if (!::testing::internal::GetCapturedStderr().empty()) ++warnings;
    for (int seen = done.load(std::memory_order_acquire);
         seen < static_cast<int>(round) * kReleasers; seen = done.load(std::memory_order_acquire)) {
      done.wait(seen, std::memory_order_acquire);
    }
    ASSERT_EQ(upstream->live_bytes(), 0U) << "round " << round;
  }
  for (auto& thread : releasers) thread.join();
  EXPECT_EQ(upstream->bad_frees(), 0U);
  EXPECT_EQ(upstream->allocations(), upstream->frees());
  std::printf("[lifetime] %llu rounds, %llu destroyed with leases outstanding\n",
              static_cast<unsigned long long>(rounds), static_cast<unsigned long long>(warnings));
}

}  // namespace
}  // namespace vram::testing

// Stream-ordered deallocation (the header's "When a deallocated block may be handed out again").
namespace vram::testing {
namespace {

using namespace vram::literals;

cudaStream_t fake_stream(std::uintptr_t id) { return reinterpret_cast<cudaStream_t>(id); }

struct StreamPool {
  explicit StreamPool(std::size_t large_segment_bytes = std::size_t{20} << 20) {
    DevicePool::Options options;
    options.validate_deallocations = true;
    options.large_tier.segment_bytes = large_segment_bytes;
    options.fence = fence;
    pool = std::make_unique<DevicePool>(upstream, options);
  }
  std::shared_ptr<TestUpstream> upstream =
      std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  std::shared_ptr<ManualFence> fence = std::make_shared<ManualFence>();
  std::unique_ptr<DevicePool> pool;
};

TEST(DevicePoolStreams, SmallBlockFreedOnAStreamIsReusedAtOnceOnThatStreamOnly) {
  StreamPool p;
  DevicePool& pool = *p.pool;
  void* a = pool.allocate_async(4096, fake_stream(1));
  pool.deallocate_async(a, 4096, fake_stream(1));
  void* same = pool.allocate_async(4096, fake_stream(1));
  EXPECT_EQ(same, a) << "same stream: stream order makes immediate reuse safe";
  pool.deallocate_async(same, 4096, fake_stream(1));
  void* other = pool.allocate_async(4096, fake_stream(2));
  void* plain = pool.allocate(4096);
  EXPECT_NE(other, a) << "stream 1's work may still use it";
  EXPECT_NE(plain, a);
  pool.deallocate_async(other, 4096, fake_stream(2));
  pool.deallocate(plain, 4096);
  pool.trim(0);  // waits for the markers (ManualFence: completes them)
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  EXPECT_EQ(p.upstream->live_bytes(), 0U);
}

TEST(DevicePoolStreams, LargeBlockGoesToAnotherStreamOnlyAfterItsFenceCompletes) {
  StreamPool p;  // 20 MiB segments; `keep` stops a's segment from being wholly free
  DevicePool& pool = *p.pool;
  void* keep = pool.allocate_async(8_MiB, fake_stream(1));
  char* a = static_cast<char*>(pool.allocate_async(4_MiB, fake_stream(1)));
  pool.deallocate_async(a, 4_MiB, fake_stream(1));  // merges with the 8 MiB rest: 12 MiB
  EXPECT_EQ(pool.allocate_async(4_MiB, fake_stream(1)), a);
  pool.deallocate_async(a, 4_MiB, fake_stream(1));
  void* b = pool.allocate_async(4_MiB, fake_stream(2));
  EXPECT_NE(b, a);
  EXPECT_EQ(p.fence->recorded(), 1U) << "one marker on stream 1, recorded lazily";
  EXPECT_EQ(p.fence->waits(), 0U) << "no wholly free segment: nothing to wait for";
  EXPECT_EQ(p.upstream->allocations(), 2U);
  p.fence->complete_all();  // stream 1's work is done
  void* c = pool.allocate_async(4_MiB, fake_stream(3));
  EXPECT_EQ(c, a) << "completed: any stream (the 12 MiB range is the best fit)";
  pool.deallocate_async(b, 4_MiB, fake_stream(2));
  pool.deallocate(c, 4_MiB);
  pool.deallocate(keep, 8_MiB);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

// Growing first waits for the stream of a wholly free segment (the host blocks on its
// marker, as the device upstream's free would synchronize anyway) and then reuses it,
// instead of taking another segment beside it.
TEST(DevicePoolStreams, GrowingWaitsForAWhollyFreeSegmentOfAnotherStream) {
  StreamPool p(4_MiB);  // a 4 MiB block fills its segment
  DevicePool& pool = *p.pool;
  char* a = static_cast<char*>(pool.allocate_async(4_MiB, fake_stream(1)));
  pool.deallocate_async(a, 4_MiB, fake_stream(1));
  void* b = pool.allocate_async(4_MiB, fake_stream(2));
  EXPECT_EQ(b, a) << "reused after the wait";
  EXPECT_EQ(p.fence->recorded(), 1U);
  EXPECT_EQ(p.fence->waits(), 1U) << "the pool waited for stream 1's marker";
  EXPECT_EQ(p.upstream->allocations(), 1U) << "no second segment";
  pool.deallocate_async(b, 4_MiB, fake_stream(2));
  // A segment that does not fit is waited for and given back before the tier grows.
  void* big = pool.allocate_async(8_MiB, fake_stream(3));
  EXPECT_EQ(p.fence->waits(), 2U);
  EXPECT_EQ(p.upstream->live_bytes(), 8_MiB) << "the 4 MiB segment went back first";
  pool.deallocate(big, 8_MiB);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

// A stream-ordered free absorbs untagged free neighbours, so a segment freed partly with
// plain frees and partly on a stream becomes one range again (reusable on that stream).
TEST(DevicePoolStreams, StreamFreeMergesWithUntaggedNeighbours) {
  StreamPool p;
  DevicePool& pool = *p.pool;
  char* x = static_cast<char*>(pool.allocate(4_MiB));
  void* y = pool.allocate(4_MiB);
  pool.deallocate(x, 4_MiB);
  pool.deallocate_async(y, 4_MiB, fake_stream(1));
  EXPECT_EQ(pool.allocate_async(20_MiB, fake_stream(1)), x) << "x + y + rest: the whole segment";
  EXPECT_EQ(p.upstream->allocations(), 1U);
  EXPECT_EQ(p.fence->recorded(), 0U);
  pool.deallocate(x, 20_MiB);
}

// Growing gives back wholly free segments only past the budget (the peak of bytes in use
// plus 1/16): enough of them to come back under it, so the next step finds the rest.
TEST(DevicePoolStreams, GrowingGivesBackOnlyWhatExceedsTheBudget) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream);
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) blocks.push_back(pool.allocate(64_MiB));  // a segment each
  pool.deallocate(blocks[0], 64_MiB);    // peak in use 1024 MiB: budget 1088 MiB
  void* within = pool.allocate(72_MiB);  // fits no free range; 1024 + 72 is within budget
  EXPECT_EQ(upstream->live_bytes(), 1096_MiB) << "the wholly free 64 MiB segment stays";
  blocks[0] = pool.allocate(64_MiB);
  EXPECT_EQ(upstream->allocations(), 17U) << "and serves the next request";
  for (void* block : blocks) pool.deallocate(block, 64_MiB);  // 1096 MiB free, none in use
  void* past = pool.allocate(100_MiB);  // peak in use now 1096: 1096 + 100 passes 1164.5
  EXPECT_EQ(upstream->live_bytes(), 1096_MiB - 64_MiB + 100_MiB)
      << "one wholly free segment, the smallest covering the excess (31.5 MiB), went back";
  EXPECT_EQ(upstream->allocations(), 18U);
  pool.deallocate(within, 72_MiB);
  pool.deallocate(past, 100_MiB);
}

// growth_headroom sets the budget: with 1/2 the idle segment of the test above stays where
// 1/16 gave it back, with 0 even the growth that 1/16 allowed gives it back; a negative or
// NaN headroom is refused before anything is allocated.
TEST(DevicePoolStreams, GrowthHeadroomSetsTheBudget) {
  for (const double headroom : {0.0, 0.5}) {
    SCOPED_TRACE(headroom);
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    DevicePool::Options options;
    options.growth_headroom = headroom;
    DevicePool pool(upstream, options);
    std::vector<void*> blocks;
    for (int i = 0; i < 16; ++i) blocks.push_back(pool.allocate(64_MiB));  // peak 1024 MiB
    pool.deallocate(blocks[0], 64_MiB);
    void* grown = pool.allocate(72_MiB);  // fits no free range: 1024 + 72 reserved
    if (headroom == 0) {
      EXPECT_EQ(upstream->live_bytes(), 1024_MiB - 64_MiB + 72_MiB)
          << "no headroom: the wholly free 64 MiB segment went back";
    } else {
      EXPECT_EQ(upstream->live_bytes(), 1096_MiB) << "within 1.5x the peak: it stays";
    }
    pool.deallocate(grown, 72_MiB);
    for (std::size_t i = 1; i < blocks.size(); ++i) pool.deallocate(blocks[i], 64_MiB);
  }
  for (const double bad : {-0.25, std::nan("")}) {
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    DevicePool::Options options;
    options.growth_headroom = bad;
    EXPECT_THROW(DevicePool(upstream, options), InvalidArgument);
    EXPECT_EQ(upstream->allocations(), 0U);
  }
}

// The budget follows each tier's own peak: a step that uses 64 MiB of small blocks, then
// (after freeing them) one 64 MiB block, keeps both tiers' segments. A budget over the peak
// of their sum (64 MiB + 1/16) made each phase give back what the other takes again, two
// upstream calls and two frees every step.
TEST(DevicePoolStreams, TiersPeakingAtDifferentMomentsKeepTheirSegments) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Options options;
  options.thread_cache.blocks = 0;  // small blocks straight back to their segments
  options.max_cached_blocks_per_class = 0;
  DevicePool pool(upstream, options);
  std::uint64_t after_first_step = 0;
  for (int step = 0; step < 5; ++step) {
    std::vector<void*> small;
    for (int i = 0; i < 64; ++i) small.push_back(pool.allocate(1_MiB));
    for (void* block : small) pool.deallocate(block, 1_MiB);
    void* large = pool.allocate(64_MiB);
    pool.deallocate(large, 64_MiB);
    if (step == 0) after_first_step = upstream->allocations();
  }
  EXPECT_EQ(upstream->allocations(), after_first_step) << "no upstream call after the first step";
  EXPECT_EQ(pool.stats().upstream_frees, 0U);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

// A virtual-memory large tier (without large_tier.unmap_before_map) keeps no growth budget, so its
// growth must not make the small tier give back its wholly free segments (each a cudaFree
// the next step would undo); checked over the host emulation.
TEST(DevicePoolStreams, VirtualLargeTierGrowthLeavesTheSmallTierAlone) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Options options;
  options.thread_cache.blocks = 0;
  options.max_cached_blocks_per_class = 0;
  options.large_tier.memory = LargeTierMemory::virtual_memory;
  options.large_tier.virtual_reservation_bytes = 4_GiB;
  DevicePool pool(upstream, options);
  ASSERT_TRUE(pool.uses_virtual_memory());
  for (int step = 0; step < 2; ++step) {
    std::vector<void*> small;
    for (int i = 0; i < 64; ++i) small.push_back(pool.allocate(1_MiB));
    for (void* block : small) pool.deallocate(block, 1_MiB);
    void* a = pool.allocate(100_MiB);
    void* b = pool.allocate(100_MiB);
    pool.deallocate(a, 100_MiB);
    void* c = pool.allocate(150_MiB);  // fits no free range: maps new granules
    pool.deallocate(b, 100_MiB);
    pool.deallocate(c, 150_MiB);
  }
  EXPECT_EQ(pool.stats().upstream_frees, 0U) << "no small segment went back, nothing unmapped";
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

// trim() restarts the budget from what is in use: the all-time peak no longer lets a
// later growth keep idle segments.
TEST(DevicePoolStreams, TrimRestartsTheGrowthBudget) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream);
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) blocks.push_back(pool.allocate(64_MiB));  // peak 1024 MiB
  for (void* block : blocks) pool.deallocate(block, 64_MiB);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  void* a = pool.allocate(64_MiB);
  pool.deallocate(a, 64_MiB);
  void* b = pool.allocate(100_MiB);  // peak in use now 100 MiB: 64 + 100 passes 106.25
  EXPECT_EQ(upstream->live_bytes(), 100_MiB) << "the idle 64 MiB segment went back";
  pool.deallocate(b, 100_MiB);
}

// large_tier.max_segment_waste_bytes: a wholly free segment is not split for a request that would
// leave more than that idle; it goes back and a segment sized for the request is taken.
TEST(DevicePoolStreams, WhollyFreeSegmentIsNotSplitPastTheWasteLimit) {
  for (const std::size_t limit : {std::size_t{8} << 20, SIZE_MAX}) {
    SCOPED_TRACE(limit);
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    DevicePool::Options options;
    options.large_tier.max_segment_waste_bytes = limit;
    DevicePool pool(upstream, options);
    void* big = pool.allocate(64_MiB);
    pool.deallocate(big, 64_MiB);
    void* small = pool.allocate(16_MiB);
    EXPECT_EQ(upstream->live_bytes(), limit == SIZE_MAX ? 64_MiB : 16_MiB);
    EXPECT_EQ(pool.stats().peak_bytes_reserved, 64_MiB) << "the big one went back first";
    pool.deallocate(small, 16_MiB);
  }
}

// trim() and destruction must not record a marker on a stream that freed blocks: that
// stream may have been destroyed since (recording on a destroyed stream is undefined
// behaviour). They quiesce the stream marker source instead.
TEST(DevicePoolStreams, TrimAndDestructionRecordNothingOnTheFreeingStreams) {
  auto fence = std::make_shared<ManualFence>();
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  std::uint64_t recorded_before_destruction = 0;
  {
    DevicePool::Options options;
    options.fence = fence;
    DevicePool pool(upstream, options);
    void* small = pool.allocate_async(4096, fake_stream(1));
    void* large = pool.allocate_async(4_MiB, fake_stream(2));
    // Young streams: each free records a marker on its own stream, inside its own call.
    pool.deallocate_async(small, 4096, fake_stream(1));
    pool.deallocate_async(large, 4_MiB, fake_stream(2));
    const std::uint64_t recorded = fence->recorded();
    pool.trim(0);
    EXPECT_EQ(fence->recorded(), recorded) << "trim recorded a marker on a freeing stream";
    EXPECT_EQ(upstream->live_bytes(), 0U) << "after trim the stream-freed blocks went back";
    void* again = pool.allocate_async(4_MiB, fake_stream(3));
    pool.deallocate_async(again, 4_MiB, fake_stream(3));
    recorded_before_destruction = fence->recorded();
  }  // destruction with a block freed on stream 3
  EXPECT_EQ(fence->recorded(), recorded_before_destruction)
      << "destruction recorded a marker on a freeing stream";
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// ManualFence whose quiesce() first runs a hook (a free on another thread that lands while
// trim() waits for the device), and which counts waits for markers recorded on stream 1.
class QuiesceHookFence final : public StreamFence {
 public:
  std::uint64_t record(cudaStream_t stream) override {
    const std::uint64_t marker = inner_.record(stream);
    if (stream == reinterpret_cast<cudaStream_t>(1)) last_on_1_ = marker;
    return marker;
  }
  bool completed(std::uint64_t marker) noexcept override { return inner_.completed(marker); }
  void wait(std::uint64_t marker) noexcept override {
    if (marker == last_on_1_) ++waits_on_1_;
    inner_.wait(marker);
  }
  void release(std::uint64_t marker) noexcept override { inner_.release(marker); }
  void quiesce() noexcept override {
    if (auto hook = std::exchange(on_quiesce, nullptr)) hook();
    inner_.quiesce();
  }
  std::uint64_t waits_on_1() const { return waits_on_1_; }
  std::function<void()> on_quiesce;

 private:
  ManualFence inner_;
  std::uint64_t last_on_1_ = 0;
  std::uint64_t waits_on_1_ = 0;
};

// A block freed on stream 1 after trim()'s device synchronize began may still be used by
// work queued on stream 1 after that synchronize: trim must not treat it as completed. It
// may keep it, or wait for a marker on stream 1 (alive: it was just used) before giving it
// back: it must not untag the ranges freed after its synchronize began and give their
// segments back at once.
TEST(DevicePoolStreams, FreeRacingTrimsDeviceSynchronizeKeepsItsStream) {
  auto fence = std::make_shared<QuiesceHookFence>();
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Options options;
  options.fence = fence;
  options.large_tier.segment_bytes = 4_MiB;
  DevicePool pool(upstream, options);
  void* a = pool.allocate_async(4_MiB, fake_stream(1));
  void* s = pool.allocate_async(4096, fake_stream(1));
  fence->on_quiesce = [&] {
    std::thread([&] {
      pool.deallocate_async(a, 4_MiB, fake_stream(1));
      pool.deallocate_async(s, 4096, fake_stream(1));
    }).join();
  };
  pool.trim(0);
  const bool kept = upstream->live_bytes() == 4_MiB + 2_MiB;
  EXPECT_TRUE(kept || fence->waits_on_1() > 0)
      << "trim gave back segments whose blocks stream 1's queued work may still use";
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(DevicePoolStreams, PlainFreeIsReusableByEveryStream) {
  StreamPool p;
  DevicePool& pool = *p.pool;
  void* a = pool.allocate(4096);
  pool.deallocate(a, 4096);
  EXPECT_EQ(pool.allocate_async(4096, fake_stream(7)), a);
  EXPECT_EQ(p.fence->recorded(), 0U) << "no marker needed for completed blocks";
  pool.deallocate_async(a, 4096, fake_stream(7));  // a young stream's: its own marker
  const std::uint64_t recorded = p.fence->recorded();
  char* big = static_cast<char*>(pool.allocate(8_MiB));
  pool.deallocate(big, 8_MiB);
  EXPECT_EQ(pool.allocate_async(8_MiB, fake_stream(9)), big);
  pool.deallocate(big, 8_MiB);
  EXPECT_EQ(p.fence->recorded(), recorded) << "no marker needed for completed blocks";
}

TEST(DevicePoolStreams, ThreadCacheSwitchingStreamsKeepsEachBlocksStream) {
  StreamPool p;
  DevicePool& pool = *p.pool;
  void* a = pool.allocate_async(4096, fake_stream(1));
  void* b = pool.allocate_async(4096, fake_stream(2));
  pool.deallocate_async(a, 4096, fake_stream(1));  // cache tagged stream 1
  pool.deallocate_async(b, 4096, fake_stream(2));  // moves a out under stream 1's tag
  EXPECT_EQ(pool.allocate_async(4096, fake_stream(2)), b);
  void* c = pool.allocate_async(4096, fake_stream(2));
  EXPECT_NE(c, a) << "a still belongs to stream 1";
  EXPECT_EQ(pool.allocate_async(4096, fake_stream(1)), a);
  pool.deallocate(a, 4096);
  pool.deallocate(b, 4096);
  pool.deallocate(c, 4096);
}

TEST(DevicePoolStreams, PeakInUseIsTrackedWhenAsked) {
  DevicePool::Options options;
  options.track_peak_in_use = true;
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), options);
  void* a = pool.allocate(1_MiB);
  void* b = pool.allocate(3_MiB);
  pool.deallocate(a, 1_MiB);
  void* c = pool.allocate(4096);
  pool.deallocate(b, 3_MiB);
  pool.deallocate(c, 4096);
  const auto s = pool.stats();
  EXPECT_EQ(s.peak_bytes_in_use, pool.block_bytes(1_MiB) + pool.block_bytes(3_MiB));
  EXPECT_EQ(s.bytes_in_use, 0U);
  pool.reset_peak();
  EXPECT_EQ(pool.stats().peak_bytes_in_use, 0U);
}

TEST(DevicePoolVirtual, HostEmulationServesTheContractAndGivesGranulesBack) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Options options;
  options.validate_deallocations = true;
  options.large_tier.memory = LargeTierMemory::virtual_memory;
  options.large_tier.virtual_reservation_bytes = 1_GiB;
  {
    DevicePool pool(upstream, options);
    std::vector<DevicePool::Lease> leases;
    for (int i = 0; i < 8; ++i) leases.push_back(pool.acquire(3_MiB + 4096 * i));
    for (std::size_t i = 0; i < leases.size(); ++i) {
      HostMemory::fill(leases[i].data(), leases[i].size(), static_cast<unsigned char>(i + 1));
    }
    for (std::size_t i = 0; i < leases.size(); ++i) {
      EXPECT_TRUE(
          HostMemory::holds(leases[i].data(), leases[i].size(), static_cast<unsigned char>(i + 1)));
    }
    auto s = pool.stats();
    EXPECT_EQ(s.bytes_reserved, upstream->live_bytes());
    // The default maps ahead of growth (large_tier.virtual_map_ahead_bytes): at most 1/4 of what is
    // held beyond the blocks' granules.
    EXPECT_LE(s.bytes_reserved, s.bytes_in_use + 2_MiB + s.bytes_reserved / 4);
    leases.clear();
    pool.trim(0);
    EXPECT_EQ(upstream->live_bytes(), 0U);
  }
  EXPECT_EQ(upstream->bad_frees(), 0U);
  options.large_tier.virtual_map_ahead_bytes = 0;
  {
    DevicePool pool(upstream, options);
    std::vector<DevicePool::Lease> leases;
    for (int i = 0; i < 8; ++i) leases.push_back(pool.acquire(3_MiB + 4096 * i));
    auto s = pool.stats();
    EXPECT_LT(s.bytes_reserved, s.bytes_in_use + 2_MiB) << "granules only where blocks live";
    leases.clear();
    pool.trim(0);
    EXPECT_EQ(upstream->live_bytes(), 0U);
  }
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

// In virtual mode the large tier is one range; a block freed on a
// stream absorbs the untagged free tail of the whole reservation (insert_free's merge rule),
// so another stream could find nothing untagged and answer each such allocation with
// trim(0, wait) (a device synchronize, every free run unmapped). Past the growth budget (here:
// 4 MiB more than the 8 MiB peak of used) s2 takes s1's range instead of mapping more:
// - s1 steady: its free recorded nothing; growing wants a marker on s1 (recorded by s1's next
//   call: the pool never records on a caller's stream outside a call that passes it) and,
//   with s1 not seen since, quiesces the device once: no marker on s1, no trim;
// - s1 young: its free recorded a marker on s1; growing waits for that marker (an event, not
//   the device), no quiesce.
// Nothing unmapped either way.
TEST(DevicePoolVirtualStreams, AStreamFreeDoesNotTakeTheWholeReservationFromOtherStreams) {
  for (const bool steady : {true, false}) {
    SCOPED_TRACE(steady ? "s1 steady" : "s1 young");
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto fence = std::make_shared<ManualFence>();
    DevicePool::Options options;
    options.fence = fence;
    options.large_tier.memory = LargeTierMemory::virtual_memory;
    options.small_tier.max_block_bytes = std::size_t{256} << 10;
    options.large_tier.virtual_reservation_bytes = 1_GiB;
    {
      DevicePool pool(upstream, options);
      const auto s1 = reinterpret_cast<cudaStream_t>(0x10);
      const auto s2 = reinterpret_cast<cudaStream_t>(0x20);
      if (steady) free_often_on(pool, s1);
      fence->complete_all();  // the emulated device ran s1's work so far
      void* b = pool.allocate_async(4_MiB, s2);
      void* a = pool.allocate_async(4_MiB, s1);  // beside the untagged free tail
      pool.deallocate_async(a, 4_MiB, s1);       // s1's work may still use a: a stays s1's
      const std::uint64_t recorded = fence->recorded();
      const std::uint64_t waits = fence->waits();
      const std::size_t reserved = pool.stats().bytes_reserved;
      void* c = pool.allocate_async(4_MiB, s2);
      EXPECT_EQ(pool.stats().oom_retries, 0U)
          << "1 GiB of untagged address space is left: no synchronize-and-trim retry";
      EXPECT_EQ(fence->recorded(), recorded) << "nothing recorded on s1 outside a call on s1";
      EXPECT_EQ(pool.stats().stream_marker_wants, steady ? 1U : 0U) << "s1's marker is wanted";
      EXPECT_EQ(pool.stats().stream_quiesces, steady ? 1U : 0U)
          << "growing past the budget quiesces once, for a steady s1 only";
      if (!steady) EXPECT_GT(fence->waits(), waits) << "s2 waited for s1's marker";
      EXPECT_EQ(c, a) << "then s1's range serves s2";
      EXPECT_EQ(pool.stats().bytes_reserved, reserved) << "nothing new mapped";
      pool.deallocate(b, 4_MiB);
      pool.deallocate(c, 4_MiB);
      pool.trim(0);
      EXPECT_EQ(upstream->live_bytes(), 0U);
    }
    EXPECT_EQ(upstream->bad_frees(), 0U);
  }
}

#ifdef VRAM_HAVE_TEST_KERNELS
// A block freed on a stream that is being captured into a CUDA graph: the free happens
// when the graph runs, not now. Another stream's request that grows the pool must neither
// take the block (an event recorded on the capturing stream is a graph node, and its query
// fails with cudaErrorCapturedEvent, which must not read as "completed") nor synchronize the
// device (a quiesce invalidates the capture): under a capture scope it does neither.
TEST(DevicePoolStreamsGpu, ABlockFreedDuringAGraphCaptureIsNotHandedToAnotherStream) {
  VRAM_GPU_TEST_OR_SKIP();
  DevicePool pool(0);
  cuda::Stream capturing;
  cuda::Stream other;
  void* keep = pool.allocate_async(2_MiB, capturing.get());  // keeps the range off the tail
  const auto id = DevicePool::new_graph_pool();
  void* block = nullptr;
  void* taken = nullptr;
  {
    auto scope = pool.capture_into(id, capturing.get());
    ASSERT_EQ(cudaStreamBeginCapture(capturing.get(), cudaStreamCaptureModeRelaxed), cudaSuccess);
    block = pool.allocate_async(8_MiB, capturing.get());
    launch_fill(block, (8_MiB) / 4, 0x11111111u, capturing.get());
    pool.deallocate_async(block, 8_MiB, capturing.get());
    taken = pool.allocate_async(8_MiB, other.get());  // would grow: fences the others
    EXPECT_NE(taken, block) << "the captured work has not run: the block is not free";
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(capturing.get(), &graph), cudaSuccess);
    ASSERT_NE(graph, nullptr);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }
  EXPECT_EQ(pool.stats().stream_quiesces, 0U) << "a device synchronize during the capture";
  pool.deallocate_async(taken, 8_MiB, other.get());
  pool.deallocate_async(keep, 2_MiB, capturing.get());
  other.synchronize();
  capturing.synchronize();
  pool.release_graph_pool(id);
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

TEST(DevicePoolStreamsGpu, StreamDestroyedBeforeThePoolIsSafe) {
  VRAM_GPU_TEST_OR_SKIP();
  std::size_t reserved_after_trim = 1;
  {
    DevicePool pool(0);
    {
      cuda::Stream stream;
      for (std::size_t bytes : {std::size_t{4096}, std::size_t{3} << 20, std::size_t{64} << 20}) {
        void* block = pool.allocate_async(bytes, stream.get());
        launch_fill(block, bytes / 4, 0x5A5A5A5Au, stream.get());
        pool.deallocate_async(block, bytes, stream.get());
      }
    }  // the stream is gone; its blocks still wait in the pool
    {
      cuda::Stream stream;  // may reuse the destroyed stream's handle
      void* block = pool.allocate_async(4096, stream.get());
      pool.deallocate_async(block, 4096, stream.get());
      stream.synchronize();
    }
    pool.trim(0);
    reserved_after_trim = pool.stats().bytes_reserved;
  }  // destroyed after both streams
  EXPECT_EQ(reserved_after_trim, 0U);
}

// Allocating on a stream while this thread captures it in global mode (PyTorch's default),
// under a capture scope: the request finds only another stream's freed memory. A steady
// stream's free has no marker, none may be recorded on that stream outside a call on it, and
// a quiesce (a device synchronize) would invalidate the capture, so the pool grows, in relaxed
// capture mode. A young stream's free recorded its own marker (stream_ages.hpp), which has
// completed here: the capture may take that block. Either way the capture stays valid and the
// graph runs.
TEST(DevicePoolStreamsGpu, AllocatingDuringAGlobalModeCaptureKeepsTheCaptureValid) {
  VRAM_GPU_TEST_OR_SKIP();
  for (const bool steady_other : {true, false}) {
    SCOPED_TRACE(steady_other ? "the other stream steady" : "the other stream young");
    DevicePool pool(0);
    cuda::Stream capturing;
    cuda::Stream other;
    if (steady_other) free_often_on(pool, other.get());
    void* keep = pool.allocate_async(2_MiB, other.get());  // keeps a off the unmapped tail
    void* a = pool.allocate_async(8_MiB, other.get());
    void* keep2 = pool.allocate_async(2_MiB, other.get());
    launch_fill(a, (8_MiB) / 4, 0x22222222u, other.get());
    pool.deallocate_async(a, 8_MiB, other.get());
    other.synchronize();  // the work at a's free has completed
    const auto id = DevicePool::new_graph_pool();
    cudaGraph_t graph = nullptr;
    void* b = nullptr;
    {
      auto scope = pool.capture_into(id, capturing.get());
      ASSERT_EQ(cudaStreamBeginCapture(capturing.get(), cudaStreamCaptureModeGlobal), cudaSuccess);
      b = pool.allocate_async(8_MiB, capturing.get());
      launch_fill(b, (8_MiB) / 4, 0x33333333u, capturing.get());
      EXPECT_EQ(cudaStreamEndCapture(capturing.get(), &graph), cudaSuccess)
          << "the pool's calls did not invalidate the capture";
    }
    if (steady_other) {
      EXPECT_NE(b, a) << "the steady stream's free, with no marker and no quiesce";
    } else {
      EXPECT_EQ(b, a) << "the young stream's completed marker did not free its block";
    }
    EXPECT_EQ(pool.stats().stream_quiesces, 0U) << "a device synchronize during the capture";
    if (graph != nullptr) {
      cudaGraphExec_t exec = nullptr;
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, capturing.get()), cudaSuccess);
      capturing.synchronize();
      EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
      EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
    }
    (void)cudaGetLastError();
    pool.deallocate_async(b, 8_MiB, capturing.get());
    pool.deallocate_async(keep, 2_MiB, other.get());
    pool.deallocate_async(keep2, 2_MiB, other.get());
    pool.release_graph_pool(id);
    pool.trim(0);
    EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  }
}

// On the GPU: a block freed on stream A while a long kernel on A still writes it is not
// handed to stream B until that kernel has finished; on A it is reused at once.
TEST(DevicePoolStreamsGpu, BlockFreedBehindALongKernelIsNotReusedByAnotherStreamEarly) {
  VRAM_GPU_TEST_OR_SKIP();
  DevicePool pool(0);
  cuda::Stream a;
  cuda::Stream b;
  constexpr std::size_t kBytes = 1 << 20;
  constexpr std::size_t kWords = kBytes / 4;
  void* block = pool.allocate_async(kBytes, a.get());
  // Spins ~200 ms, then fills with 0xAAAAAAAA: the block is in use on A until then.
  launch_spin_then_fill(block, kWords, 0xAAAAAAAAu, 200'000'000, a.get());
  pool.deallocate_async(block, kBytes, a.get());
  void* on_a = pool.allocate_async(kBytes, a.get());
  EXPECT_EQ(on_a, block) << "same stream: reused at once (stream order protects it)";
  pool.deallocate_async(on_a, kBytes, a.get());
  void* on_b = pool.allocate_async(kBytes, b.get());
  launch_fill(on_b, kWords, 0xBBBBBBBBu, b.get());
  cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  // Had on_b been the block still written by A's kernel, that kernel's fill (after its
  // spin) would have overwritten B's.
  unsigned long long* mismatches = nullptr;
  cuda::check(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches), "cudaMalloc");
  cuda::check(cudaMemset(mismatches, 0, sizeof *mismatches), "cudaMemset");
  launch_count_mismatches(on_b, kWords, 0xBBBBBBBBu, mismatches, nullptr);
  unsigned long long host = 0;
  cuda::check(cudaMemcpy(&host, mismatches, sizeof host, cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(mismatches);
  EXPECT_EQ(host, 0U) << "stream B got memory still written by stream A's kernel";
  pool.deallocate_async(on_b, kBytes, b.get());
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

// CUDA virtual memory: blocks backed by runs of granules (one cuMemCreate/cuMemMap/
// cuMemSetAccess per run) are writable by kernels across run boundaries, reuse after a
// free makes no new map, and trim() gives every run back.
TEST(DevicePoolVirtualGpu, RunsOfGranulesHoldKernelDataAndGoBackOnTrim) {
  VRAM_GPU_TEST_OR_SKIP();
  DevicePool::Options options;
  options.large_tier.memory = LargeTierMemory::virtual_memory;
  options.small_tier.max_block_bytes = std::size_t{256} << 10;
  options.large_tier.virtual_reservation_bytes = 8_GiB;
  options.large_tier.virtual_run_bytes =
      64_MiB;  // the 300 MiB block spans five runs (default: one)
  DevicePool pool(0, options);
  cuda::Stream stream;
  const std::vector<std::size_t> sizes = {3_MiB, 64_MiB + 4096, 5_MiB, 300_MiB, 1_MiB + 512};
  std::vector<void*> blocks;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    blocks.push_back(pool.allocate_async(sizes[i], stream.get()));
    launch_fill(blocks.back(), sizes[i] / 4, 0x1000u + static_cast<std::uint32_t>(i), stream.get());
  }
  const auto mapped = pool.stats().upstream_allocations;
  std::size_t runs_at_most =
      0;  // a run per large_tier.virtual_run_bytes of a block, one more at its edge
  std::size_t granules = 0;
  for (std::size_t bytes : sizes) {
    runs_at_most +=
        (bytes + options.large_tier.virtual_run_bytes - 1) / options.large_tier.virtual_run_bytes +
        1;
    granules += (bytes + 2_MiB - 1) / 2_MiB;
  }
  EXPECT_LE(mapped, runs_at_most)
      << "runs of up to large_tier.virtual_run_bytes, not one map per granule";
  EXPECT_LT(mapped, granules / 4);
  unsigned long long* mismatches = nullptr;
  cuda::check(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches), "cudaMalloc");
  cuda::check(cudaMemsetAsync(mismatches, 0, sizeof *mismatches, stream.get()), "cudaMemsetAsync");
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    launch_count_mismatches(blocks[i], sizes[i] / 4, 0x1000u + static_cast<std::uint32_t>(i),
                            mismatches, stream.get());
  }
  unsigned long long host = 1;
  cuda::check(cudaMemcpyAsync(&host, mismatches, sizeof host, cudaMemcpyDeviceToHost, stream.get()),
              "cudaMemcpyAsync");
  stream.synchronize();
  cudaFree(mismatches);
  EXPECT_EQ(host, 0U) << "a block's words differ from what its kernel wrote";
  pool.deallocate_async(blocks[3], sizes[3], stream.get());
  void* again = pool.allocate_async(sizes[3], stream.get());
  EXPECT_EQ(again, blocks[3]);
  EXPECT_EQ(pool.stats().upstream_allocations, mapped) << "reuse maps nothing";
  blocks[3] = again;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    pool.deallocate_async(blocks[i], sizes[i], stream.get());
  }
  pool.trim(0);
  const auto s = pool.stats();
  EXPECT_EQ(s.bytes_in_use, 0U);
  EXPECT_EQ(s.bytes_reserved, 0U) << "every run unmapped and released";
}

// The default (LargeTierMemory::automatic) over vram's device upstream is virtual memory on
// a device that supports it and that no other device can reach by peer access (a machine
// with one GPU); `segments` and any other upstream keep segments. A large block of the default
// pool holds what a kernel wrote, and a repeated step makes no driver call.
TEST(DevicePoolVirtualGpu, DefaultPoolRunsItsLargeTierOverVirtualMemory) {
  VRAM_GPU_TEST_OR_SKIP();
  if (!CudaVirtualMemory::supported(0)) GTEST_SKIP() << "device 0 has no virtual memory management";
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
  if (devices > 1)
    GTEST_SKIP() << "several devices: automatic keeps segments where peers could read";
  DevicePool pool(0);
  EXPECT_TRUE(pool.uses_virtual_memory()) << "one device with virtual memory management";
  DevicePool segments(0, DevicePool::Options{.large_tier = {.memory = LargeTierMemory::segments}});
  EXPECT_FALSE(segments.uses_virtual_memory());
  DevicePool custom(std::make_shared<TestUpstream>(std::make_shared<DeviceMemoryUpstream>(0)));
  EXPECT_FALSE(custom.uses_virtual_memory()) << "a custom device upstream is never bypassed";
  cuda::Stream stream;
  std::uint64_t after_first_step = 0;
  for (int step = 0; step < 3; ++step) {
    void* big = pool.allocate_async(100_MiB, stream.get());
    void* other = pool.allocate_async(40_MiB + 512, stream.get());
    launch_fill(big, 100_MiB / 4, 0x2000u + static_cast<std::uint32_t>(step), stream.get());
    unsigned long long* mismatches = nullptr;
    cuda::check(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches),
                "cudaMalloc");
    cuda::check(cudaMemsetAsync(mismatches, 0, sizeof *mismatches, stream.get()),
                "cudaMemsetAsync");
    launch_count_mismatches(big, 100_MiB / 4, 0x2000u + static_cast<std::uint32_t>(step),
                            mismatches, stream.get());
    unsigned long long host = 1;
    cuda::check(
        cudaMemcpyAsync(&host, mismatches, sizeof host, cudaMemcpyDeviceToHost, stream.get()),
        "cudaMemcpyAsync");
    stream.synchronize();
    cudaFree(mismatches);
    EXPECT_EQ(host, 0U) << "step " << step;
    pool.deallocate_async(other, 40_MiB + 512, stream.get());
    pool.deallocate_async(big, 100_MiB, stream.get());
    if (step == 0) after_first_step = pool.stats().upstream_allocations;
  }
  EXPECT_EQ(pool.stats().upstream_allocations, after_first_step) << "warm steps map nothing";
  EXPECT_EQ(pool.stats().upstream_frees, 0U);
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_reserved, 0U);
}
#endif

// Threads on their own (emulated) streams allocate and free stream-ordered and plain, small
// and large, while another completes markers and trims: every block a thread holds is
// filled with its pattern and checked before release (two holders of one byte would clash,
// and under TSan race); nothing in use or reserved at the end.
TEST(DevicePoolStreamsStress, ThreadsOnStreamsWithMarkersCompletingAndTrims) {
  auto fence = std::make_shared<ManualFence>();
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Options options;
  options.fence = fence;
  options.large_tier.segment_bytes = 4_MiB;
  options.large_tier.max_segment_waste_bytes = 2_MiB;
  DevicePool pool(upstream, options);
  std::atomic<int> running{4};
  std::atomic<std::uint64_t> mismatches{0};
  auto worker = [&](int id) {
    std::mt19937 rng(static_cast<std::uint32_t>(id));
    const auto stream = reinterpret_cast<cudaStream_t>(static_cast<std::uintptr_t>(id + 1));
    struct Held {
      unsigned char* p;
      std::size_t bytes;
    };
    std::vector<Held> held;
    auto release = [&](std::size_t i) {
      const Held h = held[i];
      for (std::size_t k = 0; k < h.bytes; k += 61) {
        if (h.p[k] != static_cast<unsigned char>(id)) ++mismatches;
      }
      if (rng() % 4 == 0) {
        pool.deallocate(h.p, h.bytes);
      } else {
        pool.deallocate_async(h.p, h.bytes, stream);
      }
      held[i] = held.back();
      held.pop_back();
    };
    for (int step = 0; step < 1000; ++step) {
      if (held.size() < 8 && rng() % 2 == 0) {
        const std::size_t bytes = rng() % 3 == 0 ? 1 + rng() % (3_MiB) : 1 + rng() % (32_KiB);
        auto* p = static_cast<unsigned char*>(pool.allocate_async(bytes, stream));
        std::memset(p, id, bytes);
        held.push_back({p, bytes});
      } else if (!held.empty()) {
        release(rng() % held.size());
      }
    }
    while (!held.empty()) release(held.size() - 1);
    --running;
  };
  std::vector<std::thread> threads;
  for (int id = 0; id < 4; ++id) threads.emplace_back(worker, id);
  for (int i = 0; running.load() > 0; ++i) {
    fence->complete_all();
    if (i % 16 == 0) pool.trim(i % 32 == 0 ? 0 : 8_MiB);
    std::this_thread::yield();
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0U) << "a byte held by one thread was written by another";
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_reserved, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

}  // namespace
}  // namespace vram::testing
