// src/device_pool/graph_holds.hpp: blocks of sleep tags that belong to a CUDA graph, held for
// the graph's pool.
//
// A tagged block a capture takes (a capture, or a capture scope, inside a tag scope) is noted
// as its graph pool's; a tagged block freed during a capture (on a routed stream, or through a
// capture scope) is held for that pool. Rules:
// - a noted block, whoever deallocates it and on whatever stream, is held for its pool, as a
//   graph pool's own blocks stay their pool's (the graph's launches may write it);
// - a held block stays live in its tag (it sleeps and wakes with it) until its graph pool is
//   released (release_graph_pool); then the core quiesces the device and deallocates it into
//   its tag (pool_sleep.cpp);
// - holding a held block again is a double free (refused by the caller);
// - take() forgets every block of the pool: the held ones are returned, the noted ones still
//   live are plain tagged blocks from then on. It gives nothing while a capture scope is open
//   (the quiesce that follows would invalidate the open capture): they wait for a later
//   release of their graph pool.
// - Thread safety: one mutex of its own, taken with no other lock of the pool held; under it
//   only the routes' any() (a relaxed load) is read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "graph_routing.hpp"

namespace vram::detail {

class GraphHolds {
 public:
  using Id = std::uint64_t;  // a graph pool's id (GraphPools::Id)
  // `block`, just taken from a tag for graph pool `id`, is that pool's. Throws
  // std::bad_alloc (nothing changed).
  void note(Id id, void* block);
  enum class Hold { held, not_a_graphs, double_free, no_memory };
  // A tagged block being deallocated: held when it is noted, or when `route` (the graph pool
  // a capture on the deallocating stream goes to) names one; not_a_graphs otherwise;
  // double_free when it is held already; no_memory when there is no host memory to hold it.
  Hold hold(std::optional<Id> route, void* block, std::size_t bytes) noexcept;
  struct Held {
    void* block;
    std::size_t bytes;
  };
  // The blocks held for `id`, held no more, and the noted ones forgotten; nothing while
  // `routes` has a scope open, or when there is no host memory to take them.
  std::vector<Held> take(Id id, const GraphRouting& routes) noexcept;

 private:
  struct Entry {
    Id id;
    std::size_t bytes;  // as deallocated (held ones)
    bool held;
  };
  std::mutex mutex_;
  std::unordered_map<void*, Entry> blocks_;  // guarded by mutex_
};

}  // namespace vram::detail
