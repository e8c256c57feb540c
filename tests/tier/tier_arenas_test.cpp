// TierArenas (a segment tier in arenas): one thread uses one arena; threads that start
// together get their own; a block goes back to the arena that holds it, whoever frees it;
// a request borrows a sibling's free range before its arena grows; trim, counters and
// describe cover every arena; DevicePool recovers from out of memory across arenas.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "test_upstreams.hpp"
#include "tier/tier_arenas.hpp"
#include "vram/device_pool.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;
using detail::kUntagged;
using detail::SegmentTier;
using detail::TierArenas;

SegmentTier::Options two_mib_segments() {
  return {.granularity = 512, .packed_segment = 2_MiB, .packed_limit = 2_MiB};
}

struct ArenasFixture {
  explicit ArenasFixture(std::size_t count, SegmentTier::Options options = two_mib_segments(),
                         std::size_t capacity = SIZE_MAX)
      : upstream(std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(),
                                                TestUpstream::Options{.capacity_bytes = capacity})),
        arenas(*upstream, fence, gauge, options, count) {}
  // What DevicePoolCore does: the arenas without growing, then the home arena grows.
  void* allocate(std::size_t bytes) {
    if (void* block = arenas.allocate(bytes, kUntagged)) return block;
    return arenas.home().allocate(bytes, kUntagged, /*may_grow=*/true);
  }
  std::size_t arena_of(void* block) const {
    for (std::size_t i = 0; i < arenas.count(); ++i) {
      if (SegmentTier* tier = arenas.arena(i); tier != nullptr && tier->owns(block)) return i;
    }
    return SIZE_MAX;
  }
  std::shared_ptr<TestUpstream> upstream;
  ManualFence fence;
  detail::ReservedGauge gauge;
  TierArenas arenas;
};

// Runs `body(i)` on `count` threads, one after the other for their first call (so that
// their slots follow each other), then all at once.
template <class Body>
void run_threads(std::size_t count, Body body) {
  std::atomic<std::size_t> turn{0};
  std::atomic<std::size_t> started{0};
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < count; ++i) {
    threads.emplace_back([&, i] {
      while (turn.load() != i) std::this_thread::yield();
      (void)TierArenas::thread_slot();
      turn.fetch_add(1);
      started.fetch_add(1);
      while (started.load() != count) std::this_thread::yield();
      body(i);
    });
  }
  for (auto& thread : threads) thread.join();
}

TEST(TierArenas, OneThreadUsesOneArena) {
  ArenasFixture f(8);
  std::mt19937 rng(7);
  std::vector<void*> live;
  for (int round = 0; round < 200; ++round) {
    const std::size_t bytes =
        f.arenas.round(std::uniform_int_distribution<std::size_t>(1, 1_MiB)(rng));
    live.push_back(f.allocate(bytes));
    if (live.size() > 8) {
      const std::size_t victim = rng() % live.size();
      ASSERT_TRUE(f.arenas.free(live[victim], kUntagged));
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(victim));
    }
  }
  for (void* block : live) ASSERT_TRUE(f.arenas.free(block, kUntagged));
  EXPECT_EQ(f.arenas.made(), 1U) << "calls from one thread make one arena";
  EXPECT_EQ(f.arenas.counters().reserved, f.arenas.arena(0)->counters().reserved);
}

TEST(TierArenas, CountIsBounded) {
  EXPECT_EQ(TierArenas::count_for(1), 1U);
  EXPECT_EQ(TierArenas::count_for(64), TierArenas::kMaxArenas);
  EXPECT_EQ(TierArenas::count_for(12), 8U) << "a power of two";
  EXPECT_GE(TierArenas::count_for(0), 1U);
  ArenasFixture f(100);
  EXPECT_EQ(f.arenas.count(), TierArenas::kMaxArenas);
}

TEST(TierArenasThreads, ThreadsThatStartTogetherGetTheirOwnArenas) {
  ArenasFixture f(4);
  std::vector<void*> blocks(4);
  // Whole segments: no arena has a free range another could borrow.
  run_threads(4, [&](std::size_t i) { blocks[i] = f.allocate(2_MiB); });
  std::set<std::size_t> arenas;
  for (void* block : blocks) arenas.insert(f.arena_of(block));
  EXPECT_EQ(arenas.size(), 4U) << "each thread grew its own arena";
  EXPECT_EQ(f.arenas.made(), 4U);
  for (void* block : blocks) ASSERT_TRUE(f.arenas.free(block, kUntagged));
}

TEST(TierArenasThreads, AFreeGoesBackToTheArenaThatHoldsTheBlock) {
  ArenasFixture f(2);
  void* from_first = nullptr;
  std::size_t first_arena = SIZE_MAX;
  run_threads(2, [&](std::size_t i) {
    if (i == 0) from_first = f.allocate(1_MiB);
  });
  first_arena = f.arena_of(from_first);
  ASSERT_NE(first_arena, SIZE_MAX);
  const std::size_t used_before = f.arenas.arena(first_arena)->counters().free_bytes;
  // Freed by another thread (this one, whose home may be any arena).
  std::thread([&] { ASSERT_TRUE(f.arenas.free(from_first, kUntagged)); }).join();
  EXPECT_EQ(f.arenas.arena(first_arena)->counters().free_bytes, used_before + 1_MiB);
  EXPECT_EQ(f.arena_of(from_first), SIZE_MAX) << "no longer live anywhere";
  EXPECT_FALSE(f.arenas.free(from_first, kUntagged)) << "a second release is refused";
}

