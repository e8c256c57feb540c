// graph_routes.hpp: PyTorch's private memory pools (CUDA graphs, torch.cuda.MemPool) over a
// device's DevicePool.
//
// PyTorch names a pool by a MempoolId. torch.cuda.graph, make_graphed_callables and CUDA
// graph trees call beginAllocateToPool(device, id, filter) before allocating into it,
// endAllocateToPool(device, id) after, and releasePool(device, id) when the graph is reset;
// torch.cuda.MemPool calls createOrIncrefPool at construction and releasePool at its end,
// use_mem_pool begins and ends a route filtered by the calling thread. Rules:
// - Each begin and each retain opens a use of the pool, each release ends one (use_count);
//   a release of an id with no use open is counted and ignored.
// - Between begin and end, a request on a stream a route's filter accepts comes from that
//   route's pool. A pool over vram is a DevicePool graph pool (one unrouted capture scope
//   while routes of the pool are open): its blocks are reused only by requests routed into
//   the same pool, whatever stream frees them, and rejoin the shared tiers once no use is
//   open and none of them is live. A block freed on a stream being captured that a route
//   accepts becomes that pool's (captured work may use it at every launch); freed outside a
//   capture (use_mem_pool, a graph tree's warm-up) it goes back where it came from, as in
//   PyTorch.
// - A pool made with an allocator (MemPool(allocator=...)) is a ForeignPool
//   (foreign_pool.hpp): its blocks are cut from segments of that allocator and cached there
//   as PyTorch caches them; vram holds none of its memory. Its live blocks (and those held
//   back for recorded streams: stream_tracking.hpp) keep it and the allocator alive after
//   its last use; from then on release_unused_foreign() (empty_cache)
//   gives its free segments back, as PyTorch does only for pools without a use.
// Thread safety: a mutex for everything but active(), one relaxed load the warm path pays.
// Filters are PyTorch's (they ask the stream's capture id or the calling thread).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "live_blocks.hpp"
#include "vram/device_pool.hpp"

namespace vram_torch {

class GraphRoutes {
 public:
  using MempoolId = LiveBlock::PoolId;  // c10::MempoolId_t
  using Filter = std::function<bool(cudaStream_t)>;

  explicit GraphRoutes(vram::DevicePool& pool) noexcept : pool_(pool) {}
  GraphRoutes(const GraphRoutes&) = delete;
  GraphRoutes& operator=(const GraphRoutes&) = delete;

  // Opens a use of `id`, made at its first use; `foreign` (only when it is made): the pool
  // over the MemPool's own allocator. Throws what DevicePool throws, std::bad_alloc.
  void retain(MempoolId id, std::shared_ptr<ForeignPool> foreign = nullptr);
  // Opens a use of `id` and routes the requests `filter` accepts into it.
  void begin(MempoolId id, Filter filter);
  // Ends the oldest route of `id` (its use stays open until release).
  void end(MempoolId id) noexcept;
  void release(MempoolId id) noexcept;
  // Open uses of `id` (0 for an id never made or released).
  int use_count(MempoolId id) const;
  bool active() const noexcept { return active_.load(std::memory_order_relaxed) != 0; }

  struct Routed {
    void* ptr = nullptr;    // null: no route accepts the stream
    std::size_t bytes = 0;  // a foreign block's bytes
    MempoolId id{0, 0};
    std::shared_ptr<ForeignPool> foreign;  // set: the block is that pool's
  };
  // A block for a request on `stream` when a route accepts the stream. Throws what
  // DevicePool or the pool's allocator throws (out of memory: without a trim, which would
  // end a capture).
  Routed allocate(std::size_t bytes, cudaStream_t stream);
  // True when `stream` (the block's) may be being captured, a route over vram accepted it
  // and its pool took the block. A route's filter that accepts a stream captured on another
  // thread (a thread's route) takes it too: the first route that accepts wins.
  bool deallocate(void* block, std::size_t bytes, cudaStream_t stream) noexcept;
  // The free block at `block` of pool `id`, live again (a checkpoint restored); its bytes,
  // or 0 when it is no free block of that pool.
  std::size_t claim(MempoolId id, void* block) noexcept;
  // A block of vram pool `id` freed, `stream` the one it was allocated on (PyTorch's block
  // stream; deallocate notes the blocks it routes likewise): the stream a snapshot names
  // while the pool keeps the block free. Nothing for a pool with no use open, a foreign
  // pool, or without host memory.
  void note_free(MempoolId id, void* block, cudaStream_t stream) noexcept;
  struct FreeBlock {
    MempoolId id{0, 0};
    std::uintptr_t address = 0;
    std::size_t bytes = 0;
    cudaStream_t stream = nullptr;  // null: no free of it noted since the pool took it
  };
  // The free blocks the vram pools with a use open keep for their own next allocations (a
  // foreign pool lists its own), by address. Throws std::bad_alloc.
  std::vector<FreeBlock> free_blocks() const;
  // Releases of unknown ids.
  std::uint64_t invalid_releases() const;
  // Every foreign pool still alive (with a use, or live blocks).
  std::vector<std::shared_ptr<ForeignPool>> foreign_pools() const;
  // The bytes and segments the foreign pools alive hold.
  struct ForeignTotals {
    std::size_t bytes = 0;
    std::size_t segments = 0;
  };
  ForeignTotals foreign_totals() const;
  // Gives back the free segments of the foreign pools no use holds any more.
  void release_unused_foreign() noexcept;

 private:
  struct Route {
    MempoolId id;
    Filter filter;
  };
  struct Uses {
    vram::DevicePool::GraphPoolId pool = 0;
    std::shared_ptr<ForeignPool> foreign;
    std::size_t open = 0;       // uses: retains and begins not yet released
    std::size_t routes = 0;     // routes not yet ended
    std::size_t pool_uses = 0;  // graph uses of `pool` opened (each capture_into opens one)
    vram::DevicePool::CaptureScope scope;  // open while routes != 0 (vram pools)
    // The stream of each block noted at its free (note_free, deallocate): at most one entry
    // per address freed into the pool or under its routes while the entry lives, dropped
    // with the entry.
    std::unordered_map<std::uintptr_t, cudaStream_t> stream_of;
  };
  // A pool no use or route keeps: its graph uses, ended outside the mutex.
  struct Retired {
    vram::DevicePool::GraphPoolId id = 0;
    std::size_t uses = 0;
    std::shared_ptr<ForeignPool> foreign;  // dropped outside the mutex (it may give back)
    void release(vram::DevicePool& pool) noexcept;
  };
  // Under mutex_: erases the entry when no use or route is open.
  Retired retire_if_unused(std::map<MempoolId, Uses>::iterator it);
  // Under mutex_: the entry of `id`, made (with a graph pool) when absent.
  Uses& uses_of(MempoolId id, std::shared_ptr<ForeignPool> foreign);
  // Under mutex_: the route whose filter accepts `stream`, else null.
  Route* route_for(cudaStream_t stream);

  vram::DevicePool& pool_;
  mutable std::mutex mutex_;
  std::vector<Route> routes_;  // a handful at most
  std::map<MempoolId, Uses> uses_;
  std::vector<std::weak_ptr<ForeignPool>> foreign_;  // every foreign pool made, pruned
  std::uint64_t invalid_releases_ = 0;
  std::atomic<std::size_t> active_{0};
};

}  // namespace vram_torch
