// Small classes above small_tier.segment_max_bytes, carved out of the large tier, and virtual
// map-ahead only for a block that raises the tier's peak of used bytes. Host memory: the
// large tier over the host emulation of virtual memory, ManualFence for streams. Each
// comment states the rule its test holds the pool to.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "small_class_helpers.hpp"
#include "steady_stream.hpp"
#include "test_upstreams.hpp"
#include "vram/device_pool.hpp"
#include "vram/size_classes.hpp"
#include "vram/stream_fence.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

DevicePool::Options virtual_options() { return virtual_host_options(); }

// ---- 1c92c56: placement edges (pass: checked, as documented) --------------------------

TEST(LargeTierSmallClassesPlacement, ClassEdgesAroundTheThresholdAndSmallBlockMax) {
  struct Case {
    std::size_t small_max;
    std::size_t segment_max;  // 0: automatic
    std::size_t bytes;
    bool small;
  };
  const Case cases[] = {
      {1_MiB, 0, 256_KiB, true},       // the automatic threshold itself: small tier
      {1_MiB, 0, 256_KiB + 1, false},  // the next class (320 KiB): large tier
      {1_MiB, 0, 1_MiB, false},        // small_tier.max_block_bytes
      {2_MiB, 0, 2_MiB, false},        // the largest small class there is
      {256_KiB, 0, 256_KiB, true},     // small_max at the threshold: all small
      {300_KiB, 0, 300_KiB, false},    // small_max inside the 320 KiB class
      {1_MiB, 1_MiB, 1_MiB, true},     // explicit threshold >= small_max: all small
      {1_MiB, 1, 2048, true},          // below 2 KiB counts as 2 KiB: 2 KiB blocks stay
      {1_MiB, 1, 2049, false},         // ... and the 2560 B class goes to the large tier
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "small_max " << c.small_max << " segment_max "
                                      << c.segment_max << " bytes " << c.bytes);
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto options = virtual_options();
    options.small_tier.max_block_bytes = c.small_max;
    options.small_tier.segment_max_bytes = c.segment_max;
    DevicePool pool(upstream, options);
    hold_free_large_memory(pool);
    EXPECT_EQ(carved_from_small_tier(pool, *upstream, c.bytes), c.small);
    EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
    expect_everything_back(pool, *upstream);
  }
}

// The threshold is a block size (not a class, which would round up):
// with 300 KiB the 320 KiB class, above it, is carved from the large tier; 256 KiB blocks
// stay in the small tier.
TEST(LargeTierSmallClassesPlacement, AThresholdBetweenClassesIsABlockSize) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = virtual_options();
  options.small_tier.segment_max_bytes = 300_KiB;
  DevicePool pool(upstream, options);
  hold_free_large_memory(pool);
  EXPECT_TRUE(carved_from_small_tier(pool, *upstream, 250_KiB));
  EXPECT_FALSE(carved_from_small_tier(pool, *upstream, 310_KiB))
      << "the 320 KiB class, above the 300 KiB threshold, is carved from the large tier";
}

// A threshold below 2 KiB counts as 2 KiB: every class carved from the large tier is then a
// multiple of its 512-byte rounding, so its blocks are exactly block_bytes() apart (with a
// lower threshold the 1280 B and 1792 B classes would be carved at 1536 and 2048 bytes
// while block_bytes() and bytes_in_use count 1280 and 1792).
TEST(LargeTierSmallClassesPlacement, LargeTierClassesAreCarvedAtTheirBlockBytes) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = virtual_options();
  options.small_tier.segment_max_bytes = 1024;
  DevicePool pool(upstream, options);
  hold_free_large_memory(pool);
  EXPECT_TRUE(carved_from_small_tier(pool, *upstream, 1100)) << "1280 B blocks: small tier";
  ASSERT_EQ(pool.block_bytes(2100), 2560U);
  std::vector<char*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(static_cast<char*>(pool.allocate(2100)));
  for (int i = 1; i < 4; ++i) {
    EXPECT_EQ(static_cast<std::size_t>(blocks[i] - blocks[i - 1]), 2560U);
  }
  EXPECT_EQ(pool.stats().bytes_in_use, 4 * 2560U);
  for (char* block : blocks) pool.deallocate(block, 2100);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// ---- release validation across the tier boundary -----------------------------------------

