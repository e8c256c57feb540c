// The per-thread caches of large blocks (src/device_pool/large_block_cache.hpp), which turn on
// where threads meet on the large tier's mutex: the record of leases, the byte cap, the flush
// before any tier grows and before out of memory, stream tags, releases on other threads, and the
// rule that a thread alone on the tier caches nothing. Host memory (segments unless a test
// says otherwise); validation off, as in release builds.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "device_pool/large_block_cache.hpp"
#include "gpu_test_policy.hpp"
#include "steady_stream.hpp"
#include "test_upstreams.hpp"
#include "vram/detail/tier_mutex.hpp"
#include "vram/device_pool.hpp"
#include "vram/stream_fence.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;
using detail::LargeBlockCache;
using Put = LargeBlockCache::Put;

void* fake(std::uintptr_t n) { return reinterpret_cast<void*>(n << 20); }

DevicePool::Options cached_options() {
  DevicePool::Options options;
  options.validate_deallocations = false;
  options.large_tier.memory = LargeTierMemory::segments;
  options.thread_cache.large_from_start = true;
  options.thread_cache.large_chunk_bytes = 0;  // exact sizes only (thread heaps: their own suite)
  return options;
}

// ---- the record ------------------------------------------------------------------------

TEST(DevicePoolLargeThreadCacheRecord, OnlyALeasedBlockOfItsSizeIsCached) {
  LargeBlockCache cache;
  constexpr detail::StreamKey kAny = detail::kUntagged;
  EXPECT_EQ(cache.put(fake(1), 4_MiB, kAny, 64_MiB), Put::to_tier) << "never leased here";
  cache.note_leased(fake(1), 4_MiB);
  EXPECT_EQ(cache.put(fake(1), 4_MiB, kAny, 64_MiB), Put::cached);
  EXPECT_EQ(cache.cached_bytes(), 4_MiB);
  EXPECT_EQ(cache.put(fake(1), 4_MiB, kAny, 64_MiB), Put::double_deallocate);
  EXPECT_EQ(cache.take(8_MiB, kAny), nullptr) << "exact sizes only";
  EXPECT_EQ(cache.take(4_MiB, kAny), fake(1));
  EXPECT_EQ(cache.cached_bytes(), 0U);
  EXPECT_EQ(cache.put(fake(1), 8_MiB, kAny, 64_MiB), Put::to_tier) << "another size: the tier";
  EXPECT_EQ(cache.put(fake(1), 4_MiB, kAny, 64_MiB), Put::to_tier) << "no longer recorded";
}

TEST(DevicePoolLargeThreadCacheRecord, AStreamsBlockServesOnlyThatStreamUntaggedServesAll) {
  LargeBlockCache cache;
  const detail::StreamKey s1 = 0x10;
  const detail::StreamKey s2 = 0x20;
  cache.note_leased(fake(1), 4_MiB);
  cache.note_leased(fake(2), 4_MiB);
  ASSERT_EQ(cache.put(fake(1), 4_MiB, s1, 64_MiB), Put::cached);
  EXPECT_EQ(cache.take(4_MiB, s2), nullptr);
  EXPECT_EQ(cache.take(4_MiB, detail::kUntagged), nullptr);
  EXPECT_EQ(cache.take(4_MiB, s1), fake(1));
  ASSERT_EQ(cache.put(fake(2), 4_MiB, detail::kUntagged, 64_MiB), Put::cached);
  EXPECT_EQ(cache.take(4_MiB, s2), fake(2));
}

