// The options of a DevicePool over host memory whose streams a test fence emulates: its large
// tier over host virtual memory (or segments), blocks above 256 KiB there, no map ahead.
#pragma once

#include <memory>
#include <utility>

#include "vram/device_pool.hpp"
#include "vram/stream_fence.hpp"
#include "vram/units.hpp"

namespace vram::testing {

inline DevicePool::Options emulated(std::shared_ptr<StreamFence> fence, bool virtual_memory) {
  using namespace vram::literals;
  DevicePool::Options options;
  options.fence = std::move(fence);
  options.large_tier.memory =
      virtual_memory ? LargeTierMemory::virtual_memory : LargeTierMemory::segments;
  options.small_tier.max_block_bytes = std::size_t{256} << 10;
  options.large_tier.virtual_reservation_bytes = 1_GiB;
  options.large_tier.virtual_map_ahead_bytes = 0;
  options.validate_deallocations = false;
  return options;
}

}  // namespace vram::testing