// Rule: the boundary between the tiers is a block size, so classes that share a block size
// share a tier. validate_deallocations checks a release against block_bytes(bytes), and several
// classes share one block size (320, 384, 448 and 512 B are all 512-byte blocks; 640/768;
// 896/1024): a release naming another class of the same block size must reach the tier that
// holds the block. With small_tier.segment_max_bytes between two such classes (320 here), a
// release routed to the other tier would be rejected there (or discarded from a bin), and the
// block would be stranded in its segment for good.
TEST(LargeTierSmallClassesValidation, ASameBlockSizeReleaseAcrossTheTierBoundaryStrandsNoBlock) {
  // Control: small_tier.segment_max_bytes = small_tier.max_block_bytes (every class in the small
  // tier) passes every assertion below.
  for (const std::size_t segment_max : {std::size_t{320}, std::size_t{1_MiB}})
    for (const std::size_t thread_cache_blocks : {std::size_t{0}, std::size_t{8}}) {
      SCOPED_TRACE(::testing::Message() << "small_tier.segment_max_bytes " << segment_max
                                        << " thread_cache.blocks " << thread_cache_blocks);
      auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
      {
        auto options = virtual_options();
        options.small_tier.segment_max_bytes = segment_max;  // 320: 320 B class small, 384 B large
        options.thread_cache.blocks = thread_cache_blocks;
        DevicePool pool(upstream, options);
        ASSERT_EQ(pool.block_bytes(300), pool.block_bytes(384));  // both 512-byte blocks
        void* block = pool.allocate(300);                         // 320 B class: small tier
        pool.deallocate(block, 384);  // wrong size, same block bytes: passes validation
        pool.deallocate(block, 300);  // the right size
        pool.trim(0);
        const auto stats = pool.stats();
        EXPECT_EQ(stats.invalid_deallocations, 1U) << "one of the two releases is rejected";
        EXPECT_EQ(stats.bytes_in_use, 0U);
        EXPECT_EQ(stats.bytes_reserved, 0U) << "the block stranded its small segment";
        EXPECT_EQ(upstream->live_bytes(), 0U);
      }
      // No block stays counted as leased: the destroyed pool leaves nothing orphaned.
      EXPECT_EQ(upstream->live_bytes(), 0U) << "after the pool's destruction";
    }
}

// Rule: SegmentTier::free checks the size the block was allocated with. Without
// validate_deallocations a release naming a size above small_tier.max_block_bytes goes to the large
// tier, which carves the classes above 256 KiB: a double release of such a block under a large size
// (the block cached in this thread) is rejected, so the next two requests never get the same
// memory.
TEST(LargeTierSmallClassesValidation, ALargeSizedDoubleReleaseOfALargeTierSmallBlockIsRejected) {
  // Control: small_tier.segment_max_bytes = 1 MiB (every class in the small tier) passes.
  for (const std::size_t segment_max : {std::size_t{0}, std::size_t{1_MiB}}) {
    SCOPED_TRACE(::testing::Message() << "small_tier.segment_max_bytes " << segment_max);
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    {
      auto options = virtual_options();
      options.validate_deallocations = false;  // release builds
      options.thread_cache.blocks = 8;
      options.small_tier.segment_max_bytes = segment_max;
      DevicePool pool(upstream, options);
      void* p = pool.allocate(512_KiB);
      pool.deallocate(p, 512_KiB);  // cached in this thread
      pool.deallocate(p, 2_MiB);    // double release under a large size
      EXPECT_EQ(pool.stats().invalid_deallocations, 1U) << "a large-sized double release accepted";
      void* a = pool.allocate(512_KiB);
      void* b = pool.allocate(2_MiB);
      EXPECT_NE(a, b) << "one block handed out twice";
      pool.deallocate(a, 512_KiB);
      pool.deallocate(b, 2_MiB);
    }
    // (Checked: close()'s trim still gives the physical memory back. But the accepted extra
    // release makes releases exceed acquires: close() reports 2^64-1 blocks leased on
    // stderr and the core stays orphaned for good, its reserved address range with it.)
    EXPECT_EQ(upstream->live_bytes(), 0U) << "after the pool's destruction";
  }
}