TEST(DevicePoolLargeThreadCacheRecord, TheByteCapAndTheCountBoundWhatIsCached) {
  LargeBlockCache cache;
  for (std::uintptr_t i = 1; i <= 3; ++i) cache.note_leased(fake(i), 4_MiB);
  ASSERT_EQ(cache.put(fake(1), 4_MiB, detail::kUntagged, 8_MiB), Put::cached);
  ASSERT_EQ(cache.put(fake(2), 4_MiB, detail::kUntagged, 8_MiB), Put::cached);
  EXPECT_EQ(cache.put(fake(3), 4_MiB, detail::kUntagged, 8_MiB), Put::no_room);
  LargeBlockCache::Cached oldest;
  ASSERT_TRUE(cache.free_oldest([&](const LargeBlockCache::Cached& c) {
    EXPECT_TRUE(cache.holds(c.block)) << "still in its slot while it goes back";
    oldest = c;
  }));
  EXPECT_EQ(oldest.block, fake(1)) << "the oldest goes back first";
  EXPECT_FALSE(cache.holds(fake(1)));
  EXPECT_EQ(cache.put(fake(3), 4_MiB, detail::kUntagged, 8_MiB), Put::cached);
  EXPECT_EQ(cache.cached_bytes(), 8_MiB);
  EXPECT_EQ(cache.put(fake(1), 4_MiB, detail::kUntagged, 8_MiB), Put::to_tier)
      << "a block that went back is no longer recorded";

  LargeBlockCache many;
  std::size_t cached = 0;
  for (std::uintptr_t i = 1; i <= LargeBlockCache::kMaxCached + 4; ++i) {
    many.note_leased(fake(i), 2_MiB);
    if (many.put(fake(i), 2_MiB, detail::kUntagged, 1_GiB) == Put::cached) ++cached;
  }
  EXPECT_EQ(cached, LargeBlockCache::kMaxCached);
  EXPECT_EQ(many.cached_count(), LargeBlockCache::kMaxCached);
  std::size_t drained = 0;
  many.drain([&](const LargeBlockCache::Cached&) { ++drained; });
  EXPECT_EQ(drained, LargeBlockCache::kMaxCached);
  EXPECT_EQ(many.cached_bytes(), 0U);
}

// Against a model: random leases, releases, takes and forgotten leases (the record fills
// up and drops its leased entries); a cached block is always found and never lost.
TEST(DevicePoolLargeThreadCacheRecord, TheRecordAgreesWithAModelThroughFillsAndErases) {
  LargeBlockCache cache;
  std::mt19937 random(7);
  std::map<void*, std::size_t> cached;  // the model: what the cache holds
  std::map<void*, std::size_t> leased;  // leased here, maybe forgotten by the cache
  std::uintptr_t next = 1;
  for (int step = 0; step < 20000; ++step) {
    const int what = static_cast<int>(random() % 3);
    if (what == 0) {
      const std::size_t bytes = (1 + random() % 4) * 2_MiB;
      void* block = fake(next++);
      cache.note_leased(block, bytes);
      leased[block] = bytes;
    } else if (what == 1 && !leased.empty()) {
      auto it = leased.begin();
      std::advance(it, random() % leased.size());
      const Put put = cache.put(it->first, it->second, detail::kUntagged, 1_GiB);
      ASSERT_NE(put, Put::double_deallocate);
      if (put == Put::no_room) {
        LargeBlockCache::Cached oldest;
        ASSERT_TRUE(cache.free_oldest([&](const LargeBlockCache::Cached& c) { oldest = c; }));
        ASSERT_EQ(cached.erase(oldest.block), 1U);
      } else if (put == Put::cached) {
        cached[it->first] = it->second;
      }
      leased.erase(it);  // released either way (to the cache or to the tier)
    } else if (what == 2) {
      const std::size_t bytes = (1 + random() % 4) * 2_MiB;
      void* block = cache.take(bytes, detail::kUntagged);
      bool model_has = false;
      for (const auto& [b, n] : cached) model_has = model_has || n == bytes;
      ASSERT_EQ(block != nullptr, model_has);
      if (block != nullptr) {
        ASSERT_EQ(cached.at(block), bytes);
        cached.erase(block);
        leased[block] = bytes;
      }
    }
    ASSERT_EQ(cache.cached_count(), cached.size());
  }
  for (const auto& [block, bytes] : cached) {
    EXPECT_EQ(cache.put(block, bytes, detail::kUntagged, 1_GiB), Put::double_deallocate)
        << "a cached block stays recorded as cached";
  }
}

// ---- the pool ----------------------------------------------------------------------------

TEST(DevicePoolLargeThreadCache, AThreadAloneOnTheLargeTierCachesNothing) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = cached_options();
  options.thread_cache.large_from_start = false;
  DevicePool pool(upstream, options);
  for (int i = 0; i < 100; ++i) {
    void* block = pool.allocate(4_MiB);
    pool.deallocate(block, 4_MiB);
    ASSERT_EQ(pool.stats().bytes_cached_in_threads, 0U);
  }
}

