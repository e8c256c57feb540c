// src/device_pool/graph_pools.hpp: graph-private pools, the memory captured CUDA graphs use.
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
// - P's use count is the number of open uses (a capture scope, a graph that keeps P);
//   retain() opens one, release() ends one. Once no use is open and none of P's blocks is
//   live, P's blocks wait in `pending` until the owner takes them (take_pending()) at a
//   moment when it may wait for the device: they rejoin the shared tiers (a sleep tag's
//   block: its tag) only after the graph's last launch has run. A pending block is still
//   known: its free is a double free.
// - adopt() and take() never make a pool: a pool with no open use takes no block.
// - A free of a block that is P's but not live (a double free) is refused and counted; the
//   block stays free in P.
// Thread safety: every call but may_own() takes one mutex (graph pools are touched while
// capturing and when their blocks are freed). may_own() is one relaxed load of a counting
// filter over the blocks' addresses: false means the block is no graph pool's, so frees of
// other blocks never take the mutex while graph pools exist. A block's slot is counted up
// before the block is handed out and down after it left every pool.
// `routing` (optional): its count (GraphRouting::add) raised by one for each pool that exists.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "graph_routing.hpp"

namespace vram::detail {

class GraphPools {
 public:
  explicit GraphPools(GraphRouting* routing = nullptr) noexcept : routing_(routing) {}
  using Id = std::uint64_t;
  struct Block {
    void* pointer = nullptr;
    std::size_t bytes = 0;
  };
  enum class Deallocation { not_ours, returned, double_free };
  struct Stats {
    std::size_t pools = 0;       // pools with a use open or memory held
    std::size_t held_bytes = 0;  // live and free bytes of every pool
    std::size_t live_bytes = 0;  // of which handed out
    std::size_t blocks = 0;      // blocks held
    std::uint64_t double_frees = 0;
  };

  // Uses of a pool: a graph's (released by release_graph_pool) or an open capture scope's
  // (released when it ends). A graph's release never ends a scope's use.
  enum class Use { graph, scope };
  // Opens a use of pool `id` (made at the first use).
  void retain(Id id, Use use = Use::graph);
  // Opens a use of pool `id` when it has none (made then); never after close().
  void retain_once(Id id);
  // Ends a use of pool `id`; false (counted as a double free, nothing changed) when the
  // pool has no open use of that kind.
  bool release(Id id, Use use = Use::graph);
  // A free block of pool `id` that serves `bytes` (best fit, at most a quarter larger) and
  // that `accept` accepts (none given: any), now live; a null block when there is none or
  // the pool has no open use. `accept` runs under the pool's mutex.
  Block take(Id id, std::size_t bytes, const std::function<bool(const void*)>& accept = {});
  // Makes `block`, just taken from the shared tiers (or freed under a scope), a live block
  // of pool `id`. False, nothing changed, when the pool has no open use or already knows
  // the block.
  bool adopt(Id id, Block block);
  // A freed block: back to its pool when it is a graph pool's.
  Deallocation deallocate(void* pointer);
  // The free block at `pointer` of pool `id`, live again (a checkpoint of the pool's live
  // blocks restored); its bytes, or 0 (nothing changed) when it is no free block of `id`.
  std::size_t claim(Id id, const void* pointer);
  // The free blocks of pool `id` by address (none for a pool that does not exist): what its
  // next allocations may take. Throws std::bad_alloc.
  std::vector<Block> free_blocks(Id id) const;
  // The blocks of pools that no longer hold them (see the rules), for the shared tiers.
  std::vector<Block> take_pending();
  // Blocks take_pending() gave that cannot rejoin the shared tiers yet (the device could not
  // be synchronized): pending again (without host memory for that: kept out of every tier).
  void restore_pending(std::vector<Block> blocks) noexcept;
  // The owner closes: every use ends and every free block becomes pending; live blocks stay
  // their pool's until freed, and then become pending.
  void close();
  bool closed() const noexcept { return closed_.load(std::memory_order_acquire); }
  // The bytes of a live block of a graph pool as recorded at adopt(); 0 when the pointer is
  // no live graph block.
  std::size_t live_bytes_of(const void* pointer) const;
  // True when no graph pool holds memory or has a use open (pending blocks aside).
  bool empty() const {
    std::lock_guard lock(mutex_);
    return by_id_.empty();
  }
  bool may_own(const void* pointer) const noexcept {
    return filter_[slot_of(pointer)].load(std::memory_order_relaxed) != 0;
  }
  Stats stats() const;

 private:
  struct Pool {
    std::size_t uses = 0;
    std::size_t scope_uses = 0;  // of `uses`
    std::size_t live_blocks = 0;
    std::size_t held_bytes = 0;
    std::size_t live_bytes = 0;
    std::multimap<std::size_t, void*> free;  // bytes -> block
  };
  static constexpr Id kPending = 0;  // Owner::pool of a pending block (no pool's id is 0)
  struct Owner {
    Id pool = 0;
    std::size_t bytes = 0;
    bool live = false;
  };
  // Under mutex_: the pool's blocks become pending if it has no use and nothing live; erases
  // it.
  void retire_if_unused(Id id);
  // Under mutex_: the pool's free blocks become pending (reserves first: may throw before
  // anything changed).
  void free_to_pending(Pool& pool);
  // Under mutex_: keeps counted_pools_ and the routing's count in step with by_id_.
  void note_pools() noexcept;
  static std::size_t slot_of(const void* pointer) noexcept {
    const auto bits = reinterpret_cast<std::uintptr_t>(pointer) >> 8;  // blocks: 256-aligned
    return static_cast<std::size_t>((bits * 0x9E3779B97F4A7C15ULL) >> (64 - kFilterBits));
  }
  static constexpr unsigned kFilterBits = 14;

  mutable std::mutex mutex_;
  std::unordered_map<Id, Pool> by_id_;
  std::unordered_map<const void*, Owner> owner_;
  std::size_t counted_pools_ = 0;  // by_id_.size() as last told to routing_
  GraphRouting* routing_;
  std::uint64_t double_frees_ = 0;
  std::vector<Block> pending_;
  std::atomic<bool> closed_{false};
  std::size_t pending_bytes_ = 0;
  std::array<std::atomic<std::uint32_t>, std::size_t{1} << kFilterBits> filter_{};
};

}  // namespace vram::detail
