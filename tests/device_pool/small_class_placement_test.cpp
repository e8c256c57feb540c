// Where small blocks are carved from (DevicePoolOptions::small_tier.segment_max_bytes): classes
// up to it from the small tier's 2 MiB segments, larger small classes from the large tier,
// whose free memory then serves both kinds. Host memory, the large tier over the host
// emulation of virtual memory (the default on a device with virtual memory management) or
// over segments.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <set>
#include <vector>

#include "small_class_helpers.hpp"
#include "test_upstreams.hpp"
#include "vram/device_pool.hpp"
#include "vram/stream_fence.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

DevicePool::Options virtual_options() {
  auto options = virtual_host_options();
  options.large_tier.virtual_reservation_bytes = 1_GiB;
  return options;
}

TEST(SmallClassPlacement, LargerSmallClassesReuseTheLargeTiersFreeMemoryAndGiveItBack) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, virtual_options());
  ASSERT_TRUE(pool.uses_virtual_memory());
  void* large = pool.allocate(64_MiB);
  pool.deallocate(large, 64_MiB);
  const std::uint64_t calls = upstream->allocations();
  ASSERT_EQ(upstream->live_bytes(), 64_MiB);
  // 100 blocks of the 512 KiB class (above the automatic 256 KiB): carved out of the
  // 64 MiB the large tier holds free, nothing new from the upstream.
  std::vector<void*> blocks;
  std::set<void*> distinct;
  for (int i = 0; i < 100; ++i) {
    blocks.push_back(pool.allocate(500_KiB));
    distinct.insert(blocks.back());
  }
  EXPECT_EQ(distinct.size(), blocks.size());
  EXPECT_EQ(upstream->allocations(), calls);
  EXPECT_EQ(upstream->live_bytes(), 64_MiB);
  EXPECT_EQ(pool.stats().bytes_in_use, 100 * 512_KiB);
  for (void* block : blocks) pool.deallocate(block, 500_KiB);
  // Back in the large tier, they merged: the 64 MiB block fits again without a map.
  large = pool.allocate(64_MiB);
  EXPECT_EQ(upstream->allocations(), calls);
  pool.deallocate(large, 64_MiB);
  // A class up to 256 KiB still comes from a 2 MiB segment of the small tier.
  void* small = pool.allocate(200_KiB);
  EXPECT_EQ(upstream->allocations(), calls + 1);
  EXPECT_EQ(upstream->live_bytes(), 66_MiB);
  pool.deallocate(small, 200_KiB);
  EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
  expect_everything_back(pool, *upstream);
}

// Every small class from the small tier: with an explicit threshold at small_tier.max_block_bytes,
// and with the automatic one over segments.
TEST(SmallClassPlacement, AnExplicitThresholdOrSegmentsKeepEverySmallClassInTheSmallTier) {
  for (const bool segments : {false, true}) {
    SCOPED_TRACE(segments ? "segments, automatic threshold" : "virtual memory, 1 MiB threshold");
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto options = virtual_options();
    if (segments) {
      options.large_tier.memory = LargeTierMemory::segments;
    } else {
      options.small_tier.segment_max_bytes = options.small_tier.max_block_bytes;
    }
    DevicePool pool(upstream, options);
    ASSERT_EQ(pool.uses_virtual_memory(), !segments);
    hold_free_large_memory(pool);
    const std::uint64_t calls = upstream->allocations();
    void* block = pool.allocate(1_MiB);
    EXPECT_EQ(upstream->allocations(), calls + 1) << "a 2 MiB segment of the small tier";
    EXPECT_EQ(upstream->live_bytes(), 66_MiB);
    pool.deallocate(block, 1_MiB);
    expect_everything_back(pool, *upstream);
  }
}

// The reuse rule of deallocate_async holds for a class carved out of the large tier, with
// and without the thread cache in front of it: the freeing stream gets the block back at
// once, another stream only after the marker on the freeing stream completed.
TEST(SmallClassPlacement, StreamOrderedFreesOfLargerSmallClassesKeepTheirStream) {
  for (const std::size_t thread_cache_blocks : {std::size_t{0}, std::size_t{8}}) {
    SCOPED_TRACE(thread_cache_blocks);
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto fence = std::make_shared<ManualFence>();
    auto options = virtual_options();
    options.fence = fence;
    options.thread_cache.blocks = thread_cache_blocks;
    DevicePool pool(upstream, options);
    const auto s1 = reinterpret_cast<cudaStream_t>(0x10);
    const auto s2 = reinterpret_cast<cudaStream_t>(0x20);
    void* a = pool.allocate_async(768_KiB, s1);
    pool.deallocate_async(a, 768_KiB, s1);
    void* c = pool.allocate_async(768_KiB, s1);
    EXPECT_EQ(c, a) << "stream order on s1 makes a safe for s1 at once";
    pool.deallocate_async(c, 768_KiB, s1);  // young s1: a marker on s1 in this call
    const std::uint64_t recorded = fence->recorded();
    void* b = pool.allocate_async(768_KiB, s2);
    // s1's work may still use a: s2 gets it only after the host waited for the marker on
    // s1 or quiesced the device (ManualFence: either completes the marker, as the device
    // would). s1 makes no call after its free, so nothing more may be recorded on it.
    EXPECT_TRUE(b != a || fence->waits() > 0 || fence->quiesces() > 0)
        << "a went to s2 with no wait for s1's work";
    EXPECT_EQ(fence->recorded(), recorded) << "a marker on s1 outside a call on s1";
    pool.deallocate_async(b, 768_KiB, s2);
    EXPECT_EQ(pool.stats().bytes_in_use, 0U);
    pool.trim(0);
    EXPECT_EQ(upstream->live_bytes(), 0U);
    EXPECT_EQ(upstream->bad_frees(), 0U);
  }
}

// Blocks cached in threads and rings go back to the tier they came from: trim(0) leaves
// nothing mapped and nothing freed twice.
TEST(SmallClassPlacement, TrimReturnsCachedBlocksOfEveryClassToTheirTier) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = virtual_options();
  options.thread_cache.blocks = 8;
  options.max_cached_blocks_per_class = 64;
  DevicePool pool(upstream, options);
  std::vector<std::pair<void*, std::size_t>> blocks;
  for (const std::size_t bytes : {300_KiB, 1_MiB, 64_KiB, 600_KiB, 256_KiB, 257_KiB}) {
    for (int i = 0; i < 20; ++i) blocks.emplace_back(pool.allocate(bytes), bytes);
  }
  for (auto [block, bytes] : blocks) pool.deallocate(block, bytes);
  const auto cached = pool.stats();
  EXPECT_GT(cached.bytes_cached_in_threads + cached.bytes_cached_in_rings, 0U);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(pool.stats().bytes_reserved, 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(SmallClassPlacement, ADoubleFreeOfALargerSmallClassIsRejected) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, virtual_options());
  void* a = pool.allocate(512_KiB);
  pool.deallocate(a, 512_KiB);
  pool.deallocate(a, 512_KiB);
  EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
  void* b = pool.allocate(512_KiB);
  void* c = pool.allocate(512_KiB);
  EXPECT_NE(b, c) << "the block was cached once";
  pool.deallocate(b, 512_KiB);
  pool.deallocate(c, 512_KiB);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

}  // namespace
}  // namespace vram::testing