TEST(TierArenasThreads, ARequestBorrowsASiblingsFreeRangeBeforeGrowing) {
  ArenasFixture f(2);
  std::atomic<bool> first_done{false};
  run_threads(2, [&](std::size_t i) {
    if (i == 0) {
      void* block = f.allocate(1_MiB);  // its arena: a 2 MiB segment, then 2 MiB free
      ASSERT_TRUE(f.arenas.free(block, kUntagged));
      first_done.store(true);
      return;
    }
    while (!first_done.load()) std::this_thread::yield();
    // At home in the other arena: nothing fits there, the sibling's range does.
    void* block = f.allocate(512_KiB);
    EXPECT_NE(block, nullptr);
    EXPECT_EQ(f.upstream->allocations(), 1U) << "borrowed, not grown";
    EXPECT_EQ(f.arenas.made(), 2U);
    ASSERT_TRUE(f.arenas.free(block, kUntagged));
  });
}

TEST(TierArenasThreads, TrimCountersAndDescribeCoverEveryArena) {
  ArenasFixture f(4);
  std::vector<void*> blocks(4);
  run_threads(4, [&](std::size_t i) { blocks[i] = f.allocate(2_MiB); });
  EXPECT_EQ(f.arenas.made(), 4U);
  const auto counters = f.arenas.counters();
  EXPECT_EQ(counters.reserved, 4 * 2_MiB);
  EXPECT_EQ(counters.segments, 4U);
  EXPECT_EQ(f.gauge.reserved.load(), counters.reserved);
  std::vector<DevicePoolSegment> segments;
  f.arenas.describe(true, segments);
  EXPECT_EQ(segments.size(), 4U);
  std::size_t handed_out = 0;
  for (const auto& segment : segments) {
    for (const auto& range : segment.ranges) handed_out += range.used ? range.bytes : 0;
  }
  EXPECT_EQ(handed_out, 4 * 2_MiB);
  for (void* block : blocks) ASSERT_TRUE(f.arenas.free(block, kUntagged));
  f.arenas.trim(2_MiB, false);
  EXPECT_EQ(f.arenas.counters().reserved, 2_MiB) << "keep counts over all arenas together";
  f.arenas.trim(0, false);
  EXPECT_EQ(f.arenas.counters().reserved, 0U);
  EXPECT_EQ(f.upstream->live_bytes(), 0U);
}

TEST(TierArenasThreads, ConcurrentFreshSizesBalanceTheBooks) {
  ArenasFixture f(4);
  run_threads(4, [&](std::size_t i) {
    std::mt19937 rng(static_cast<unsigned>(i + 1));
    std::vector<void*> live;
    for (int round = 0; round < 300; ++round) {
      for (int k = 0; k < 8; ++k) {
        const std::size_t bytes =
            f.arenas.round(std::uniform_int_distribution<std::size_t>(256, 3_MiB)(rng));
        live.push_back(f.allocate(bytes));
      }
      std::shuffle(live.begin(), live.end(), rng);
      for (void* block : live) ASSERT_TRUE(f.arenas.free(block, kUntagged));
      live.clear();
    }
  });
  const auto counters = f.arenas.counters();
  EXPECT_EQ(counters.free_bytes, counters.reserved) << "every block back";
  EXPECT_EQ(f.gauge.reserved.load(), counters.reserved);
  f.arenas.trim(0, false);
  EXPECT_EQ(f.upstream->live_bytes(), 0U);
}

// DevicePool over arenas, two threads at home in different arenas: the first leaves its
// arena holding free segments, the second needs a block none of them fits.
struct TwoArenaPool {
  explicit TwoArenaPool(double headroom)
      : upstream(std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(),
                                                TestUpstream::Options{.capacity_bytes = 40_MiB})) {
    DevicePool::Options options;
    options.arenas = 2;
    options.validate_releases = false;
    options.thread_cache.large_bytes = 0;
    options.large_tier.memory = LargeTierMemory::segments;
    options.growth_headroom = headroom;
    pool.emplace(upstream, options);
  }
  // `second` runs on the thread at home in the other arena, once the first is done.
  template <class Second>
  void run(Second second) {
    std::atomic<bool> first_done{false};
    run_threads(2, [&](std::size_t i) {
      if (i == 0) {
        void* a = pool->allocate(16_MiB);
        void* b = pool->allocate(16_MiB);
        pool->deallocate(a, 16_MiB);
        pool->deallocate(b, 16_MiB);
        first_done.store(true);
        return;
      }
      while (!first_done.load()) std::this_thread::yield();
      second();
    });
  }
  std::shared_ptr<TestUpstream> upstream;
  std::optional<DevicePool> pool;
};

TEST(TierArenasThreads, PoolRecoversFromOutOfMemoryAcrossArenas) {
  TwoArenaPool f(4.0);  // the budget lets it grow: the upstream refuses instead
  f.run([&] {
    // 24 MiB fits none of the first arena's free ranges and 56 MiB passes the capacity:
    // the retry gives every arena's free memory back and grows.
    void* c = f.pool->allocate(24_MiB);
    ASSERT_NE(c, nullptr);
    const DevicePoolStats stats = f.pool->stats();
    EXPECT_EQ(stats.oom_retries, 1U);
    EXPECT_EQ(stats.bytes_in_use, 24_MiB);
    EXPECT_EQ(stats.bytes_reserved, 24_MiB);
    std::size_t mapped = 0;
    for (const auto& segment : f.pool->memory_map()) mapped += segment.bytes;
    EXPECT_EQ(mapped, stats.bytes_reserved) << "the memory map covers every arena";
    f.pool->deallocate(c, 24_MiB);
  });
  f.pool->trim();
  EXPECT_EQ(f.upstream->live_bytes(), 0U);
}

}  // namespace
}  // namespace vram::testing
