// Tagged blocks held for a graph pool (graph_holds.hpp).
#include "graph_holds.hpp"

namespace vram::detail {

bool GraphHolds::hold(Id id, void* block, std::size_t bytes) noexcept {
  try {
    std::lock_guard lock(mutex_);
    holds_.push_back({id, block, bytes});
    return true;
  } catch (...) {
    return false;
  }
}

std::vector<GraphHolds::Hold> GraphHolds::take(Id id, const GraphRouting& routes) noexcept {
  std::vector<Hold> taken;
  std::lock_guard lock(mutex_);
  if (routes.any()) return {};  // a quiesce would invalidate the open capture
  try {
    taken.reserve(holds_.size());
  } catch (...) {
    return {};  // no host memory: a later release takes them
  }
  for (std::size_t i = 0; i < holds_.size();) {
    if (holds_[i].id == id) {
      taken.push_back(holds_[i]);
      holds_[i] = holds_.back();
      holds_.pop_back();
    } else {
      ++i;
    }
  }
  return taken;
}

}  // namespace vram::detail