// ---- 1c92c56: stream tags --------------------------------------------------------------

// Release builds (no validate_deallocations): the large tier takes a block back only under the
// size it was allocated with (rounded to 512 B), so a wrong-size release of a large block
// is rejected and counted, and the block stays leased until its right release.
TEST(LargeTierSmallClassesValidation, AWrongSizeReleaseOfALargeBlockIsRejectedWithoutValidation) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = virtual_options();
  options.validate_deallocations = false;
  DevicePool pool(upstream, options);
  void* p = pool.allocate(4_MiB);
  pool.deallocate(p, 8_MiB);
  EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
  EXPECT_EQ(pool.stats().bytes_in_use, 4_MiB);
  pool.deallocate(p, 4_MiB - 100);  // the same size once rounded to 512 B
  EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// Accepted cost (segment_tier.cpp insert_free/mergeable): a stream-ordered free of a
// small-class block that reaches the large tier (no thread cache, or its bin full) on a steady
// stream merges with its untagged free neighbours and takes the stream's tag, as a large
// block's free always did: one 512 KiB block freed on s1 next to 64 MiB of plain-freed memory
// makes it s1's, and a 32 MiB request on s2 quiesces the device (past the growth budget: s1
// made no call since, so no marker may be recorded on it) or maps more (within it). The
// alternatives cost memory on the four-stream decode trace (no merging across tags: 1.32x the
// live bytes instead of 1.04x; merging only neighbours no larger than the freed range:
// 1.20x). This pins the reuse rule (s2 never gets s1's block without a wait or a quiesce) and
// the cost (one of them, or a map); the control (the block in the small tier) has none. A
// young s1's free is filed pending under its own marker, merging with nothing: no cost.
TEST(LargeTierSmallClassesStreams, ASmallClassStreamFreeCapturesTheLargeTiersUntaggedNeighbour) {
  for (const bool steady : {true, false})
    for (const std::size_t segment_max : {std::size_t{0}, std::size_t{1_MiB}})
      for (const double headroom : {1.0 / 16, 1.0}) {
        SCOPED_TRACE(::testing::Message()
                     << (steady ? "s1 steady" : "s1 young") << " small_tier.segment_max_bytes "
                     << segment_max << " growth_headroom " << headroom);
        auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
        auto fence = std::make_shared<ManualFence>();
        auto options = virtual_options();
        options.fence = fence;
        options.growth_headroom = headroom;
        options.small_tier.segment_max_bytes = segment_max;
        DevicePool pool(upstream, options);
        const auto s1 = reinterpret_cast<cudaStream_t>(0x10);
        const auto s2 = reinterpret_cast<cudaStream_t>(0x20);
        if (steady) free_often_on(pool, s1);
        fence->complete_all();
        pool.trim(0);  // what the steady-making frees left
        char* x = static_cast<char*>(pool.allocate_async(512_KiB, s1));
        void* big = pool.allocate(64_MiB);
        pool.deallocate(big, 64_MiB);           // plain free: usable by any stream
        pool.deallocate_async(x, 512_KiB, s1);  // young s1: a marker on s1 in this call
        const std::uint64_t recorded = fence->recorded();
        const std::uint64_t maps = upstream->allocations();
        const std::uint64_t waits = fence->waits() + fence->quiesces();
        char* y = static_cast<char*>(pool.allocate_async(32_MiB, s2));
        const bool overlaps = y < x + 512_KiB && x < y + 32_MiB;
        const std::uint64_t waits_after = fence->waits() + fence->quiesces();
        if (overlaps) EXPECT_GT(waits_after, waits) << "s1's block went to s2 without a wait";
        EXPECT_EQ(fence->recorded(), recorded) << "a marker on s1 outside a call on s1";
        const bool waited_or_mapped = waits_after != waits || upstream->allocations() != maps;
        EXPECT_EQ(waited_or_mapped, steady && segment_max == 0)
            << "the cost, and the controls without it";
        pool.deallocate_async(y, 32_MiB, s2);
        pool.trim(0);
        EXPECT_EQ(upstream->live_bytes(), 0U);
      }
}

