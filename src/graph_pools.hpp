// src/graph_pools.hpp: graph-private pools, the memory captured CUDA graphs use.
//
// A captured graph runs its work at every launch, long after the capture: every block its
// kernels touch must stay the graph's for as long as the graph can be launched. A graph
// pool holds such blocks apart from the shared tiers.
//
// Reuse rules (PyTorch's private pools follow the same):
// - A block allocated under a capture into pool P is P's. When it is freed (inside the
//   capture or after it) it goes back to P, never to the shared tiers: only a later
//   allocation into P reuses it. Captures into one pool replay in capture order, so a
//   block freed inside one capture is safe for the next capture into the same pool.
// - P's use count is the number of open uses (a capture into P, a graph that keeps P);
//   retain() opens one, release() ends one. P's memory returns to the shared tiers once its
//   use count is zero and none of its blocks is live; until then it stays P's, however
//   long that is.
// - A free of a block that is P's but not live (a double free) is refused and counted; the
//   block stays free in P.
// Thread safety: every call but may_own() takes one mutex (graph pools are touched while
// capturing and when their blocks are freed). may_own() is one relaxed load of a counting
// filter over the blocks' addresses: false means the block is no graph pool's, so frees of
// other blocks never take the mutex while graph pools exist. A block's slot is counted up
// before the block is handed out and down after it left every pool.
// `activity` (optional): raised by one for each pool that exists (graph_activity.hpp).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "graph_activity.hpp"

namespace vram::detail {

class GraphPools {
 public:
  explicit GraphPools(GraphActivity* activity = nullptr) noexcept : activity_(activity) {}
  using Id = std::uint64_t;
  struct Block {
    void* pointer = nullptr;
    std::size_t bytes = 0;
  };
  enum class Release { not_ours, returned, double_free };
  struct Stats {
    std::size_t pools = 0;       // pools with a use open or memory held
    std::size_t held_bytes = 0;  // live and free bytes of every pool
    std::size_t live_bytes = 0;  // of which handed out
    std::size_t blocks = 0;      // blocks held
    std::uint64_t double_frees = 0;
  };

  // Opens a use of pool `id` (made at the first use).
  void retain(Id id);
  // Ends a use of pool `id`. Returns the blocks that go back to the shared tiers: all of
  // the pool's once no use remains and none is live; none otherwise. A pool with no open
  // use is left as it is: `refused` (when given) is set, and the call counted as a double
  // free.
  [[nodiscard]] std::vector<Block> release(Id id, bool* refused = nullptr);
  // A free block of pool `id` that serves `bytes` (best fit, at most a quarter larger),
  // now live; a null block when there is none or the pool has no open use.
  Block take(Id id, std::size_t bytes);
  // Makes `block`, just taken from the shared tiers, a live block of pool `id`.
  void adopt(Id id, Block block);
  // A freed block: back to its pool when it is a graph pool's. `to_shared` receives the
  // pool's memory when this was its last live block and no use remains.
  Release give_back(void* pointer, std::vector<Block>& to_shared);
  // The bytes of a live block of a graph pool (its real size, which may exceed the size
  // the caller asked for); 0 when the pointer is no live graph block.
  std::size_t live_bytes_of(const void* pointer) const;
  // True when no graph pool holds memory or has a use open.
  bool empty() const noexcept { return pools_.load(std::memory_order_relaxed) == 0; }
  bool may_own(const void* pointer) const noexcept {
    return filter_[slot_of(pointer)].load(std::memory_order_relaxed) != 0;
  }
  Stats stats() const;
  // Every block of every pool, for the owner's destruction; the pools are emptied.
  std::vector<Block> take_all();

 private:
  struct Pool {
    std::size_t uses = 0;
    std::size_t live_blocks = 0;
    std::size_t held_bytes = 0;
    std::size_t live_bytes = 0;
    std::multimap<std::size_t, void*> free;  // bytes -> block
  };
  struct Owner {
    Id pool = 0;
    std::size_t bytes = 0;
    bool live = false;
  };
  // Under mutex_: the pool's memory back to the shared tiers if it has no use and nothing
  // live; erases it.
  void retire_if_unused(Id id, std::vector<Block>& to_shared);
  // Under mutex_: keeps pools_ and the owner's activity count in step with by_id_.
  void note_pools() noexcept;
  static std::size_t slot_of(const void* pointer) noexcept {
    const auto bits = reinterpret_cast<std::uintptr_t>(pointer) >> 8;  // blocks: 256-aligned
    return static_cast<std::size_t>((bits * 0x9E3779B97F4A7C15ULL) >> (64 - kFilterBits));
  }
  static constexpr unsigned kFilterBits = 14;

  mutable std::mutex mutex_;
  std::unordered_map<Id, Pool> by_id_;
  std::unordered_map<const void*, Owner> owner_;
  std::atomic<std::size_t> pools_{0};
  GraphActivity* activity_;
  std::uint64_t double_frees_ = 0;
  std::array<std::atomic<std::uint32_t>, std::size_t{1} << kFilterBits> filter_{};
};

}  // namespace vram::detail