TEST(DevicePoolLargeThreadCache, AFreedBlockServesTheSameSizeAgainFromTheThread) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, cached_options());
  void* a = pool.allocate(4_MiB);
  pool.deallocate(a, 4_MiB);
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 4_MiB);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  void* b = pool.allocate(4_MiB - 100);  // the same size once rounded to 512 B
  EXPECT_EQ(b, a);
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 0U);
  void* c = pool.allocate(4_MiB);
  EXPECT_NE(c, a);
  pool.deallocate(b, 4_MiB);
  pool.deallocate(c, 4_MiB);
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
}

TEST(DevicePoolLargeThreadCache, WrongSizeAndDoubleReleasesAreStillRejected) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, cached_options());
  void* p = pool.allocate(4_MiB);
  pool.deallocate(p, 8_MiB);
  EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
  EXPECT_EQ(pool.stats().bytes_in_use, 4_MiB);
  pool.deallocate(p, 4_MiB);
  EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
  pool.deallocate(p, 4_MiB);  // double release of a cached block
  EXPECT_EQ(pool.stats().invalid_deallocations, 2U);
  void* a = pool.allocate(4_MiB);
  void* b = pool.allocate(4_MiB);
  EXPECT_NE(a, b) << "the block was cached once, not twice";
  pool.deallocate(a, 4_MiB);
  pool.deallocate(b, 4_MiB);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(DevicePoolLargeThreadCache, TheByteCapBoundsEachThread) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = cached_options();
  options.thread_cache.large_bytes = 8_MiB;
  DevicePool pool(upstream, options);
  void* blocks[3];
  for (void*& b : blocks) b = pool.allocate(4_MiB);
  void* huge = pool.allocate(16_MiB);
  for (void* b : blocks) pool.deallocate(b, 4_MiB);
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 8_MiB) << "two of the three, the newest";
  pool.deallocate(huge, 16_MiB);
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 8_MiB) << "a block above the cap is not kept";
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// Segments of 20 MiB: a cached 4 MiB block would leave 16 MiB free in its segment, too
// little for 18 MiB; flushed before the tier grows, it merges back and the request fits.
TEST(DevicePoolLargeThreadCache, TheThreadsOwnCacheIsFlushedBeforeTheTierGrows) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, cached_options());
  void* a = pool.allocate(4_MiB);
  pool.deallocate(a, 4_MiB);
  ASSERT_EQ(pool.stats().bytes_cached_in_threads, 4_MiB);
  const std::uint64_t allocations = upstream->allocations();
  void* b = pool.allocate(18_MiB);
  EXPECT_EQ(upstream->allocations(), allocations) << "no growth: the cached block went back";
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 0U);
  pool.deallocate(b, 18_MiB);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(DevicePoolLargeThreadCache, OtherThreadsCachesAreFlushedBeforeTheTierGrows) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, cached_options());
  std::mutex m;
  std::condition_variable cv;
  bool cached = false;
  bool done = false;
  std::thread other([&] {
    void* a = pool.allocate(4_MiB);
    pool.deallocate(a, 4_MiB);  // stays in this thread's cache while it waits
    std::unique_lock lock(m);
    cached = true;
    cv.notify_all();
    cv.wait(lock, [&] { return done; });
  });
  {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return cached; });
  }
  ASSERT_EQ(pool.stats().bytes_cached_in_threads, 4_MiB);
  const std::uint64_t allocations = upstream->allocations();
  void* b = pool.allocate(18_MiB);
  EXPECT_EQ(upstream->allocations(), allocations) << "the idle thread's block went back first";
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 0U);
  {
    std::lock_guard lock(m);
    done = true;
  }
  cv.notify_all();
  other.join();
  pool.deallocate(b, 18_MiB);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// Capacity 24 MiB: one 20 MiB segment holds a cached 4 MiB block. 24 MiB fits only once