// Checked: the reuse rule holds for a large-tier small class freed on a stream through a
// thread cache that then switches streams (drain_bins moves the old stream's blocks to the
// large tier under their tag), and trim/forget_streams clear the tags. Passes.
TEST(LargeTierSmallClassesStreams, ThreadCacheTagSwitchKeepsLargeTierSmallBlocksOnTheirStream) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<ManualFence>();
  auto options = virtual_options();
  options.fence = fence;
  options.thread_cache.blocks = 8;
  options.validate_deallocations = false;
  DevicePool pool(upstream, options);
  const auto s1 = reinterpret_cast<cudaStream_t>(0x10);
  const auto s2 = reinterpret_cast<cudaStream_t>(0x20);
  free_often_on(pool, s1);  // steady: its frees are cached (a young stream's go to the tier)
  fence->complete_all();
  std::vector<void*> on_s1;
  for (int i = 0; i < 4; ++i) on_s1.push_back(pool.allocate_async(512_KiB, s1));
  for (void* b : on_s1) pool.deallocate_async(b, 512_KiB, s1);  // cache tagged s1
  void* other = pool.allocate_async(512_KiB, s2);               // not from s1's cache
  pool.deallocate_async(other, 512_KiB, s2);  // tag switch: s1's blocks to the tier
  const std::uint64_t waits = fence->waits() + fence->quiesces();
  const std::set<void*> s1_blocks(on_s1.begin(), on_s1.end());
  std::vector<void*> taken;
  for (int i = 0; i < 8; ++i) {
    void* b = pool.allocate_async(512_KiB, s2);
    if (s1_blocks.count(b) != 0) {
      EXPECT_GT(fence->waits() + fence->quiesces(), waits) << "s1's block went to s2 unfenced";
    }
    taken.push_back(b);
  }
  for (void* b : taken) pool.deallocate_async(b, 512_KiB, s2);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

// ---- 1c92c56: lifetime and concurrency (pass: checked) -------------------------------

// Threads lease classes on both sides of the threshold, a trimmer runs alongside, and the
// pool is destroyed with blocks of both tiers still leased (orphaned path: each goes
// straight back to its tier and the upstream). Nothing freed twice, nothing left.
TEST(LargeTierSmallClassesLifetime, OrphanedBlocksOfBothTiersGoBackExactlyOnce) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  std::vector<DevicePool::Lease> leased;
  {
    auto options = virtual_options();
    options.thread_cache.blocks = 8;
    options.max_cached_blocks_per_class = 64;
    options.validate_deallocations = false;
    options.large_tier.virtual_map_ahead_bytes = 128_MiB;
    auto pool = std::make_unique<DevicePool>(upstream, options);
    std::atomic<bool> stop{false};
    std::thread trimmer([&] {
      while (!stop.load()) pool->trim(0);
    });
    std::vector<std::thread> workers;
    std::vector<std::vector<DevicePool::Lease>> kept(4);
    for (int t = 0; t < 4; ++t) {
      workers.emplace_back([&, t] {
        const std::size_t sizes[] = {200_KiB, 256_KiB, 256_KiB + 1, 768_KiB, 1_MiB, 3_MiB};
        std::vector<DevicePool::Lease> mine;
        for (int i = 0; i < 3000; ++i) {
          mine.push_back(pool->acquire(sizes[(i * 7 + t) % 6]));
          if (mine.size() > 12) mine.erase(mine.begin());  // released on this thread
        }
        kept[t] = std::move(mine);
      });
    }
    for (auto& w : workers) w.join();
    stop.store(true);
    trimmer.join();
    for (auto& mine : kept) {
      for (auto& lease : mine) leased.push_back(std::move(lease));
    }
    pool.reset();  // destroyed with blocks of both tiers leased
  }
  EXPECT_GT(upstream->live_bytes(), 0U);
  // Released on another thread after destruction: the orphaned path, straight back.
  std::thread([&] { leased.clear(); }).join();
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

