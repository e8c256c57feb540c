// memory_map.hpp: what DevicePool::memory_map() returns: the pool's memory as segments cut
// into ranges, for pictures of memory and fragmentation (PyTorch's snapshots).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace vram {

// One span of a DevicePool's memory, cut into ranges in address order: a segment taken
// from the upstream, or an extent of mapped granules of the virtual-memory large tier (its
// free ranges not wholly mapped are left out).
struct DevicePoolSegment {
  struct Range {
    std::uintptr_t address = 0;
    std::size_t bytes = 0;
    bool used = false;  // handed out by its tier: live, or cached by the pool (caches, rings)
  };
  std::uintptr_t address = 0;
  std::size_t bytes = 0;
  bool large = false;           // the large tier's (else the small classes')
  bool virtual_memory = false;  // mapped granules of the virtual-memory tier
  std::vector<Range> ranges;
};

}  // namespace vram