// that segment went back (flush, then the out-of-memory trim); 32 MiB never fits and is
// reported out of memory with nothing left cached.
TEST(DevicePoolLargeThreadCache, OutOfMemoryComesOnlyAfterTheCachesWentBack) {
  TestUpstream::Options limits;
  limits.capacity_bytes = 24_MiB;
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(), limits);
  DevicePool pool(upstream, cached_options());
  void* a = pool.allocate(4_MiB);
  pool.deallocate(a, 4_MiB);
  ASSERT_EQ(pool.stats().bytes_cached_in_threads, 4_MiB);
  void* b = pool.allocate(24_MiB);
  EXPECT_NE(b, nullptr);
  pool.deallocate(b, 24_MiB);
  void* c = pool.allocate(4_MiB);
  pool.deallocate(c, 4_MiB);
  EXPECT_THROW((void)pool.allocate(32_MiB), OutOfMemory);
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 0U);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(DevicePoolLargeThreadCache, AStreamFreedBlockIsNotHandedToAnotherStream) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<ManualFence>();
  auto options = cached_options();
  options.fence = fence;
  DevicePool pool(upstream, options);
  const auto s1 = reinterpret_cast<cudaStream_t>(0x10);
  const auto s2 = reinterpret_cast<cudaStream_t>(0x20);
  free_often_on(pool, s1);  // steady: its frees are cached (a young stream's go to the tier)
  fence->complete_all();
  const std::size_t cached = pool.stats().bytes_cached_in_threads;
  void* a = pool.allocate_async(4_MiB, s1);
  pool.deallocate_async(a, 4_MiB, s1);
  ASSERT_EQ(pool.stats().bytes_cached_in_threads, cached + 4_MiB);
  void* b = pool.allocate_async(4_MiB, s2);
  EXPECT_NE(b, a) << "s1's block went to s2 from the cache";
  void* c = pool.allocate(4_MiB);
  EXPECT_NE(c, a) << "s1's block went to a plain request from the cache";
  void* d = pool.allocate_async(4_MiB, s1);
  EXPECT_EQ(d, a) << "s1 gets its own block back at once";
  pool.deallocate_async(b, 4_MiB, s2);
  pool.deallocate(c, 4_MiB);
  pool.deallocate_async(d, 4_MiB, s1);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(DevicePoolLargeThreadCache, ABlockReleasedOnAnotherThreadGoesBackToTheTier) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, cached_options());
  void* a = pool.allocate(4_MiB);
  std::thread([&] { pool.deallocate(a, 4_MiB); }).join();
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
  // This thread's record of `a` is stale: a new block at that address is still released
  // correctly, here or there.
  void* b = pool.allocate(4_MiB);
  pool.deallocate(b, 4_MiB);
  void* c = pool.allocate(4_MiB);
  std::thread([&] { pool.deallocate(c, 4_MiB); }).join();
  EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

// A second release of a block, after a first on another thread, is rejected wherever it
// is made: the first thread's record of the block as leased is revoked, and a block its
// owner holds cached is no other thread's to release.
TEST(DevicePoolLargeThreadCache, ASecondReleaseAfterAnotherThreadsIsRejectedAndSharesNoBlock) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, cached_options());
  void* a = pool.allocate(4_MiB);
  std::thread([&] { pool.deallocate(a, 4_MiB); }).join();
  pool.deallocate(a, 4_MiB);  // here, where the block was allocated
  EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
  std::thread([&] { pool.deallocate(a, 4_MiB); }).join();  // there, again
  EXPECT_EQ(pool.stats().invalid_deallocations, 2U);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  void* b = pool.allocate(4_MiB);
  void* c = pool.allocate(4_MiB);
  EXPECT_NE(b, c) << "one block handed to two owners";
  pool.deallocate(b, 4_MiB);
  pool.deallocate(c, 4_MiB);
  EXPECT_EQ(pool.stats().invalid_deallocations, 2U);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(DevicePoolLargeThreadCache, AnotherThreadsReleaseOfABlockCachedByItsOwnerIsRejected) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, cached_options());
  void* a = pool.allocate(4_MiB);
  pool.deallocate(a, 4_MiB);  // cached here
  ASSERT_EQ(pool.stats().bytes_cached_in_threads, 4_MiB);
  std::thread([&] { pool.deallocate(a, 4_MiB); }).join();
  EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  void* b = pool.allocate(4_MiB);  // the cached block
  void* c = nullptr;
  std::thread([&] { c = pool.allocate(4_MiB); }).join();  // from the tier
  EXPECT_EQ(b, a);
  EXPECT_NE(b, c) << "one block handed to two owners";
  // A block taken out of the cache is live again: another thread may release it.
  std::thread([&] { pool.deallocate(b, 4_MiB); }).join();
  pool.deallocate(c, 4_MiB);
  EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

