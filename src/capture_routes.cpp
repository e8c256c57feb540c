#include "capture_routes.hpp"

#include <algorithm>

namespace vram::detail {

bool CaptureRoutes::open(PoolId pool, StreamKey stream, std::thread::id thread) {
  std::lock_guard lock(mutex_);
  const bool taken = std::any_of(routes_.begin(), routes_.end(), [&](const Route& r) {
    return r.stream == stream || r.thread == thread || r.pool == pool;
  });
  if (taken) return false;
  routes_.push_back({pool, stream, thread});
  open_.store(routes_.size(), std::memory_order_relaxed);
  if (activity_ != nullptr) activity_->add(1);
  return true;
}

bool CaptureRoutes::close(StreamKey stream, std::thread::id thread) {
  std::lock_guard lock(mutex_);
  const auto it = std::find_if(routes_.begin(), routes_.end(), [&](const Route& r) {
    return r.stream == stream && r.thread == thread;
  });
  if (it == routes_.end()) return false;
  routes_.erase(it);
  open_.store(routes_.size(), std::memory_order_relaxed);
  if (activity_ != nullptr) activity_->add(-1);
  return true;
}

std::optional<CaptureRoutes::PoolId> CaptureRoutes::for_stream(StreamKey stream) const {
  if (!any()) return std::nullopt;
  std::lock_guard lock(mutex_);
  for (const Route& r : routes_) {
    if (r.stream == stream) return r.pool;
  }
  return std::nullopt;
}

std::optional<CaptureRoutes::PoolId> CaptureRoutes::for_thread(std::thread::id thread) const {
  if (!any()) return std::nullopt;
  std::lock_guard lock(mutex_);
  for (const Route& r : routes_) {
    if (r.thread == thread) return r.pool;
  }
  return std::nullopt;
}

}  // namespace vram::detail
