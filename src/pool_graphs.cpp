// DevicePool's graph pools: requests and releases routed by capture scopes
// (capture_routes.hpp) to graph-private pools (graph_pools.hpp), and their memory back to
// the shared tiers once a pool is done.
//
// Rules:
// - A graph pool draws from the shared tiers only blocks free for every stream (kUntagged):
//   a block still free only on some stream S could be in use by S's queued work when a
//   launch of the graph, on any stream, reaches it.
// - Growing while a capture is open runs in relaxed capture mode: the capturing thread's
//   own mode would refuse the driver allocation and invalidate its capture.
// - Returned blocks wait for the device (fence->quiesce()) first: a launch of the graph may
//   still be running.
#include <algorithm>
#include <atomic>
#include <thread>

#include "cuda/capture.hpp"
#include "pool_core.hpp"
#include "vram/cuda/error.hpp"

namespace vram::detail {
namespace {

std::optional<GraphPools::Id> route_of(const CaptureRoutes& routes, StreamKey key) {
  return key == kUntagged ? routes.for_thread(std::this_thread::get_id()) : routes.for_stream(key);
}

}  // namespace

void* DevicePoolCore::allocate_with_graphs(std::size_t bytes, std::size_t alignment,
                                           StreamKey key) {
  if (void* block = graph_allocate_routed(bytes, alignment, key)) return block;
  return allocate(bytes, alignment, key);
}

void DevicePoolCore::deallocate_with_graphs(void* block, std::size_t bytes,
                                            StreamKey key) noexcept {
  if (!graph_deallocate_routed(block, bytes, key)) deallocate(block, bytes, key);
}

void* DevicePoolCore::graph_allocate_routed(std::size_t bytes, std::size_t alignment,
                                            StreamKey key) {
  const auto id = route_of(capture_routes, key);
  if (!id) return nullptr;
  const bool valid =
      bytes != 0 && alignment - 1 < kMaxAlignment && (alignment & (alignment - 1)) == 0;
  if (valid) {
    if (const GraphPools::Block reused = graph_pools.take(*id, bytes); reused.pointer != nullptr) {
      return reused.pointer;
    }
  }
  void* block = nullptr;
  if (upstream->kind() == MemoryKind::device) {
    const cuda::RelaxedCaptureMode relaxed;
    block = allocate(bytes, alignment, kUntagged);  // throws for bad requests, as ever
  } else {
    block = allocate(bytes, alignment, kUntagged);
  }
  try {
    graph_pools.adopt(*id, {block, bytes});
  } catch (...) {
    deallocate(block, bytes, kUntagged);
    throw;
  }
  return block;
}

bool DevicePoolCore::graph_deallocate_routed(void* block, std::size_t bytes,
                                             StreamKey key) noexcept {
  if (block == nullptr) return true;
  if (!capture_routes.any() && !graph_pools.may_own(block)) return false;  // no mutex taken
  std::vector<GraphPools::Block> to_shared;
  try {
    GraphPools::Release result = graph_pools.give_back(block, to_shared);
    if (result == GraphPools::Release::not_ours) {
      const auto id = route_of(capture_routes, key);
      if (!id) return false;
      // Freed under a scope: captured work may use it at every launch. It becomes a free
      // block of the scope's pool.
      graph_pools.adopt(*id, {block, bytes});
      result = graph_pools.give_back(block, to_shared);
    }
    if (result == GraphPools::Release::double_free) {
      invalid_releases.fetch_add(1, std::memory_order_relaxed);
    }
  } catch (...) {
    // Out of host memory for the bookkeeping: the block stays out of every tier (leaked),
    // which is safe; handing it out again would not be.
    return true;
  }
  return_graph_blocks(to_shared);
  return true;
}

void DevicePoolCore::return_graph_blocks(const std::vector<GraphPools::Block>& blocks) noexcept {
  if (blocks.empty()) return;
  fence->quiesce();
  for (const GraphPools::Block& block : blocks) deallocate(block.pointer, block.bytes, kUntagged);
}

}  // namespace vram::detail

namespace vram {

DevicePool::CaptureScope::CaptureScope(std::shared_ptr<detail::DevicePoolCore> core,
                                       std::uintptr_t stream, std::thread::id thread) noexcept
    : core_(std::move(core)), stream_(stream), thread_(thread) {}

DevicePool::CaptureScope::CaptureScope(CaptureScope&& other) noexcept
    : core_(std::move(other.core_)), stream_(other.stream_), thread_(other.thread_) {}

DevicePool::CaptureScope& DevicePool::CaptureScope::operator=(CaptureScope&& other) noexcept {
  if (this != &other) {
    end();
    core_ = std::move(other.core_);
    stream_ = other.stream_;
    thread_ = other.thread_;
  }
  return *this;
}

void DevicePool::CaptureScope::end() noexcept {
  if (!core_) return;
  (void)core_->capture_routes.close(stream_, thread_);
  core_.reset();
}

DevicePool::GraphPoolId DevicePool::new_graph_pool() noexcept {
  static std::atomic<GraphPoolId> next{0};
  return (GraphPoolId{1} << 63) | (next.fetch_add(1, std::memory_order_relaxed) + 1);
}

DevicePool::CaptureScope DevicePool::capture_into(GraphPoolId graph_pool, cudaStream_t stream) {
  detail::DevicePoolCore& core = live_core("capture_into");
  const detail::StreamKey key = detail::stream_key(stream);
  const std::thread::id thread = std::this_thread::get_id();
  core.graph_pools.retain(graph_pool);
  if (!core.capture_routes.open(graph_pool, key, thread)) {
    core.return_graph_blocks(core.graph_pools.release(graph_pool));
    throw InvalidArgument(
        "vram::DevicePool::capture_into: the stream or the calling thread already has a "
        "capture scope. Fix: end() the open scope first (CUDA captures a stream once at a "
        "time; a thread opens one scope at a time).");
  }
  return CaptureScope(core_, key, thread);
}

void DevicePool::release_graph_pool(GraphPoolId graph_pool) noexcept {
  if (!core_) return;
  try {
    bool refused = false;
    const auto blocks = core_->graph_pools.release(graph_pool, &refused);
    if (refused) core_->invalid_releases.fetch_add(1, std::memory_order_relaxed);
    core_->return_graph_blocks(blocks);
  } catch (...) {  // out of host memory: the pool keeps its memory
  }
}

}  // namespace vram