// A thread that adopts an exited thread's cache does not inherit its records.
TEST(DevicePoolLargeThreadCache, ADoubleReleaseThroughAnAdoptedCacheIsRejected) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, cached_options());
  void* a = nullptr;
  std::thread([&] { a = pool.allocate(4_MiB); }).join();  // recorded in that thread's cache
  pool.deallocate(a, 4_MiB);
  std::thread([&] { pool.deallocate(a, 4_MiB); }).join();  // this thread adopts the cache
  EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
  void* b = pool.allocate(4_MiB);
  void* c = pool.allocate(4_MiB);
  EXPECT_NE(b, c);
  pool.deallocate(b, 4_MiB);
  pool.deallocate(c, 4_MiB);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

// With every option at its default but validation (off, as in release builds): the cache
// turns on once threads meet on the tier; double releases on other threads stay rejected.
TEST(DevicePoolLargeThreadCache, DoubleReleasesAcrossThreadsAreRejectedOnceThreadsHaveMet) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Options options;
  options.validate_deallocations = false;
  DevicePool pool(upstream, options);
  constexpr int kThreads = 4;
  constexpr int kRounds = 200;
  std::vector<std::vector<void*>> given(kThreads);
  std::mutex given_mutex;
  std::atomic<std::uint64_t> expected_invalid{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t) + 1);
      for (int i = 0; i < kRounds; ++i) {
        // Sizes of this thread's own (rounded to 512 bytes, no other thread's): a block another
        // thread got at the same address between the two releases has another size, so the
        // second release is told apart from a release of that thread's block.
        const std::size_t bytes =
            ((std::size_t{2} + rng() % 6) << 20) + 512 * static_cast<std::size_t>(t);
        void* p = pool.allocate(bytes);
        static_cast<char*>(p)[0] = static_cast<char>(t);
        if (rng() % 2 == 0) {
          pool.deallocate(p, bytes);  // here
        } else {
          std::thread([&] { pool.deallocate(p, bytes); }).join();  // on another thread
        }
        if (rng() % 4 == 0) {  // the same block again, here or on another thread
          if (rng() % 2 == 0) {
            pool.deallocate(p, bytes);
          } else {
            std::thread([&] { pool.deallocate(p, bytes); }).join();
          }
          expected_invalid.fetch_add(1, std::memory_order_relaxed);
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(pool.stats().invalid_deallocations, expected_invalid.load());
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  // No block is held twice: live blocks at once are all distinct.
  std::vector<void*> live;
  for (int i = 0; i < 64; ++i) live.push_back(pool.allocate(4_MiB));
  std::sort(live.begin(), live.end());
  EXPECT_EQ(std::adjacent_find(live.begin(), live.end()), live.end());
  for (void* p : live) pool.deallocate(p, 4_MiB);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

// A block released elsewhere revokes only its own record (the owner's other records keep
// caching); a mailbox that overflowed forgets every leased record.
TEST(DevicePoolLargeThreadCacheRecord, ARevocationDropsOnlyThatBlocksRecord) {
  LargeBlockCache cache;
  cache.note_leased(fake(1), 4_MiB);
  cache.note_leased(fake(2), 4_MiB);
  cache.revoke(fake(2));
  EXPECT_EQ(cache.put(fake(1), 4_MiB, detail::kUntagged, 1_GiB), Put::cached);
  EXPECT_EQ(cache.put(fake(2), 4_MiB, detail::kUntagged, 1_GiB), Put::to_tier);

  LargeBlockCache full;
  full.note_leased(fake(1), 4_MiB);
  for (std::uintptr_t i = 0; i <= LargeBlockCache::kMailbox; ++i) full.revoke(fake(100 + i));
  EXPECT_EQ(full.put(fake(1), 4_MiB, detail::kUntagged, 1_GiB), Put::to_tier);
  full.note_leased(fake(3), 4_MiB);  // the mailbox was read: records made since are kept
  EXPECT_EQ(full.put(fake(3), 4_MiB, detail::kUntagged, 1_GiB), Put::cached);
}

TEST(DevicePoolLargeThreadCache, AReleaseOnAnotherThreadKeepsTheOwnersOtherBlocksCaching) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, cached_options());
  for (int step = 0; step < 10; ++step) {
    void* scratch = pool.allocate(4_MiB);  // released here
    void* output = pool.allocate(8_MiB);   // released by a consumer thread
    std::thread([&] { pool.deallocate(output, 8_MiB); }).join();
    pool.deallocate(scratch, 4_MiB);
    EXPECT_EQ(pool.stats().bytes_cached_in_threads, 4_MiB) << "step " << step;
  }
  EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// LeaseOwner::holds() on another thread finds a block that stays cached while the owner
// moves its other cached blocks (take() and free_oldest() move slots down). `generation` is
// odd while the block is cached; a check that saw one odd value throughout must find it.
TEST(DevicePoolLargeThreadCacheRecord, AStayingCachedBlockIsAlwaysSeenWhileOthersMove) {
  LargeBlockCache cache;
  void* const staying = fake(1000);
  std::vector<void*> order;  // the cache's slots, bottom first, as take and free_oldest move them
  auto put = [&](void* block, std::size_t bytes) {
    cache.note_leased(block, bytes);
    ASSERT_EQ(cache.put(block, bytes, detail::kUntagged, 1_GiB), Put::cached);
    order.push_back(block);
  };
  std::atomic<std::uint64_t> generation{0};
  for (std::uintptr_t i = 1; i <= 4; ++i) put(fake(i), 4_MiB);
  put(staying, 8_MiB);
  generation.store(1, std::memory_order_release);
  for (std::uintptr_t i = 5; i <= 8; ++i) put(fake(i), 4_MiB);
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> checks{0};
  std::atomic<std::uint64_t> misses{0};
  std::thread reader([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      const std::uint64_t before = generation.load(std::memory_order_acquire);
      const bool seen = cache.holds(staying);
      const std::uint64_t after = generation.load(std::memory_order_acquire);
      if (before == after && before % 2 == 1) {
        checks.fetch_add(1, std::memory_order_relaxed);
        if (!seen) misses.fetch_add(1, std::memory_order_relaxed);
      }
    }
  });
  // Until the reader has checked enough (bounded: a reader never scheduled fails below).
  for (int round = 0; round < 20000 || (checks.load() < 2000 && round < 20000000); ++round) {
    LargeBlockCache::Cached oldest;
    const bool leaving = order.front() == staying;
    if (leaving) generation.fetch_add(1, std::memory_order_acq_rel);  // even: out
    ASSERT_TRUE(cache.free_oldest([&](const LargeBlockCache::Cached& c) { oldest = c; }));
    ASSERT_EQ(oldest.block, order.front());
    order.erase(order.begin());
    put(oldest.block, oldest.bytes);
    if (leaving) generation.fetch_add(1, std::memory_order_acq_rel);  // odd: cached again
    void* block = cache.take(4_MiB, detail::kUntagged);               // the newest 4 MiB block
    ASSERT_NE(block, nullptr);
    auto at = std::find(order.rbegin(), order.rend(), block);
    ASSERT_NE(at, order.rend());
    *at = order.back();  // the last moves into its slot
    order.pop_back();
    put(block, 4_MiB);
  }
  stop.store(true);
  reader.join();
  EXPECT_GT(checks.load(), 0U);
  EXPECT_EQ(misses.load(), 0U);
}

