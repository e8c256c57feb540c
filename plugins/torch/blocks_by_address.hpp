// blocks_by_address.hpp: the blocks of one device that a caller holds, by address: the
// record a free is checked against, so that a pointer freed twice, never handed out, or
// named on the wrong device reaches no pool.
//
// Rules:
// - A block is filed by insert() before its address is handed out and taken by take()
//   before it goes back to any pool, so every live block is found exactly once and a second
//   free of an address finds nothing (a double free is refused, never a double return).
// - Shards by address, each with its own mutex: threads allocating different blocks rarely
//   meet; for_each() visits one shard at a time (a consistent view only while nothing
//   allocates or frees).
// - `Block` has a `size` member: the bytes the caller asked for.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

namespace vram_torch {

template <typename Block>
class BlocksByAddress {
 public:
  // Throws std::bad_alloc (nothing filed).
  void insert(void* ptr, Block block) {
    Shard& s = shard(ptr);
    std::lock_guard lock(s.mutex);
    s.blocks.insert_or_assign(ptr, std::move(block));
  }
  // The block at `ptr`, no longer filed; none when `ptr` is not a live block.
  std::optional<Block> take(void* ptr) noexcept {
    Shard& s = shard(ptr);
    std::lock_guard lock(s.mutex);
    const auto it = s.blocks.find(ptr);
    if (it == s.blocks.end()) return std::nullopt;
    std::optional<Block> found(std::move(it->second));
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
  // `fn(ptr, const Block&)` for every live block, under its shard's mutex (fn must not
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
    std::unordered_map<void*, Block> blocks;
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
