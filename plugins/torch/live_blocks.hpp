// live_blocks.hpp: the blocks PyTorch holds of one device, by address, for the native
// allocator (native_allocator.cpp): what a free needs (size, stream, pool), what snapshots,
// checkpoints and live-allocation checks read. The table's rules: blocks_by_address.hpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "blocks_by_address.hpp"
#include "foreign_pool.hpp"

namespace vram_torch {

struct LiveBlock {
  using PoolId = std::pair<std::uint64_t, std::uint64_t>;  // c10::MempoolId_t; {0, 0}: none
  std::size_t size = 0;                                    // requested bytes
  std::size_t block_bytes = 0;  // what the pool (or `foreign`) holds for it
  int device = 0;
  cudaStream_t stream = nullptr;
  PoolId pool{0, 0};
  std::shared_ptr<ForeignPool> foreign;  // set: the block is that pool's, not vram's
  bool uncached = false;                 // cudaMalloc'd while the caching allocator was disabled
  std::shared_ptr<void> context;         // PyTorch's stack of the allocation, if recorded
};

using LiveBlocks = BlocksByAddress<LiveBlock>;

}  // namespace vram_torch
