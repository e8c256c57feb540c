// src/graph_activity.hpp: the one word DevicePool's calls test before graph pools are asked.
//
// Rule: the flag is true while any graph pool exists or any capture scope is open (a count
// of both, kept under a mutex by the rare calls that change it); while it is false no call
// is routed to a graph pool. The flag lives in the pool's hot cache line, beside
// plain_calls, so the test costs no extra line.
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>

namespace vram::detail {

class GraphActivity {
 public:
  explicit GraphActivity(std::atomic<bool>& flag) noexcept : flag_(flag) {}
  void add(std::ptrdiff_t delta) noexcept {
    std::lock_guard lock(mutex_);
    count_ += delta;
    flag_.store(count_ != 0, std::memory_order_relaxed);
  }

 private:
  std::mutex mutex_;
  std::ptrdiff_t count_ = 0;
  std::atomic<bool>& flag_;
};

}  // namespace vram::detail
