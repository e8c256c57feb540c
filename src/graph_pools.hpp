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
// Thread safety: every call takes one mutex (graph pools are touched while capturing and
// when their blocks are freed, not on the pool's warm path); empty() is a relaxed load, so
// a pool with no graph pool pays one load per free.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace vram::detail {

class GraphPools {
 public:
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

  mutable std::mutex mutex_;
  std::unordered_map<Id, Pool> by_id_;
  std::unordered_map<const void*, Owner> owner_;
  std::atomic<std::size_t> pools_{0};
  std::uint64_t double_frees_ = 0;
};

}  // namespace vram::detail
