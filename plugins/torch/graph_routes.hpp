// graph_routes.hpp: PyTorch's CUDA graph captures over a device's DevicePool.
//
// torch.cuda.graph (and make_graphed_callables, torch.cuda.MemPool) tell the allocator
// beginAllocateToPool(device, id, filter) before a capture, endAllocateToPool(device, id)
// after it and releasePool(device, id) when the graph is reset or destroyed; `pool=` passes
// one id to several graphs. Rules (PyTorch's private pools, on vram's graph pools):
// - Between begin and end, a request on a stream the filter accepts comes from the graph
//   pool of `id` (an unrouted DevicePool capture scope), and a block freed on such a stream
//   becomes that pool's: captured work may use it at every launch.
// - A block of a graph pool goes back to its pool whatever stream frees it, during or after
//   the capture (DevicePool does this by itself).
// - Every begin opens a use of the pool, every release ends one; once none is open and
//   nothing of it is live, its memory rejoins the pool's shared tiers (DevicePool's
//   release_graph_pool). A release of an id with no use open is counted and ignored.
// Thread safety: a mutex for everything but active(), one relaxed load the warm path pays.
// Filters are PyTorch's (they ask the stream's capture id, a driver query that is allowed
// during any capture).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "vram/device_pool.hpp"

namespace vram_torch {

class GraphRoutes {
 public:
  using MempoolId = std::pair<std::uint64_t, std::uint64_t>;  // c10::cuda::MempoolId_t
  using Filter = std::function<bool(cudaStream_t)>;

  explicit GraphRoutes(vram::DevicePool& pool) noexcept : pool_(pool) {}
  GraphRoutes(const GraphRoutes&) = delete;
  GraphRoutes& operator=(const GraphRoutes&) = delete;

  // Throws vram::InvalidArgument when `id` already has a capture in progress.
  void begin(MempoolId id, Filter filter);
  void end(MempoolId id) noexcept;
  void release(MempoolId id) noexcept;
  bool active() const noexcept { return active_.load(std::memory_order_relaxed) != 0; }
  // A block for a request on `stream` when a route accepts the stream; null otherwise.
  // Throws what DevicePool throws (out of memory: without a trim, which would end the capture).
  void* allocate(std::size_t bytes, cudaStream_t stream);
  // True when a route accepted the stream and its pool took the block.
  bool deallocate(void* block, std::size_t bytes, cudaStream_t stream) noexcept;
  // Releases of unknown ids.
  std::uint64_t invalid_releases() const;

 private:
  struct Route {
    MempoolId id;
    Filter filter;
    vram::DevicePool::CaptureScope scope;
  };
  struct Uses {
    vram::DevicePool::GraphPoolId pool = 0;
    std::size_t open = 0;
  };
  // Under mutex_: the route whose filter accepts `stream`, else null.
  Route* route_for(cudaStream_t stream);

  vram::DevicePool& pool_;
  mutable std::mutex mutex_;
  std::vector<Route> routes_;  // captures in progress: a handful at most
  std::map<MempoolId, Uses> uses_;
  std::uint64_t invalid_releases_ = 0;
  std::atomic<std::size_t> active_{0};
};

}  // namespace vram_torch
