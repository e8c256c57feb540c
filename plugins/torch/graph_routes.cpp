#include "graph_routes.hpp"

#include <algorithm>
#include <exception>

namespace vram_torch {

void GraphRoutes::begin(MempoolId id, Filter filter) {
  std::lock_guard lock(mutex_);
  auto [it, made] = uses_.try_emplace(id);
  if (made) it->second.pool = vram::DevicePool::new_graph_pool();
  try {
    // Opens the graph's use (ended by release) and the scope's (ended by end).
    routes_.push_back({id, std::move(filter), pool_.capture_into(it->second.pool)});
  } catch (...) {
    if (made) uses_.erase(it);
    throw;
  }
  ++it->second.open;
  active_.store(routes_.size(), std::memory_order_relaxed);
}

void GraphRoutes::end(MempoolId id) noexcept {
  vram::DevicePool::CaptureScope ending;
  {
    std::lock_guard lock(mutex_);
    const auto it =
        std::find_if(routes_.begin(), routes_.end(), [&](const Route& r) { return r.id == id; });
    if (it == routes_.end()) return;
    ending = std::move(it->scope);
    routes_.erase(it);
    active_.store(routes_.size(), std::memory_order_relaxed);
  }
  // Outside the mutex: the end of the last open scope may synchronize the device to return
  // graph memory given up meanwhile.
  ending.end();
}

void GraphRoutes::release(MempoolId id) noexcept {
  vram::DevicePool::GraphPoolId pool = 0;
  {
    std::lock_guard lock(mutex_);
    const auto it = uses_.find(id);
    if (it == uses_.end() || it->second.open == 0) {
      ++invalid_releases_;
      return;
    }
    pool = it->second.pool;
    if (--it->second.open == 0) uses_.erase(it);
  }
  // Outside the mutex: it may synchronize the device to return the pool's memory.
  pool_.release_graph_pool(pool);
}

GraphRoutes::Route* GraphRoutes::route_for(cudaStream_t stream) {
  for (Route& r : routes_) {
    if (r.filter && r.filter(stream)) return &r;
  }
  return nullptr;
}

void* GraphRoutes::allocate(std::size_t bytes, cudaStream_t stream) {
  std::lock_guard lock(mutex_);
  Route* route = route_for(stream);
  return route == nullptr ? nullptr : route->scope.allocate(bytes);
}

bool GraphRoutes::deallocate(void* block, std::size_t bytes, cudaStream_t stream) noexcept {
  std::lock_guard lock(mutex_);
  Route* route = nullptr;
  try {
    route = route_for(stream);
  } catch (...) {  // a filter that throws accepts nothing
    return false;
  }
  if (route == nullptr) return false;
  route->scope.deallocate(block, bytes);
  return true;
}

std::uint64_t GraphRoutes::invalid_releases() const {
  std::lock_guard lock(mutex_);
  return invalid_releases_;
}

}  // namespace vram_torch
