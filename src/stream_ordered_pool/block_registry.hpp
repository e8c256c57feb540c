// src/stream_ordered_pool/block_registry.hpp: the blocks a pool handed out and the size of each, so
// that a deallocation can be checked before the memory goes anywhere: a pointer the pool never
// handed out (another pool's, cudaMalloc's, or one already deallocated) is unknown, and one
// deallocated under another size is refused and stays handed out. Thread-safe: the pointers
// are spread over shards, each a mutex and a flat map (no allocation per entry; adding can
// throw only when a shard's table grows, with nothing recorded).
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "vram/detail/pointer_map.hpp"

namespace vram::detail {

class BlockRegistry {
 public:
  enum class Deallocation { taken, unknown, wrong_size };

  // Records `block` (non-null, not recorded) as `bytes` (> 0) bytes. Throws std::bad_alloc
  // with nothing recorded.
  void add(const void* block, std::size_t bytes) {
    Shard& shard = shard_of(block);
    std::lock_guard lock(shard.mutex);
    shard.sizes.reserve_one();
    shard.sizes.insert(block, encode(bytes));
  }

  // Takes `block` out when it is recorded as `bytes` bytes. `recorded`: its recorded size
  // (0 when unknown); a block deallocated under another size stays recorded.
  Deallocation take(const void* block, std::size_t bytes, std::size_t& recorded) noexcept {
    Shard& shard = shard_of(block);
    std::lock_guard lock(shard.mutex);
    recorded = decode(shard.sizes.find(block));
    if (recorded == 0) return Deallocation::unknown;
    if (recorded != bytes) return Deallocation::wrong_size;
    shard.sizes.erase(block);
    return Deallocation::taken;
  }

  std::size_t size() noexcept {
    std::size_t n = 0;
    for (Shard& shard : shards_) {
      std::lock_guard lock(shard.mutex);
      n += shard.sizes.size();
    }
    return n;
  }

 private:
  // Sizes ride in the map's value pointer (never null: a block has at least one byte).
  static std::byte* encode(std::size_t bytes) noexcept {
    return reinterpret_cast<std::byte*>(bytes);
  }
  static std::size_t decode(const std::byte* value) noexcept {
    return reinterpret_cast<std::size_t>(value);
  }

  static constexpr std::size_t kShards = 64;
  struct alignas(64) Shard {
    std::mutex mutex;
    PointerMap<std::byte> sizes;
  };
  Shard& shard_of(const void* block) noexcept {
    // Blocks are at least 256-byte aligned: drop those bits, mix the rest.
    const auto bits = reinterpret_cast<std::uintptr_t>(block) >> 8;
    return shards_[(bits * 0x9E3779B97F4A7C15ull) >> (64 - std::countr_zero(kShards))];
  }
  std::array<Shard, kShards> shards_;
};

}  // namespace vram::detail
