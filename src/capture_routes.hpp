// src/capture_routes.hpp: which allocations a capture scope sends to a graph pool.
//
// Rule: while a capture scope into pool P is open on stream S by thread T, allocations on
// S (allocate_async(..., S)) and T's allocations without a stream (allocate, acquire) come
// from P. A stream is captured by one scope at a time, and a thread opens one scope at a
// time (CUDA captures a stream once; a second scope is refused).
// Thread safety: one mutex for open/close and lookups; any() is a relaxed load, so
// allocations pay one load while no scope is open. A scope's own thread sees its scope at
// once (program order); another thread allocating on S sees it from the first lookup after
// the open that it is ordered after (a racing allocation is racing the capture's start).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "graph_activity.hpp"

namespace vram::detail {

class CaptureRoutes {
 public:
  // `activity` (optional): raised by one for each open route (see GraphPools).
  explicit CaptureRoutes(GraphActivity* activity = nullptr) noexcept : activity_(activity) {}
  using PoolId = std::uint64_t;
  using StreamKey = std::uintptr_t;

  // Opens a route; false when `stream`, `thread` or `pool` already has one (nothing
  // changed): captures into one pool follow each other, so reuse inside it is ordered.
  bool open(PoolId pool, StreamKey stream, std::thread::id thread);
  // Closes the route of `stream` opened by `thread`; false when there was none.
  bool close(StreamKey stream, std::thread::id thread);
  std::optional<PoolId> for_stream(StreamKey stream) const;
  std::optional<PoolId> for_thread(std::thread::id thread) const;
  bool any() const noexcept { return open_.load(std::memory_order_relaxed) != 0; }

 private:
  struct Route {
    PoolId pool;
    StreamKey stream;
    std::thread::id thread;
  };
  mutable std::mutex mutex_;
  std::vector<Route> routes_;  // a handful at most: one per capturing stream
  std::atomic<std::size_t> open_{0};
  GraphActivity* activity_;
};

}  // namespace vram::detail