// ---- 877d736: map-ahead only above the peak -----------------------------------------

// 160 blocks of 2.5 MiB (400 MiB) in small steps; maps counted (upstream allocations).
std::uint64_t grow(DevicePool& pool, TestUpstream& upstream, std::vector<void*>& blocks) {
  const std::uint64_t before = upstream.allocations();
  for (int i = 0; i < 160; ++i) blocks.push_back(pool.allocate(2560_KiB));
  return upstream.allocations() - before;
}

// Rule: map-ahead follows the peak of used bytes since the tier last unmapped granules
// (ahead_peak_), not the all-time peak, which restarts only in DevicePool::trim(). Memory
// given back by any other path (free bytes past max_cached_bytes unmapped on release, the
// out-of-memory retry's internal trim, a failed map's reclaim) restarts it too. A workload
// that peaks, releases (its free mapped bytes cut to max_cached_bytes) and grows again in
// small steps (a warm-up at the largest batch, then serving; one request's KV cache after
// another's) then makes a few long maps on its regrowth, about as many as on its first
// growth (control: the same pool with the peak restarted by trim(SIZE_MAX), which unmaps
// nothing), not one map per block (on a device each map costs 60-86 us).
TEST(LargeTierSmallClassesMapAhead, RegrowthAfterAGiveBackMapsInLongRuns) {
  std::uint64_t regrowth_maps[2] = {};
  std::uint64_t first_maps[2] = {};
  for (const bool restart_peak : {false, true}) {
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto options = virtual_options();
    options.large_tier.virtual_map_ahead_bytes = 128_MiB;  // the default
    options.max_cached_bytes = 64_MiB;
    DevicePool pool(upstream, options);
    std::vector<void*> blocks;
    first_maps[restart_peak] = grow(pool, *upstream, blocks);
    for (void* b : blocks) pool.deallocate(b, 2560_KiB);  // free mapped bytes cut to 64 MiB
    blocks.clear();
    ASSERT_LE(upstream->live_bytes(), 64_MiB + 2_MiB);
    if (restart_peak) pool.trim(SIZE_MAX);  // unmaps nothing; restarts the tiers' peaks
    ASSERT_LE(upstream->live_bytes(), 64_MiB + 2_MiB);
    regrowth_maps[restart_peak] = grow(pool, *upstream, blocks);
    for (void* b : blocks) pool.deallocate(b, 2560_KiB);
    pool.trim(0);
    EXPECT_EQ(upstream->live_bytes(), 0U);
  }
  // Control: with the peak restarted, the regrowth maps ahead like the first growth.
  EXPECT_LE(regrowth_maps[1], first_maps[1]);
  // The same regrowth under the stale peak.
  EXPECT_LE(regrowth_maps[0], 2 * regrowth_maps[1] + 4)
      << "first growth " << first_maps[0] << " maps; regrowth below the stale peak "
      << regrowth_maps[0] << " maps; with the peak restarted " << regrowth_maps[1];
}

// Not a test (no deterministic interleaving without timing): flush_and_end_claim(), which
// honours a trim() that found this thread inside a slow call, trims the large tier too, to
// the latest trim's keep_bytes: drain_bins() returns blocks of the classes above the threshold
// to the large tier, and when the owner flushes after the trimmer's large.trim() has run they
// must not stay mapped. The losing order can only be forced by scheduling, not by a hook.

}  // namespace
}  // namespace vram::testing
