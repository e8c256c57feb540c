// src/device_pool/graph_holds.hpp: blocks of sleep tags that a capture freed, held for the
// capture's graph pool.
//
// A tagged block freed during a capture (on a routed stream, or through a capture scope) stays
// live in its tag: the graph's launches may write it. It is held here under the graph pool's
// id until that pool is released (release_graph_pool); then the core quiesces the device and
// deallocates the blocks into their tags (pool_sleep.cpp).
//
// Rules:
// - take() gives nothing while a capture scope is open (the quiesce that follows it would
//   invalidate the open capture): the blocks wait for a later release of their graph pool.
// - Thread safety: one mutex of its own, taken with no other lock of the pool held; under it
//   only the routes' any() (a relaxed load) is read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "graph_routing.hpp"

namespace vram::detail {

class GraphHolds {
 public:
  using Id = std::uint64_t;  // a graph pool's id (GraphPools::Id)
  struct Hold {
    Id id;
    void* block;
    std::size_t bytes;
  };
  // Holds `block` for graph pool `id`; false when there is no host memory to hold it
  // (nothing changed).
  bool hold(Id id, void* block, std::size_t bytes) noexcept;
  // The blocks held for `id`, held no more; none while `routes` has a scope open, or when
  // there is no host memory to take them (they stay held).
  std::vector<Hold> take(Id id, const GraphRouting& routes) noexcept;

 private:
  std::mutex mutex_;
  std::vector<Hold> holds_;  // guarded by mutex_
};

}  // namespace vram::detail
