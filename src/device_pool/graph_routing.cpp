// DevicePool's graph routing (graph_routing.hpp): the capture routes, then requests and
// deallocations routed by them to graph-private pools (graph_pools.hpp), and their memory back
// to the shared tiers once a pool is done.
//
// Rules:
// - A graph pool draws from the shared tiers only blocks free for every stream (kUntagged):
//   a block still free only on some stream S could be in use by S's queued work when a
//   launch of the graph, on any stream, reaches it.
// - Growing while a capture is open runs in relaxed capture mode: the capturing thread's
//   own mode would refuse the driver allocation and invalidate its capture.
// - Blocks a graph pool gave up rejoin the shared tiers (a sleep tag's block: its tag) only
//   in drain_graph_returns(), after a device synchronize (a launch of the graph may still
//   run), and only while no capture scope is open (a synchronize during a capture
//   invalidates it): on release_graph_pool, a scope's end, trim, sleep, wake and
//   destruction, never inside a deallocation. A sleeping tag's blocks wait for its wake.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <optional>
#include <thread>
#include <utility>

#include "cuda/capture.hpp"
#include "graph_routing.hpp"
#include "pool_core.hpp"
#include "vram/cuda/error.hpp"

namespace vram::detail {

bool GraphRouting::insert(const Route& route) {
  std::lock_guard lock(mutex_);
  const bool taken = std::any_of(routes_.begin(), routes_.end(), [&](const Route& r) {
    return r.pool == route.pool || (route.key != kNoStream && r.key == route.key) ||
           (route.thread != std::thread::id{} && r.thread == route.thread);
  });
  if (taken) return false;
  routes_.push_back(route);
  open_.store(routes_.size(), std::memory_order_relaxed);
  add(1);
  return true;
}

bool GraphRouting::open(PoolId pool, StreamKey key, cudaStream_t stream, std::thread::id thread) {
  return insert({pool, key, stream, thread});
}

bool GraphRouting::open_unrouted(PoolId pool) {
  return insert({pool, kNoStream, nullptr, std::thread::id{}});
}

bool GraphRouting::close(PoolId pool) {
  std::lock_guard lock(mutex_);
  const auto it =
      std::find_if(routes_.begin(), routes_.end(), [&](const Route& r) { return r.pool == pool; });
  if (it == routes_.end()) return false;
  routes_.erase(it);
  open_.store(routes_.size(), std::memory_order_relaxed);
  add(-1);
  return true;
}

std::optional<GraphRouting::PoolId> GraphRouting::for_stream(StreamKey key) const {
  if (!any()) return std::nullopt;
  std::lock_guard lock(mutex_);
  for (const Route& r : routes_) {
    if (r.key != kNoStream && r.key == key) return r.pool;
  }
  return std::nullopt;
}

std::optional<GraphRouting::PoolId> GraphRouting::for_thread(std::thread::id thread) const {
  if (!any()) return std::nullopt;
  std::lock_guard lock(mutex_);
  for (const Route& r : routes_) {
    if (r.thread != std::thread::id{} && r.thread == thread) return r.pool;
  }
  return std::nullopt;
}

std::optional<GraphPools::Id> DevicePoolCore::graph_route(StreamKey key,
                                                          cudaStream_t stream) noexcept {
  try {
    if (key == kUntagged) return graph_routing.for_thread(std::this_thread::get_id());
    if (auto id = graph_routing.for_stream(key)) return id;
    // While a scope is open, a stream forked into its capture is found by the capture's id,
    // whatever kWatchCaptures says: the query is paid only while scopes are open.
    const bool legacy = stream == nullptr || stream == cudaStreamLegacy;
    const std::uint64_t capture =
        graph_routing.any() && !legacy ? fence->capture_of(stream) : capture_of(stream);
    if (capture == 0) return std::nullopt;
    if (auto id = graph_routing.for_capture(
            capture, [this](cudaStream_t s) { return fence->capture_of(s); })) {
      return id;
    }
    // A capture no scope names: its own pool, with detection on (else the ordinary rules).
    if (!watch_captures()) return std::nullopt;
    return unscoped_pool_of(capture);
  } catch (...) {  // out of host memory in a lookup: the ordinary rules
    return std::nullopt;
  }
}

void* DevicePoolCore::allocate_with_graphs(std::size_t bytes, std::size_t alignment, StreamKey key,
                                           cudaStream_t stream) {
  if (Tag* tag = sleep_tags.any() ? sleep_tags.route() : nullptr) [[unlikely]] {
    const auto id = graph_route(key, stream);
    if (!id) return tag_allocate(*tag, bytes, alignment, key);
    if (is_unscoped_pool(*id)) retain_unscoped(*id);
    return graph_tag_allocate(*tag, bytes, alignment, key, *id);
  }
  const auto id = graph_route(key, stream);
  if (!id) return allocate(bytes, alignment, key);
  if (is_unscoped_pool(*id)) return allocate_captured(bytes, alignment, *id);
  return graph_allocate_into(*id, bytes, alignment);
}

void DevicePoolCore::deallocate_with_graphs(void* block, std::size_t bytes, StreamKey key,
                                            cudaStream_t stream) noexcept {
  if (Tag* tag = sleep_tags.any() ? sleep_tags.owner_of(block) : nullptr) [[unlikely]] {
    // A graph's block, or freed by a capture: the graph's launches write it, so it stays its
    // graph pool's until the pool gives it up (pool_core.hpp).
    return deallocate_tagged(*tag, block, bytes, key, graph_route(key, stream));
  }
  // A graph pool's block goes back to its pool whatever the stream.
  if (graph_deallocate_owned(block)) return;
  const auto id = graph_route(key, stream);
  if (id && is_unscoped_pool(*id)) return deallocate_captured(block, bytes, *id);
  if (!id || !graph_adopt_freed(*id, block, block_bytes(bytes))) deallocate(block, bytes, key);
}

void DevicePoolCore::retain_unscoped(GraphPools::Id id) {
  graph_pools.retain_once(id);  // the pool's own use, for the life of the pool
  unscoped_capture_calls.fetch_add(1, std::memory_order_relaxed);
}

void* DevicePoolCore::allocate_captured(std::size_t bytes, std::size_t alignment,
                                        GraphPools::Id id) {
  retain_unscoped(id);
  return graph_allocate_into(id, bytes, alignment);
}

void DevicePoolCore::deallocate_captured(void* block, std::size_t bytes,
                                         GraphPools::Id id) noexcept {
  if (block == nullptr) return;
  try {
    retain_unscoped(id);
  } catch (...) {
    return;  // no host memory for the bookkeeping: the block stays out of every tier
  }
  if (!graph_deallocate_into(id, block, bytes)) deallocate(block, bytes, kUntagged);
}

void* DevicePoolCore::graph_allocate_into(GraphPools::Id id, std::size_t bytes,
                                          std::size_t alignment) {
  const bool valid =
      bytes != 0 && alignment - 1 < kMaxAlignment && (alignment & (alignment - 1)) == 0;
  if (valid) {
    // A tag's free block serves only that tag's requests (graph_tag_allocate).
    std::function<bool(const void*)> untagged;
    if (sleep_tags.any())
      untagged = [this](const void* p) { return sleep_tags.owner_of(p) == nullptr; };
    if (const GraphPools::Block reused = graph_pools.take(id, bytes, untagged);
        reused.pointer != nullptr) {
      return reused.pointer;
    }
  }
  std::optional<cuda::RelaxedCaptureMode> relaxed;  // host upstreams have no capture
  if (upstream->kind() == MemoryKind::device) relaxed.emplace();
  const bool was_in_capture = std::exchange(tl_in_capture, true);
  void* block = nullptr;
  try {
    block = allocate(bytes, alignment, kUntagged);  // throws for bad requests, as ever
  } catch (...) {
    tl_in_capture = was_in_capture;
    throw;
  }
  tl_in_capture = was_in_capture;
  relaxed.reset();
  try {
    if (graph_pools.adopt(id, {block, block_bytes(bytes)})) return block;
  } catch (...) {
    deallocate(block, bytes, kUntagged);
    throw;
  }
  return block;  // the pool lost its last use meanwhile: an ordinary block
}

bool DevicePoolCore::graph_deallocate_owned(void* block) noexcept {
  if (block == nullptr) return true;
  if (!graph_pools.may_own(block)) return false;  // no mutex: the filter says no graph block
  // The block is leased until deallocate() files it pending, so the core is alive here; once
  // it is pending another thread's drain may deallocate it, and with it the pool's last lease
  // (pool_core.hpp, Lifetime): this call keeps the core alive until it returns.
  const std::shared_ptr<DevicePoolCore> pin = weak_from_this().lock();
  try {
    switch (graph_pools.deallocate(block)) {
      case GraphPools::Deallocation::returned:
        // After the owner's destruction nothing else drains: a live block's return does.
        if (graph_pools.closed()) drain_graph_returns();
        return true;
      case GraphPools::Deallocation::double_free:
        reject_deallocate(block, 0, "a free block of a graph pool, deallocated already");
        return true;
      case GraphPools::Deallocation::not_ours:
        return false;
    }
  } catch (...) {
    // Out of host memory for the bookkeeping: the block stays out of every tier (leaked),
    // which is safe; handing it out again would not be.
    return true;
  }
  return false;
}

bool DevicePoolCore::graph_adopt_freed(GraphPools::Id id, void* block,
                                       std::size_t held_bytes) noexcept {
  const std::shared_ptr<DevicePoolCore> pin = weak_from_this().lock();  // as graph_deallocate_owned
  try {
    // Freed during a capture: captured work may use it at every launch. It becomes a free
    // block of the capture's pool (refused when the pool has no use: then the ordinary path).
    if (!graph_pools.adopt(id, {block, held_bytes})) return false;
    return graph_pools.deallocate(block) == GraphPools::Deallocation::returned;
  } catch (...) {
    return true;  // as in graph_deallocate_owned: kept out of every tier
  }
}

bool DevicePoolCore::graph_deallocate_into(std::optional<GraphPools::Id> id, void* block,
                                           std::size_t bytes) noexcept {
  if (graph_deallocate_owned(block)) return true;
  return id && graph_adopt_freed(*id, block, block_bytes(bytes));
}

std::vector<GraphPools::Block> DevicePoolCore::take_graph_returns() noexcept {
  if (graph_routing.any() || tl_in_capture) return {};  // a synchronize would invalidate it
  std::vector<GraphPools::Block> blocks;
  try {
    blocks = graph_pools.take_pending();
  } catch (...) {
    return {};
  }
  // Blocks of sleeping tags wait, pending, for the drain of their wake: no synchronize for
  // them.
  if (sleep_tags.any() && !blocks.empty()) {
    std::vector<GraphPools::Block> asleep;
    std::erase_if(blocks, [&](const GraphPools::Block& block) {
      Tag* tag = sleep_tags.owner_of(block.pointer);
      if (tag == nullptr || !SleepTags::asleep(*tag)) return false;
      keep_pending(asleep, block);
      return true;
    });
    if (!asleep.empty()) graph_pools.restore_pending(std::move(asleep));
  }
  // Only after the graph's last launch has run: a synchronize that failed (another thread's
  // capture refused it, the driver shut down) leaves them pending.
  if (!blocks.empty() && !fence->try_quiesce()) {
    graph_pools.restore_pending(std::move(blocks));
    return {};
  }
  return blocks;
}

void DevicePoolCore::drain_graph_returns() noexcept {
  std::vector<GraphPools::Block> asleep;  // of sleeping tags: pending until a drain after wake
  for (const GraphPools::Block& block : take_graph_returns()) {
    if (Tag* tag = sleep_tags.any() ? sleep_tags.owner_of(block.pointer) : nullptr) {
      if (!return_to_tag(*tag, block)) keep_pending(asleep, block);
      continue;
    }
    deallocate(block.pointer, deallocate_size_of(block), kUntagged);
  }
  if (!asleep.empty()) graph_pools.restore_pending(std::move(asleep));
}

void DevicePoolCore::keep_pending(std::vector<GraphPools::Block>& blocks,
                                  const GraphPools::Block& block) noexcept {
  try {
    blocks.push_back(block);
  } catch (...) {  // no host memory: the block stays out of every tier (leaked), safe
  }
}

std::size_t DevicePoolCore::deallocate_size_of(const GraphPools::Block& block) noexcept {
  // A small class's block bytes may pass small_max (a small_max between two classes): such
  // a block of the small tier is deallocated as the largest small request, which has its class.
  return block.bytes > small_max && small.owns(block.pointer) ? small_max : block.bytes;
}

void DevicePoolCore::reclaim_graph_returns(ThreadCache* claimed) noexcept {
  // Tagged blocks stay pending: they free nothing a tier could grow into, and their return
  // takes the slow path's lock, which the caller may hold (claimed == null).
  std::vector<GraphPools::Block> tagged;
  for (const GraphPools::Block& block : take_graph_returns()) {
    if (sleep_tags.any() && sleep_tags.owner_of(block.pointer) != nullptr) {
      keep_pending(tagged, block);
      continue;
    }
    // block.bytes: block_bytes() of the request, what its acquire counted.
    const Request request = request_of(deallocate_size_of(block), kUntagged);
    const bool known = free_block(*request.tier, block.pointer, kUntagged, block.bytes, claimed,
                                  claimed != nullptr);
    if (!known) {
      reject_deallocate(block.pointer, block.bytes, "a graph pool's block the tiers do not know");
      continue;
    }
    if (options.validate_deallocations) {
      validation.forget(block.pointer);
    }
    if (claimed != nullptr) {
      bump(claimed->deallocations, 1);
      bump(claimed->deallocated_bytes, block.bytes);
    } else {
      slow_path.count_deallocation(block.bytes);
    }
    if (options.track_peak_in_use) note_in_use(-static_cast<std::int64_t>(block.bytes));
  }
  if (!tagged.empty()) graph_pools.restore_pending(std::move(tagged));
}

}  // namespace vram::detail

