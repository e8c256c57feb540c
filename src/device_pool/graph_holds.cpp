// Tagged blocks of CUDA graphs, held for their graph pools (graph_holds.hpp).
#include "graph_holds.hpp"

namespace vram::detail {

void GraphHolds::note(Id id, void* block) {
  std::lock_guard lock(mutex_);
  blocks_.insert_or_assign(block, Entry{id, 0, false});
}

GraphHolds::Hold GraphHolds::hold(std::optional<Id> route, void* block,
                                  std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  if (const auto it = blocks_.find(block); it != blocks_.end()) {
    if (it->second.held) return Hold::double_free;
    it->second.held = true;
    it->second.bytes = bytes;
    return Hold::held;
  }
  if (!route) return Hold::not_a_graphs;
  try {
    blocks_.emplace(block, Entry{*route, bytes, true});
    return Hold::held;
  } catch (...) {
    return Hold::no_memory;
  }
}

std::vector<GraphHolds::Held> GraphHolds::take(Id id, const GraphRouting& routes) noexcept {
  std::vector<Held> taken;
  std::lock_guard lock(mutex_);
  if (routes.any()) return {};  // a quiesce would invalidate the open capture
  try {
    taken.reserve(blocks_.size());
  } catch (...) {
    return {};  // no host memory: a later release takes them
  }
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    if (it->second.id != id) {
      ++it;
      continue;
    }
    if (it->second.held) taken.push_back({it->first, it->second.bytes});
    it = blocks_.erase(it);  // live noted ones are plain tagged blocks from here on
  }
  return taken;
}

}  // namespace vram::detail
