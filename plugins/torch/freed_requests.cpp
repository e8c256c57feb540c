// The requested bytes of blocks freed while memory history is on (freed_requests.hpp).
#include "freed_requests.hpp"

#include <algorithm>
#include <limits>

namespace vram_torch {
namespace {

std::uintptr_t end_of(std::uintptr_t address, std::size_t bytes) noexcept {
  const std::uintptr_t most = std::numeric_limits<std::uintptr_t>::max();
  return bytes > most - address ? most : address + bytes;
}

}  // namespace

void FreedRequests::set_recording(bool on) noexcept {
  try {
    std::lock_guard lock(mutex_);
    recording_ = on;
    if (!on) devices_.clear();
  } catch (...) {  // the mutex failed: nothing changes
  }
}

void FreedRequests::erase(Device& device, std::map<std::uintptr_t, Entry>::iterator it) noexcept {
  device.by_order.erase(it->second.order);
  device.by_address.erase(it);
}

void FreedRequests::drop(Device& device, std::uintptr_t begin, std::uintptr_t end) noexcept {
  auto it = device.by_address.lower_bound(begin);
  while (it != device.by_address.end() && it->first < end) erase(device, it++);
  if (it == device.by_address.begin()) return;
  --it;  // the record before `begin`, if it reaches past it, now ends there
  if (end_of(it->first, it->second.bytes) <= begin) return;
  it->second.bytes = begin - it->first;
  it->second.requested = std::min(it->second.requested, it->second.bytes);
}

void FreedRequests::note(int device, std::uintptr_t address, std::size_t bytes,
                         std::size_t requested) noexcept {
  if (device < 0 || bytes == 0) return;
  try {
    std::lock_guard lock(mutex_);
    if (!recording_) return;
    if (devices_.size() <= static_cast<std::size_t>(device)) {
      devices_.resize(static_cast<std::size_t>(device) + 1);
    }
    Device& d = devices_[static_cast<std::size_t>(device)];
    drop(d, address, end_of(address, bytes));
    const std::uint64_t order = ++next_order_;
    const auto made =
        d.by_address.emplace(address, Entry{order, bytes, std::min(requested, bytes)}).first;
    try {
      d.by_order.emplace(order, address);
    } catch (...) {
      d.by_address.erase(made);
      throw;
    }
    while (d.by_address.size() > kMaxEntries && !d.by_order.empty()) {
      const auto oldest = d.by_address.find(d.by_order.begin()->second);
      if (oldest == d.by_address.end()) break;  // cannot be: both maps hold the same records
      erase(d, oldest);
    }
  } catch (...) {  // no host memory: this free is not named
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
    const std::uintptr_t asked_end = end_of(address, e.requested);
    newest = e.order;
    requested = asked_end > from ? std::min(asked_end, end) - from : 0;
  };
  auto it = records.lower_bound(begin);
  // Records never overlap: only the one just before `begin` may reach into the range.
  if (it != records.begin()) {
    const auto before = std::prev(it);
    if (end_of(before->first, before->second.bytes) > begin)
      consider(before->first, before->second);
  }
  for (; it != records.end() && it->first < end; ++it) consider(it->first, it->second);
  return requested;
}

void FreedRequests::forget(int device, std::uintptr_t begin, std::uintptr_t end) noexcept {
  try {
    std::lock_guard lock(mutex_);
    if (device < 0 || devices_.size() <= static_cast<std::size_t>(device) || begin >= end) return;
    drop(devices_[static_cast<std::size_t>(device)], begin, end);
  } catch (...) {  // the mutex failed: the records stay
  }
}

std::size_t FreedRequests::size(int device) const {
  std::lock_guard lock(mutex_);
  if (device < 0 || devices_.size() <= static_cast<std::size_t>(device)) return 0;
  return devices_[static_cast<std::size_t>(device)].by_address.size();
}

}  // namespace vram_torch