// Device memory: the large tier over CUDA virtual memory (the default on a GPU) and over
// cudaMalloc segments, validation off as in release builds.
TEST(DevicePoolLargeThreadCacheGpu, DoubleReleasesAcrossThreadsAreRejectedAndShareNoBlock) {
  VRAM_GPU_TEST_OR_SKIP();
  for (const auto memory : {LargeTierMemory::automatic, LargeTierMemory::segments}) {
    SCOPED_TRACE(memory == LargeTierMemory::segments ? "segments" : "automatic");
    DevicePool::Options options = cached_options();
    options.large_tier.memory = memory;
    DevicePool pool(0, options);
    void* a = pool.allocate(4_MiB);
    std::thread([&] { pool.deallocate(a, 4_MiB); }).join();
    pool.deallocate(a, 4_MiB);  // here, after there
    void* b = pool.allocate(4_MiB);
    pool.deallocate(b, 4_MiB);                               // cached here
    std::thread([&] { pool.deallocate(b, 4_MiB); }).join();  // there, after here
    EXPECT_EQ(pool.stats().invalid_deallocations, 2U);
    EXPECT_EQ(pool.stats().bytes_in_use, 0U);
    void* c = pool.allocate(4_MiB);
    void* d = nullptr;
    std::thread([&] { d = pool.allocate(4_MiB); }).join();
    void* e = pool.allocate(4_MiB);
    EXPECT_NE(c, d);
    EXPECT_NE(c, e);
    EXPECT_NE(d, e);
    for (void* p : {c, d, e}) pool.deallocate(p, 4_MiB);
    EXPECT_EQ(pool.stats().bytes_in_use, 0U);
    pool.trim(0);
  }
}

