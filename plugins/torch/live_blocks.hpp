// live_blocks.hpp: the blocks PyTorch holds of one device, by address, for the native
// allocator (native_allocator.cpp): what a free needs (size, stream, pool), what snapshots,
// checkpoints and live-allocation checks read.
//
// Rules:
// - A block is filed by insert() before its address is handed out and taken by take()
//   before it goes back to any pool, so every live block is found exactly once and a second
//   free of an address finds nothing (a double free is refused, never a double return).
// - Shards by address, each with its own mutex: threads allocating different blocks rarely
//   meet; for_each() visits one shard at a time (a consistent view only while nothing
//   allocates or frees, which is how PyTorch calls it: snapshots and checkpoints).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

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

class LiveBlocks {
 public:
  // Throws std::bad_alloc (nothing filed).
  void insert(void* ptr, LiveBlock block) {
    Shard& s = shard(ptr);
    std::lock_guard lock(s.mutex);
    s.blocks.insert_or_assign(ptr, std::move(block));
  }
  // The block at `ptr`, no longer filed; none when `ptr` is not a live block.
  std::optional<LiveBlock> take(void* ptr) noexcept {
    Shard& s = shard(ptr);
    std::lock_guard lock(s.mutex);
    const auto it = s.blocks.find(ptr);
    if (it == s.blocks.end()) return std::nullopt;
    std::optional<LiveBlock> found(std::move(it->second));
    s.blocks.erase(it);
    return found;
  }
  // The requested size of the live block at `ptr`, 0 when none.
  std::size_t size_of(const void* ptr) const noexcept {
    const Shard& s = shard(ptr);
    std::lock_guard lock(s.mutex);
    const auto it = s.blocks.find(const_cast<void*>(ptr));
    return it == s.blocks.end() ? 0 : it->second.size;
  }
  // `fn(ptr, const LiveBlock&)` for every live block, under its shard's mutex (fn must not
  // allocate or free through this table).
  template <typename Fn>
  void for_each(Fn&& fn) const {
    for (const Shard& s : shards_) {
      std::lock_guard lock(s.mutex);
      for (const auto& [ptr, block] : s.blocks) fn(ptr, block);
    }
  }

 private:
  static constexpr std::size_t kShards = 64;
  struct alignas(64) Shard {
    mutable std::mutex mutex;
    std::unordered_map<void*, LiveBlock> blocks;
  };
  static std::size_t index_of(const void* ptr) noexcept {
    const auto bits = reinterpret_cast<std::uintptr_t>(ptr) >> 8;           // blocks: 256-aligned
    return static_cast<std::size_t>((bits * 0x9E3779B97F4A7C15ULL) >> 58);  // top 6 bits
  }
  Shard& shard(const void* ptr) noexcept { return shards_[index_of(ptr)]; }
  const Shard& shard(const void* ptr) const noexcept { return shards_[index_of(ptr)]; }

  std::array<Shard, kShards> shards_;
};

}  // namespace vram_torch
