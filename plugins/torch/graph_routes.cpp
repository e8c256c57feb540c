#include "graph_routes.hpp"

#include <algorithm>
#include <exception>

#include "cuda/capture.hpp"

namespace vram_torch {

GraphRoutes::Uses& GraphRoutes::uses_of(MempoolId id, std::shared_ptr<ForeignPool> foreign) {
  auto [it, made] = uses_.try_emplace(id);
  if (made) {
    if (foreign) {
      std::erase_if(foreign_, [](const std::weak_ptr<ForeignPool>& p) { return p.expired(); });
      try {
        foreign_.push_back(foreign);
      } catch (...) {
        uses_.erase(it);
        throw;
      }
      it->second.foreign = std::move(foreign);
    } else {
      it->second.pool = vram::DevicePool::new_graph_pool();
    }
  }
  return it->second;
}

void GraphRoutes::retain(MempoolId id, std::shared_ptr<ForeignPool> foreign) {
  std::lock_guard lock(mutex_);
  const bool existed = uses_.count(id) != 0;
  Uses& uses = uses_of(id, std::move(foreign));
  if (!uses.foreign && uses.pool_uses == 0) {
    try {
      // Opens the graph pool's use (ended at the last release); the scope itself ends now.
      pool_.capture_into(uses.pool).end();
    } catch (...) {
      if (!existed) uses_.erase(id);
      throw;
    }
    ++uses.pool_uses;
  }
  ++uses.open;
}

void GraphRoutes::begin(MempoolId id, Filter filter) {
  std::lock_guard lock(mutex_);
  const bool existed = uses_.count(id) != 0;
  Uses& uses = uses_of(id, nullptr);
  try {
    routes_.reserve(routes_.size() + 1);
    if (!uses.foreign && uses.routes == 0) {
      uses.scope = pool_.capture_into(uses.pool);  // opens a graph use and the scope's
      ++uses.pool_uses;
    }
  } catch (...) {
    if (!existed) uses_.erase(id);
    throw;
  }
  routes_.push_back({id, std::move(filter)});
  ++uses.routes;
  ++uses.open;
  active_.store(routes_.size(), std::memory_order_relaxed);
}

void GraphRoutes::end(MempoolId id) noexcept {
  vram::DevicePool::CaptureScope ending;
  Retired retired;
  {
    std::lock_guard lock(mutex_);
    const auto it =
        std::find_if(routes_.begin(), routes_.end(), [&](const Route& r) { return r.id == id; });
    if (it == routes_.end()) return;
    routes_.erase(it);
    active_.store(routes_.size(), std::memory_order_relaxed);
    const auto found = uses_.find(id);
    if (found != uses_.end() && --found->second.routes == 0) {
      ending = std::move(found->second.scope);
      retired = retire_if_unused(found);
    }
  }
  // Outside the mutex: the end of the last open scope, and the release of the pool, may
  // synchronize the device to return graph memory given up meanwhile.
  ending.end();
  retired.release(pool_);
}

void GraphRoutes::release(MempoolId id) noexcept {
  Retired retired;
  {
    std::lock_guard lock(mutex_);
    const auto it = uses_.find(id);
    if (it == uses_.end() || it->second.open == 0) {
      ++invalid_releases_;
      return;
    }
    --it->second.open;
    retired = retire_if_unused(it);
  }
  retired.release(pool_);  // outside the mutex (see end())
}

GraphRoutes::Retired GraphRoutes::retire_if_unused(std::map<MempoolId, Uses>::iterator it) {
  if (it->second.open != 0 || it->second.routes != 0) return {};
  Retired retired{it->second.pool, it->second.pool_uses, std::move(it->second.foreign)};
  uses_.erase(it);
  return retired;
}

void GraphRoutes::Retired::release(vram::DevicePool& pool) noexcept {
  for (; uses != 0; --uses) pool.release_graph_pool(id);
}

int GraphRoutes::use_count(MempoolId id) const {
  std::lock_guard lock(mutex_);
  const auto it = uses_.find(id);
  return it == uses_.end() ? 0 : static_cast<int>(it->second.open);
}

GraphRoutes::Route* GraphRoutes::route_for(cudaStream_t stream) {
  for (Route& r : routes_) {
    if (r.filter && r.filter(stream)) return &r;
  }
  return nullptr;
}

GraphRoutes::Routed GraphRoutes::allocate(std::size_t bytes, cudaStream_t stream) {
  std::unique_lock lock(mutex_);
  Route* route = route_for(stream);
  if (route == nullptr) return {};
  Uses& uses = uses_.at(route->id);
  Routed routed{nullptr, 0, route->id, uses.foreign};
  if (routed.foreign) {
    lock.unlock();  // a foreign allocator may call back into PyTorch
    const ForeignPool::Given given = routed.foreign->allocate(bytes, stream);
    routed.ptr = given.ptr;
    routed.bytes = given.bytes;
    return routed;
  }
  routed.ptr = uses.scope.allocate(bytes);
  return routed;
}

bool GraphRoutes::deallocate(void* block, std::size_t bytes, cudaStream_t stream) noexcept {
  // Its stream is not being captured (the legacy stream never is): it goes back where it
  // came from, as in PyTorch.
  if (stream == nullptr || stream == cudaStreamLegacy || !vram::cuda::may_be_capturing(stream)) {
    return false;
  }
  std::lock_guard lock(mutex_);
  Route* route = nullptr;
  try {
    route = route_for(stream);
  } catch (...) {  // a filter that throws accepts nothing
    return false;
  }
  if (route == nullptr) return false;
  Uses& uses = uses_.at(route->id);
  if (uses.foreign) return false;
  uses.scope.deallocate(block, bytes);
  try {
    uses.stream_of[reinterpret_cast<std::uintptr_t>(block)] = stream;
  } catch (...) {  // no host memory: a snapshot names no stream for it
  }
  return true;
}

void GraphRoutes::note_free(MempoolId id, void* block, cudaStream_t stream) noexcept {
  std::lock_guard lock(mutex_);
  const auto it = uses_.find(id);
  if (it == uses_.end() || it->second.foreign) return;
  try {
    it->second.stream_of[reinterpret_cast<std::uintptr_t>(block)] = stream;
  } catch (...) {  // no host memory: a snapshot names no stream for it
  }
}

std::vector<GraphRoutes::FreeBlock> GraphRoutes::free_blocks() const {
  std::vector<FreeBlock> blocks;
  std::lock_guard lock(mutex_);
  for (const auto& [id, uses] : uses_) {
    if (uses.foreign) continue;
    for (const vram::DevicePool::GraphPoolBlock& free : pool_.graph_pool_free_blocks(uses.pool)) {
      const auto address = reinterpret_cast<std::uintptr_t>(free.block);
      const auto stream = uses.stream_of.find(address);
      blocks.push_back(
          {id, address, free.bytes, stream == uses.stream_of.end() ? nullptr : stream->second});
    }
  }
  std::sort(blocks.begin(), blocks.end(),
            [](const FreeBlock& a, const FreeBlock& b) { return a.address < b.address; });
  return blocks;
}

std::size_t GraphRoutes::claim(MempoolId id, void* block) noexcept {
  std::lock_guard lock(mutex_);
  const auto it = uses_.find(id);
  if (it == uses_.end() || it->second.foreign) return 0;
  return pool_.claim_graph_block(it->second.pool, block);
}

std::uint64_t GraphRoutes::invalid_releases() const {
  std::lock_guard lock(mutex_);
  return invalid_releases_;
}

std::vector<std::shared_ptr<ForeignPool>> GraphRoutes::foreign_pools() const {
  std::lock_guard lock(mutex_);
  std::vector<std::shared_ptr<ForeignPool>> alive;
  alive.reserve(foreign_.size());
  for (const auto& weak : foreign_) {
    if (auto pool = weak.lock()) alive.push_back(std::move(pool));
  }
  return alive;
}

GraphRoutes::ForeignTotals GraphRoutes::foreign_totals() const {
  ForeignTotals totals;
  for (const auto& pool : foreign_pools()) {
    totals.bytes += pool->reserved_bytes();
    totals.segments += pool->segment_count();
  }
  return totals;
}

void GraphRoutes::release_unused_foreign() noexcept {
  std::vector<std::shared_ptr<ForeignPool>> unused;
  try {
    std::lock_guard lock(mutex_);
    unused.reserve(foreign_.size());  // no allocation below: no pool dies under the mutex
    for (const auto& weak : foreign_) {
      auto pool = weak.lock();
      if (!pool) continue;
      const auto it = uses_.find(pool->id());
      if (it == uses_.end() || it->second.foreign != pool) unused.push_back(std::move(pool));
    }
  } catch (...) {  // no host memory: those found so far
  }
  // Outside the mutex: the allocator may call back into PyTorch, and the last reference
  // may go here.
  for (const auto& pool : unused) pool->release_free();
}

}  // namespace vram_torch
