// The requested bytes of blocks freed while memory history is on (freed_requests.hpp).
#include "freed_requests.hpp"

#include <algorithm>

namespace vram_torch {

void FreedRequests::note(int device, std::uintptr_t address, std::size_t requested) noexcept {
  if (device < 0) return;
  try {
    std::lock_guard lock(mutex_);
    if (by_device_.size() <= static_cast<std::size_t>(device)) {
      by_device_.resize(static_cast<std::size_t>(device) + 1);
    }
    std::map<std::uintptr_t, Entry>& entries = by_device_[static_cast<std::size_t>(device)];
    entries.insert_or_assign(address, Entry{++next_order_, requested});
    while (entries.size() > kMaxEntries) entries.erase(entries.begin());
  } catch (...) {  // no host memory: this free is not named
  }
}

std::size_t FreedRequests::last_in(int device, std::uintptr_t begin, std::uintptr_t end) const {
  std::lock_guard lock(mutex_);
  if (device < 0 || by_device_.size() <= static_cast<std::size_t>(device)) return 0;
  const std::map<std::uintptr_t, Entry>& entries = by_device_[static_cast<std::size_t>(device)];
  std::uint64_t latest = 0;
  std::size_t requested = 0;
  for (auto it = entries.lower_bound(begin); it != entries.end() && it->first < end; ++it) {
    if (it->second.order > latest) {
      latest = it->second.order;
      requested = std::min(it->second.requested, end - it->first);  // within the range
    }
  }
  return requested;
}

}  // namespace vram_torch