namespace vram {

DevicePool::CaptureScope::CaptureScope(std::shared_ptr<detail::DevicePoolCore> core,
                                       GraphPoolId pool) noexcept
    : core_(std::move(core)), pool_(pool) {}

DevicePool::CaptureScope::CaptureScope(CaptureScope&& other) noexcept
    : core_(std::move(other.core_)), ended_(std::move(other.ended_)), pool_(other.pool_) {}

DevicePool::CaptureScope& DevicePool::CaptureScope::operator=(CaptureScope&& other) noexcept {
  if (this != &other) {
    end();
    core_ = std::move(other.core_);
    ended_ = std::move(other.ended_);
    pool_ = other.pool_;
  }
  return *this;
}

void DevicePool::CaptureScope::end() noexcept {
  if (!core_) return;
  // Kept alive until the end of this call (the drain may deallocate the last lease of a
  // destroyed pool); from then on only watched.
  const std::shared_ptr<detail::DevicePoolCore> core = std::move(core_);
  ended_ = core;
  // The scope's own use; the graph's stays (after the pool's destruction: none is left).
  if (core->graph_routing.close(pool_) && !core->graph_pools.closed()) {
    (void)core->graph_pools.release(pool_, detail::GraphPools::Use::scope);
  }
  // Memory graph pools gave up waits for a moment with no scope open (graph_routing.cpp):
  // this may be one. After the pool's destruction it is the last: the drain deallocates the
  // pool's leases.
  core->drain_graph_returns();
}

void* DevicePool::CaptureScope::allocate(std::size_t bytes) {
  if (!core_) {
    throw InvalidArgument(
        "vram::DevicePool::CaptureScope::allocate: the scope has ended (or was moved from). "
        "Fix: allocate while the scope is open.");
  }
  if (core_->graph_pools.closed()) {
    throw InvalidArgument(
        "vram::DevicePool::CaptureScope::allocate: the pool was destroyed while the scope was "
        "open. Fix: end the scope (and the capture) before the DevicePool is destroyed.");
  }
  // Inside a tag scope the block is the tag's (it sleeps with it) and the graph's.
  if (detail::Tag* tag = core_->sleep_tags.any() ? core_->sleep_tags.route() : nullptr) {
    return core_->graph_tag_allocate(*tag, bytes, kDefaultAlignment, detail::kUntagged, pool_);
  }
  return core_->graph_allocate_into(pool_, bytes, kDefaultAlignment);
}

void DevicePool::CaptureScope::deallocate(void* block, std::size_t bytes) noexcept {
  if (block == nullptr) return;
  if (core_) {
    // A tagged block: back to its graph pool, or this pool's (pool_core.hpp).
    if (detail::Tag* tag = core_->sleep_tags.any() ? core_->sleep_tags.owner_of(block) : nullptr) {
      return core_->deallocate_tagged(*tag, block, bytes, detail::kUntagged, pool_);
    }
    if (core_->graph_deallocate_into(pool_, block, bytes)) return;
    return core_->deallocate(block, bytes, detail::kUntagged);
  }
  // Ended: an ordinary deallocation, as DevicePool::deallocate makes it.
  if (const std::shared_ptr<detail::DevicePoolCore> core = ended_.lock()) {
    return core->deallocate_unstreamed(block, bytes);
  }
  std::fprintf(stderr,
               "vram::DevicePool::CaptureScope::deallocate: %p was not deallocated: the scope "
               "names no live pool (moved from, never opened, or ended with its pool destroyed "
               "and every block of it deallocated already). Fix: deallocate it through the "
               "DevicePool or the scope it was moved to.\n",
               block);
}

DevicePool::GraphPoolId DevicePool::new_graph_pool() noexcept {
  static std::atomic<GraphPoolId> next{0};
  return (GraphPoolId{1} << 63) | (next.fetch_add(1, std::memory_order_relaxed) + 1);
}

DevicePool::CaptureScope DevicePool::open_scope(GraphPoolId graph_pool, cudaStream_t stream,
                                                bool routed) {
  detail::DevicePoolCore& core = live_core("capture_into");
  if (routed && (stream == nullptr || stream == cudaStreamLegacy)) {
    throw InvalidArgument(
        "vram::DevicePool::capture_into: the legacy default stream cannot be captured. Fix: "
        "capture a stream you created (cudaStreamNonBlocking) or cudaStreamPerThread.");
  }
  if (detail::DevicePoolCore::is_unscoped_pool(graph_pool)) {
    throw InvalidArgument(
        "vram::DevicePool::capture_into: graph pool ids with bit 62 set and bit 63 clear name "
        "the pools of unscoped captures. Fix: take ids from new_graph_pool().");
  }
  // Two uses: the scope's (ended by end()) and the graph's (ended by release_graph_pool).
  core.graph_pools.retain(graph_pool, detail::GraphPools::Use::scope);
  core.graph_pools.retain(graph_pool);
  bool opened = false;
  try {
    opened = routed ? core.graph_routing.open(graph_pool, detail::stream_key(stream), stream,
                                              std::this_thread::get_id())
                    : core.graph_routing.open_unrouted(graph_pool);
  } catch (...) {
  }
  if (!opened) {
    (void)core.graph_pools.release(graph_pool, detail::GraphPools::Use::scope);
    (void)core.graph_pools.release(graph_pool);
    throw InvalidArgument(
        "vram::DevicePool::capture_into: the stream, the calling thread or the graph pool "
        "already has an open capture scope. Fix: end() the open scope first (CUDA captures a "
        "stream once at a time; a thread opens one scope at a time; captures into one pool "
        "follow each other).");
  }
  return CaptureScope(core_, graph_pool);
}

DevicePool::CaptureScope DevicePool::capture_into(GraphPoolId graph_pool, cudaStream_t stream) {
  return open_scope(graph_pool, stream, true);
}

DevicePool::CaptureScope DevicePool::capture_into(GraphPoolId graph_pool) {
  return open_scope(graph_pool, nullptr, false);
}

std::size_t DevicePool::claim_graph_block(GraphPoolId graph_pool, void* block) noexcept {
  if (!core_ || block == nullptr) return 0;
  try {
    return core_->graph_pools.claim(graph_pool, block);
  } catch (...) {
    return 0;
  }
}

std::vector<DevicePool::GraphPoolBlock> DevicePool::graph_pool_free_blocks(
    GraphPoolId graph_pool) const {
  std::vector<GraphPoolBlock> blocks;
  if (!core_) return blocks;
  for (const detail::GraphPools::Block& block : core_->graph_pools.free_blocks(graph_pool)) {
    blocks.push_back({block.pointer, block.bytes});
  }
  return blocks;
}

void DevicePool::release_graph_pool(GraphPoolId graph_pool) noexcept {
  if (!core_) return;
  try {
    if (!core_->graph_pools.release(graph_pool)) {  // the graph's use only, never a scope's
      core_->validation.count_rejected();
      std::fprintf(stderr,
                   "vram::DevicePool::release_graph_pool(%llu): refused, the pool has no graph "
                   "use open (released already, or never captured into). Fix: release each "
                   "graph pool once per capture_into, after its graphs are destroyed.\n",
                   static_cast<unsigned long long>(graph_pool));
    }
  } catch (...) {  // out of host memory: the pool keeps its memory
  }
  core_->drain_graph_returns();
}

}  // namespace vram
