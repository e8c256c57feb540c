#include "capture_routes.hpp"

#include <algorithm>

namespace vram::detail {

bool CaptureRoutes::add(const Route& route) {
  std::lock_guard lock(mutex_);
  const bool taken = std::any_of(routes_.begin(), routes_.end(), [&](const Route& r) {
    return r.pool == route.pool || (route.key != kNoStream && r.key == route.key) ||
           (route.thread != std::thread::id{} && r.thread == route.thread);
  });
  if (taken) return false;
  routes_.push_back(route);
  open_.store(routes_.size(), std::memory_order_relaxed);
  if (activity_ != nullptr) activity_->add(1);
  return true;
}

bool CaptureRoutes::open(PoolId pool, StreamKey key, cudaStream_t stream, std::thread::id thread) {
  return add({pool, key, stream, thread});
}

bool CaptureRoutes::open_unrouted(PoolId pool) {
  return add({pool, kNoStream, nullptr, std::thread::id{}});
}

bool CaptureRoutes::close(PoolId pool) {
  std::lock_guard lock(mutex_);
  const auto it =
      std::find_if(routes_.begin(), routes_.end(), [&](const Route& r) { return r.pool == pool; });
  if (it == routes_.end()) return false;
  routes_.erase(it);
  open_.store(routes_.size(), std::memory_order_relaxed);
  if (activity_ != nullptr) activity_->add(-1);
  return true;
}

std::optional<CaptureRoutes::PoolId> CaptureRoutes::for_stream(StreamKey key) const {
  if (!any()) return std::nullopt;
  std::lock_guard lock(mutex_);
  for (const Route& r : routes_) {
    if (r.key != kNoStream && r.key == key) return r.pool;
  }
  return std::nullopt;
}

std::optional<CaptureRoutes::PoolId> CaptureRoutes::for_thread(std::thread::id thread) const {
  if (!any()) return std::nullopt;
  std::lock_guard lock(mutex_);
  for (const Route& r : routes_) {
    if (r.thread != std::thread::id{} && r.thread == thread) return r.pool;
  }
  return std::nullopt;
}

}  // namespace vram::detail
