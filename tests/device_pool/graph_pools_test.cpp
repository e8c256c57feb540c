// Graph-private pools (src/device_pool/graph_pools.hpp): use counts, reuse only inside a pool,
// memory back to the shared tiers only once a pool has no use and nothing live. Host only; the
// threaded cases run under TSan in CI.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <set>
#include <thread>
#include <vector>

#include "device_pool/graph_pools.hpp"

namespace vram::testing {
namespace {

using detail::GraphPools;

void* fake(std::uintptr_t n) { return reinterpret_cast<void*>(n << 12); }

TEST(GraphPools, FreedBlockIsReusedOnlyByItsOwnPool) {
  GraphPools pools;
  pools.retain(1);
  pools.retain(2);
  ASSERT_TRUE(pools.adopt(1, {fake(1), 4096}));
  EXPECT_TRUE(pools.may_own(fake(1)));
  EXPECT_EQ(pools.deallocate(fake(1)), GraphPools::Deallocation::returned);
  EXPECT_TRUE(pools.take_pending().empty());        // pool 1 still has a use open
  EXPECT_EQ(pools.take(2, 4096).pointer, nullptr);  // never to another pool
  const auto again = pools.take(1, 4096);
  EXPECT_EQ(again.pointer, fake(1));
  EXPECT_EQ(again.bytes, 4096U);
  EXPECT_EQ(pools.live_bytes_of(fake(1)), 4096U);
}

TEST(GraphPools, BestFitAtMostAQuarterLarger) {
  GraphPools pools;
  pools.retain(7);
  ASSERT_TRUE(pools.adopt(7, {fake(1), 8192}));
  ASSERT_TRUE(pools.adopt(7, {fake(2), 5000}));
  ASSERT_EQ(pools.deallocate(fake(1)), GraphPools::Deallocation::returned);
  ASSERT_EQ(pools.deallocate(fake(2)), GraphPools::Deallocation::returned);
  EXPECT_EQ(pools.take(7, 3000).pointer, nullptr);  // 5000 > 3000 * 5/4
  EXPECT_EQ(pools.take(7, 4500).pointer, fake(2));
  EXPECT_EQ(pools.take(7, 8000).pointer, fake(1));
  EXPECT_EQ(pools.take(7, 1).pointer, nullptr);  // nothing free left
}

TEST(GraphPools, AClaimTakesBackExactlyThatFreeBlockOfThatPool) {
  GraphPools pools;
  pools.retain(1);
  pools.retain(2);
  ASSERT_TRUE(pools.adopt(1, {fake(1), 4096}));
  ASSERT_TRUE(pools.adopt(1, {fake(2), 4096}));
  ASSERT_TRUE(pools.adopt(2, {fake(3), 4096}));
  EXPECT_EQ(pools.claim(1, fake(1)), 0U);  // live: nothing to claim
  ASSERT_EQ(pools.deallocate(fake(1)), GraphPools::Deallocation::returned);
  ASSERT_EQ(pools.deallocate(fake(2)), GraphPools::Deallocation::returned);
  ASSERT_EQ(pools.deallocate(fake(3)), GraphPools::Deallocation::returned);
  EXPECT_EQ(pools.claim(2, fake(2)), 0U);     // another pool's block
  EXPECT_EQ(pools.claim(1, fake(9)), 0U);     // no block at all
  EXPECT_EQ(pools.claim(1, fake(2)), 4096U);  // the second block, not the first of its size
  EXPECT_EQ(pools.live_bytes_of(fake(2)), 4096U);
  EXPECT_EQ(pools.claim(1, fake(2)), 0U);  // live again: a second claim finds nothing
  EXPECT_EQ(pools.take(1, 4096).pointer, fake(1));
  EXPECT_EQ(pools.take(1, 4096).pointer, nullptr);
  EXPECT_EQ(pools.deallocate(fake(2)), GraphPools::Deallocation::returned);
}

TEST(GraphPools, FreeBlocksAreThePoolsFreeBlocksByAddress) {
  GraphPools pools;
  pools.retain(1);
  pools.retain(2);
  ASSERT_TRUE(pools.adopt(1, {fake(3), 8192}));
  ASSERT_TRUE(pools.adopt(1, {fake(1), 4096}));
  ASSERT_TRUE(pools.adopt(1, {fake(2), 4096}));
  ASSERT_TRUE(pools.adopt(2, {fake(4), 4096}));
  EXPECT_TRUE(pools.free_blocks(1).empty()) << "live blocks are not free";
  ASSERT_EQ(pools.deallocate(fake(3)), GraphPools::Deallocation::returned);
  ASSERT_EQ(pools.deallocate(fake(1)), GraphPools::Deallocation::returned);
  ASSERT_EQ(pools.deallocate(fake(4)), GraphPools::Deallocation::returned);
  const std::vector<GraphPools::Block> free = pools.free_blocks(1);
  ASSERT_EQ(free.size(), 2U) << "pool 2's block and pool 1's live block are not listed";
  EXPECT_EQ(free[0].pointer, fake(1));
  EXPECT_EQ(free[0].bytes, 4096U);
  EXPECT_EQ(free[1].pointer, fake(3));
  EXPECT_EQ(free[1].bytes, 8192U);
  ASSERT_EQ(pools.take(1, 8192).pointer, fake(3));
  ASSERT_EQ(pools.free_blocks(1).size(), 1U) << "a block taken again is live";
  EXPECT_TRUE(pools.free_blocks(9).empty()) << "no such pool";
  ASSERT_TRUE(pools.release(2));
  EXPECT_TRUE(pools.free_blocks(2).empty()) << "a retired pool's blocks are pending, not free";
}

TEST(GraphPools, MemoryIsPendingOnlyWhenNoUseAndNothingLive) {
  GraphPools pools;
  pools.retain(3);  // graph A captures into pool 3
  pools.retain(3);  // graph B shares it (pool=)
  ASSERT_TRUE(pools.adopt(3, {fake(1), 1 << 20}));
  ASSERT_TRUE(pools.adopt(3, {fake(2), 1 << 20}));
  ASSERT_EQ(pools.deallocate(fake(1)), GraphPools::Deallocation::returned);
  EXPECT_TRUE(pools.release(3));  // graph A gone: B still uses the pool
  EXPECT_TRUE(pools.take_pending().empty());
  EXPECT_EQ(pools.stats().held_bytes, 2U << 20);
  EXPECT_TRUE(pools.release(3));  // graph B gone, but fake(2) is still live
  EXPECT_TRUE(pools.take_pending().empty());
  EXPECT_FALSE(pools.empty());
  EXPECT_EQ(pools.stats().live_bytes, 1U << 20);
  ASSERT_EQ(pools.deallocate(fake(2)), GraphPools::Deallocation::returned);
  EXPECT_TRUE(pools.empty());
  EXPECT_EQ(pools.stats().held_bytes, 2U << 20) << "pending bytes still count";
  const auto pending = pools.take_pending();
  ASSERT_EQ(pending.size(), 2U);  // the last live block: all of the pool's memory goes
  std::set<void*> back{pending[0].pointer, pending[1].pointer};
  EXPECT_EQ(back, (std::set<void*>{fake(1), fake(2)}));
  EXPECT_EQ(pools.stats().held_bytes, 0U);
  EXPECT_FALSE(pools.may_own(fake(1)));
  EXPECT_EQ(pools.deallocate(fake(1)), GraphPools::Deallocation::not_ours);
}

TEST(GraphPools, DoubleFreeAndExtraReleaseAreRefusedAndCounted) {
  GraphPools pools;
  pools.retain(4);
  ASSERT_TRUE(pools.adopt(4, {fake(9), 512}));
  EXPECT_FALSE(pools.adopt(4, {fake(9), 512})) << "a block the pool knows is not adopted twice";
  ASSERT_EQ(pools.deallocate(fake(9)), GraphPools::Deallocation::returned);
  EXPECT_EQ(pools.deallocate(fake(9)), GraphPools::Deallocation::double_free);
  EXPECT_EQ(pools.stats().double_frees, 1U);
  EXPECT_TRUE(pools.release(4));
  EXPECT_EQ(pools.take_pending().size(), 1U);
  EXPECT_FALSE(pools.release(4));   // no use open: counted, nothing changes
  EXPECT_FALSE(pools.release(99));  // unknown
  EXPECT_EQ(pools.stats().double_frees, 3U);
  EXPECT_EQ(pools.deallocate(fake(5)), GraphPools::Deallocation::not_ours);
}

TEST(GraphPools, APoolWithNoUseTakesAndAdoptsNothing) {
  GraphPools pools;
  EXPECT_FALSE(pools.adopt(5, {fake(3), 4096})) << "adopt never makes a pool";
  pools.retain(5);
  ASSERT_TRUE(pools.adopt(5, {fake(1), 4096}));
  ASSERT_TRUE(pools.adopt(5, {fake(2), 4096}));
  ASSERT_EQ(pools.deallocate(fake(1)), GraphPools::Deallocation::returned);
  EXPECT_TRUE(pools.release(5));                    // fake(2) live: the pool stays
  EXPECT_EQ(pools.take(5, 4096).pointer, nullptr);  // but no capture may draw from it
  EXPECT_FALSE(pools.adopt(5, {fake(3), 4096}));
}

TEST(GraphPools, CloseEndsEveryUseAndKeepsLiveBlocksTheirPools) {
  GraphPools pools;
  pools.retain(1);
  ASSERT_TRUE(pools.adopt(1, {fake(1), 256}));
  ASSERT_TRUE(pools.adopt(1, {fake(2), 256}));
  ASSERT_EQ(pools.deallocate(fake(1)), GraphPools::Deallocation::returned);
  pools.retain(2);
  ASSERT_TRUE(pools.adopt(2, {fake(3), 256}));
  ASSERT_EQ(pools.deallocate(fake(3)), GraphPools::Deallocation::returned);
  pools.close();
  auto pending = pools.take_pending();
  EXPECT_EQ(pending.size(), 2U) << "the free blocks";
  EXPECT_EQ(pools.stats().pools, 1U) << "pool 1 keeps its live block";
  EXPECT_EQ(pools.deallocate(fake(2)), GraphPools::Deallocation::returned);
  pending = pools.take_pending();
  ASSERT_EQ(pending.size(), 1U);
  EXPECT_EQ(pending[0].pointer, fake(2));
  EXPECT_TRUE(pools.empty());
}

TEST(GraphPoolsThreads, ConcurrentPoolsNeverShareBlocks) {
  GraphPools pools;
  constexpr int kThreads = 4;
  constexpr int kRounds = 2000;
  std::atomic<int> crossed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const GraphPools::Id id = static_cast<GraphPools::Id>(t + 1);
      pools.retain(id);
      for (int i = 0; i < kRounds; ++i) {
        auto block = pools.take(id, 4096);
        if (block.pointer == nullptr) {
          block = {fake(static_cast<std::uintptr_t>(t * kRounds + i + 1)), 4096};
          if (!pools.adopt(id, block)) crossed.fetch_add(1);
        }
        // Every block of pool `id` was made by thread t.
        const auto n = reinterpret_cast<std::uintptr_t>(block.pointer) >> 12;
        if ((n - 1) / kRounds != static_cast<std::uintptr_t>(t)) crossed.fetch_add(1);
        if (pools.deallocate(block.pointer) != GraphPools::Deallocation::returned) {
          crossed.fetch_add(1);
        }
      }
      if (!pools.release(id)) crossed.fetch_add(1);
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(crossed.load(), 0);
  EXPECT_TRUE(pools.empty());
  EXPECT_EQ(pools.take_pending().size(), 4U);
}

}  // namespace
}  // namespace vram::testing
