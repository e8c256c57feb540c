// src/device_pool/graph_routing.hpp: GraphRouting, which DevicePool calls go to a graph pool
// (graph_pools.hpp), and the flag every call tests before it asks.
//
// The flag. Rule: it is true while any graph pool exists, any capture scope is open or any
// sleep tag exists (a count of all three, kept under a mutex of its own by the rare calls that
// change it: open() and close() count the routes, GraphPools and SleepTags call add()); while
// it is false no call is routed. The flag is one bit of the pool's word of call checks
// (pool_core.hpp, in its hot cache line beside plain_calls, so the test costs no extra line);
// GraphRouting keeps a pointer to the word and changes only that bit.
//
// The routes: which allocations a capture scope sends to a graph pool. Rule: while a capture
// scope into pool P is open on stream S by thread T, allocations on S (allocate_async(..., S)) and
// T's allocations without a stream (allocate, acquire) come from P, and so do those on any other
// stream in the same capture as S (fork and join through events): the capture's id is learned from
// S. A stream is captured by one scope at a time, a thread opens one scope at a time, and a pool
// has one open scope at a time (CUDA captures a stream once; captures into one pool follow each
// other). An unrouted scope (no stream, no thread) routes nothing: its host picks the requests.
//
// Thread safety: one mutex for open/close and lookups; any() is a relaxed load, so
// allocations pay one load while no scope is open. A scope's own thread sees its scope at
// once (program order); another thread allocating on S sees it from the first lookup after
// the open that it is ordered after (a racing allocation is racing the capture's start).
// Lock order: the routes' mutex, GraphPools' mutex or SleepTags' create mutex, then the
// count's mutex (taken last, nothing taken under it).
//
// DevicePoolCore's routing calls (graph_routing.cpp) combine the routes with the graph pools.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace vram::detail {

class GraphRouting {
 public:
  // `flag` of `word` (optional; the unit tests run without): set while the count is not
  // zero; the word's other bits are left as they are.
  explicit GraphRouting(std::atomic<std::uint64_t>* word = nullptr, std::uint64_t flag = 0) noexcept
      : word_(word), flag_(flag) {}
  using PoolId = std::uint64_t;
  using StreamKey = std::uintptr_t;
  static constexpr StreamKey kNoStream = 0;

  // The count behind the flag, for the other parts that keep it raised: GraphPools (one for
  // each pool that exists) and SleepTags (one for each tag).
  void add(std::ptrdiff_t delta) noexcept {
    std::lock_guard lock(count_mutex_);
    const bool was = count_ != 0;
    count_ += delta;
    if (word_ == nullptr || was == (count_ != 0)) return;
    if (count_ != 0) {
      word_->fetch_or(flag_, std::memory_order_relaxed);
    } else {
      word_->fetch_and(~flag_, std::memory_order_relaxed);
    }
  }

  // Opens a route for `stream` (its key and its handle) and `thread`; false when the
  // stream, the thread or the pool already has one (nothing changed).
  bool open(PoolId pool, StreamKey key, cudaStream_t stream, std::thread::id thread);
  // Opens an unrouted route of `pool`; false when the pool already has a route.
  bool open_unrouted(PoolId pool);
  // Closes the route of `pool`; false when there was none.
  bool close(PoolId pool);
  std::optional<PoolId> for_stream(StreamKey key) const;
  std::optional<PoolId> for_thread(std::thread::id thread) const;
  // The pool of the route whose stream is in capture `capture`; `capture_of(stream)` asks
  // the capture of a route's stream the first time it is needed (once it is known).
  template <class CaptureOf>
  std::optional<PoolId> for_capture(std::uint64_t capture, CaptureOf capture_of) {
    if (!any() || capture == 0) return std::nullopt;
    std::lock_guard lock(mutex_);
    for (Route& r : routes_) {
      if (r.key == kNoStream) continue;
      // cudaStreamPerThread names the calling thread's stream: asked only by its thread.
      if (r.capture == 0 &&
          (r.stream != cudaStreamPerThread || r.thread == std::this_thread::get_id())) {
        r.capture = capture_of(r.stream);
      }
      if (r.capture == capture) return r.pool;
    }
    return std::nullopt;
  }
  // Whether a route (a capture scope) is open.
  bool any() const noexcept { return open_.load(std::memory_order_relaxed) != 0; }

 private:
  struct Route {
    PoolId pool;
    StreamKey key;  // kNoStream: unrouted
    cudaStream_t stream;
    std::thread::id thread;     // default: none
    std::uint64_t capture = 0;  // the capture `stream` is in, once learned
  };
  bool insert(const Route& route);
  mutable std::mutex mutex_;
  std::vector<Route> routes_;  // a handful at most: one per capturing stream
  std::atomic<std::size_t> open_{0};
  std::mutex count_mutex_;
  std::ptrdiff_t count_ = 0;  // routes open, graph pools and sleep tags that exist
  std::atomic<std::uint64_t>* word_;
  std::uint64_t flag_;
};

}  // namespace vram::detail