// Threads that meet on the large tier start caching (the default); all memory comes back.
TEST(DevicePoolLargeThreadCache, ThreadsThatMeetOnTheLargeTierStartCachingTheirSuccessorsDoNot) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = cached_options();
  options.thread_cache.large_from_start = false;
  DevicePool pool(upstream, options);
  std::atomic<bool> stop{false};
  std::atomic<bool> seen{false};
  auto worker = [&](std::size_t bytes) {
    while (!stop.load()) {
      void* block = pool.allocate(bytes);
      pool.deallocate(block, bytes);
      if (pool.stats().bytes_cached_in_threads > 0) seen.store(true);
    }
  };
  std::thread a(worker, 4_MiB);
  std::thread b(worker, 6_MiB);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!seen.load() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  stop.store(true);
  a.join();
  b.join();
  EXPECT_TRUE(seen.load()) << "two threads on the large tier never met";
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  // A thread started after them takes over an exited thread's cache, not its meetings:
  // alone on the tier, it caches nothing.
  std::thread([&] {
    for (int i = 0; i < 100; ++i) {
      void* block = pool.allocate(4_MiB);
      pool.deallocate(block, 4_MiB);
      ASSERT_EQ(pool.stats().bytes_cached_in_threads, 0U) << "at pair " << i;
    }
  }).join();
}

// Many threads: mixed sizes, blocks handed between threads, trims and growth on the way
// (the flushes steal from busy threads). Nothing lost, nothing rejected, all given back.
TEST(DevicePoolLargeThreadCache, ThreadsHandingBlocksAroundWithTrimsLoseNothing) {
  for (const LargeTierMemory memory :
       {LargeTierMemory::segments, LargeTierMemory::virtual_memory}) {
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto options = cached_options();
    options.large_tier.memory = memory;
    options.thread_cache.large_bytes = 48_MiB;
    DevicePool pool(upstream, options);
    constexpr int kThreads = 4;
    std::mutex handoff_mutex;
    std::vector<std::pair<void*, std::size_t>> handoff;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 random(100 + t);
        std::vector<std::pair<void*, std::size_t>> live;
        for (int i = 0; i < 3000; ++i) {
          const int what = static_cast<int>(random() % 8);
          if (what < 4 || live.empty()) {
            const std::size_t bytes = (1 + random() % 12) * 1_MiB + (random() % 4) * 512;
            live.emplace_back(pool.allocate(bytes), bytes);
          } else if (what < 6) {
            pool.deallocate(live.back().first, live.back().second);
            live.pop_back();
          } else if (what == 6) {
            std::lock_guard lock(handoff_mutex);
            handoff.push_back(live.back());
            live.pop_back();
          } else {
            std::pair<void*, std::size_t> got{nullptr, 0};
            {
              std::lock_guard lock(handoff_mutex);
              if (!handoff.empty()) {
                got = handoff.back();
                handoff.pop_back();
              }
            }
            if (got.first != nullptr) pool.deallocate(got.first, got.second);
            if (t == 0 && i % 100 == 0) pool.trim(0);
          }
          if (live.size() > 16) {
            pool.deallocate(live.front().first, live.front().second);
            live.erase(live.begin());
          }
        }
        for (auto [block, bytes] : live) pool.deallocate(block, bytes);
      });
    }
    for (auto& thread : threads) thread.join();
    for (auto [block, bytes] : handoff) pool.deallocate(block, bytes);
    const DevicePoolStats stats = pool.stats();
    EXPECT_EQ(stats.invalid_deallocations, 0U);
    EXPECT_EQ(stats.bytes_in_use, 0U);
    pool.trim(0);
    EXPECT_EQ(pool.stats().bytes_cached_in_threads, 0U);
    EXPECT_EQ(upstream->live_bytes(), 0U);
    EXPECT_EQ(upstream->bad_frees(), 0U);
  }
}

}  // namespace
}  // namespace vram::testing
