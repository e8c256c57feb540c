// Helpers of the tests of where small blocks are carved from (small_class_placement_test.cpp,
// large_tier_small_classes_test.cpp): a pool over host memory whose large tier runs over the host
// emulation of virtual memory (the H200 default), with caches off so blocks go straight back to
// their tier.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>

#include "test_upstreams.hpp"
#include "vram/device_pool.hpp"
#include "vram/units.hpp"

namespace vram::testing {

inline DevicePool::Options virtual_host_options() {
  using namespace vram::literals;
  DevicePool::Options options;
  options.large_tier.memory = LargeTierMemory::virtual_memory;
  options.large_tier.virtual_reservation_bytes = 2_GiB;
  options.large_tier.virtual_map_ahead_bytes =
      0;                            // granules mapped only under blocks (unless a test sets it)
  options.thread_cache.blocks = 0;  // blocks straight back to their tier
  options.max_cached_blocks_per_class = 0;
  options.validate_deallocations = true;
  return options;
}

// 64 MiB mapped in the large tier and free: what a block carved from it can take without
// an upstream call.
inline void hold_free_large_memory(DevicePool& pool) {
  using namespace vram::literals;
  pool.deallocate(pool.allocate(64_MiB), 64_MiB);
}

// With hold_free_large_memory() done: a request carved from the large tier makes no
// upstream call; one carved from the small tier takes a 2 MiB segment (given back after).
inline bool carved_from_small_tier(DevicePool& pool, TestUpstream& upstream, std::size_t bytes) {
  using namespace vram::literals;
  const std::uint64_t before = upstream.allocations();
  void* block = pool.allocate(bytes);
  const bool small = upstream.allocations() != before;
  pool.deallocate(block, bytes);
  pool.trim(64_MiB);  // the small tier's segment goes back, the large tier keeps 64 MiB
  return small;
}

// Everything back to the upstream after trim(0), nothing freed twice or foreign.
inline void expect_everything_back(DevicePool& pool, TestUpstream& upstream) {
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_reserved, 0U);
  EXPECT_EQ(upstream.live_bytes(), 0U);
  EXPECT_EQ(upstream.bad_frees(), 0U);
}

}  // namespace vram::testing
