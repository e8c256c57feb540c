// The requested bytes of blocks freed while memory history is on (freed_requests.hpp).
#include "freed_requests.hpp"

#include <algorithm>

namespace vram_torch {

void FreedRequests::note(int device, std::uintptr_t address, std::size_t bytes,
                         std::size_t requested) noexcept {
  if (device < 0 || bytes == 0) return;
  try {
    std::lock_guard lock(mutex_);
    if (devices_.size() <= static_cast<std::size_t>(device)) {
      devices_.resize(static_cast<std::size_t>(device) + 1);
    }
    Device& d = devices_[static_cast<std::size_t>(device)];
    // Records inside the freed block name memory handed out and freed again since.
    d.by_address.erase(d.by_address.lower_bound(address),
                       d.by_address.lower_bound(address + bytes));
    const std::uint64_t order = ++next_order_;
    d.by_address.insert_or_assign(address, Entry{order, bytes, requested});
    try {
      d.by_age.emplace_back(order, address);
    } catch (...) {
      d.by_address.erase(address);
      throw;
    }
    while (d.by_address.size() > kMaxEntries) drop_oldest(d);
    // Stale ages (replaced or dropped records) are compacted once they outnumber the records.
    if (d.by_age.size() > 2 * kMaxEntries && d.by_age.size() > 2 * d.by_address.size()) {
      std::erase_if(d.by_age, [&d](const std::pair<std::uint64_t, std::uintptr_t>& age) {
        const auto it = d.by_address.find(age.second);
        return it == d.by_address.end() || it->second.order != age.first;
      });
    }
  } catch (...) {  // no host memory: this free is not named
  }
}

void FreedRequests::drop_oldest(Device& device) noexcept {
  while (!device.by_age.empty()) {
    const auto [order, address] = device.by_age.front();
    device.by_age.pop_front();
    const auto it = device.by_address.find(address);
    if (it != device.by_address.end() && it->second.order == order) {
      device.by_address.erase(it);
      return;
    }
  }
}

std::size_t FreedRequests::last_in(int device, std::uintptr_t begin, std::uintptr_t end) const {
  std::lock_guard lock(mutex_);
  if (device < 0 || devices_.size() <= static_cast<std::size_t>(device) || begin >= end) return 0;
  const std::map<std::uintptr_t, Entry>& records =
      devices_[static_cast<std::size_t>(device)].by_address;
  std::uint64_t newest = 0;
  std::size_t requested = 0;
  auto consider = [&](std::uintptr_t address, const Entry& e) {
    if (e.order <= newest) return;
    const std::uintptr_t from = std::max(address, begin);
    const std::uintptr_t asked_end = address + e.requested;  // the requested bytes' end
    newest = e.order;
    requested = asked_end > from ? std::min(asked_end, end) - from : 0;
  };
  auto it = records.lower_bound(begin);
  if (it != records.begin()) {  // a block freed before `begin` may reach into the range
    const auto before = std::prev(it);
    if (before->first + before->second.bytes > begin) consider(before->first, before->second);
  }
  for (; it != records.end() && it->first < end; ++it) consider(it->first, it->second);
  return requested;
}

void FreedRequests::forget(int device, std::uintptr_t begin, std::uintptr_t end) noexcept {
  std::lock_guard lock(mutex_);
  if (device < 0 || devices_.size() <= static_cast<std::size_t>(device) || begin >= end) return;
  std::map<std::uintptr_t, Entry>& records = devices_[static_cast<std::size_t>(device)].by_address;
  records.erase(records.lower_bound(begin), records.lower_bound(end));
}

void FreedRequests::clear() noexcept {
  std::lock_guard lock(mutex_);
  devices_.clear();
}

std::size_t FreedRequests::size(int device) const {
  std::lock_guard lock(mutex_);
  if (device < 0 || devices_.size() <= static_cast<std::size_t>(device)) return 0;
  return devices_[static_cast<std::size_t>(device)].by_address.size();
}

}  // namespace vram_torch
