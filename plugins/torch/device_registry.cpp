#include "device_registry.hpp"

#include <mutex>
#include <stdexcept>
#include <string>

#include "configuration.hpp"
#include "errors.hpp"

namespace vram_torch {

std::array<std::atomic<DeviceState*>, kMaxDevices> g_devices{};

namespace {

std::mutex g_create_mutex;           // serializes the creation of states and configure_pools
std::size_t g_max_cached_bytes = 0;  // under g_create_mutex
std::atomic<SegmentListener> g_segment_listener{nullptr};

void tell(int device, const vram::ReservedSpan& span, bool reserved) noexcept {
  if (SegmentListener listener = g_segment_listener.load(std::memory_order_acquire)) {
    listener(device, span, reserved);
  }
}

}  // namespace

void DeviceState::empty_cache() noexcept {
  streams.release(true);
  try {
    pool.trim(0);
  } catch (const std::exception& e) {
    try {
      note_error_built([&] { return std::string("empty_cache: ") + e.what(); }, false);
    } catch (...) {  // no host memory for the message: the call still returns
    }
  }
}

void set_segment_listener(SegmentListener listener) noexcept {
  g_segment_listener.store(listener, std::memory_order_release);
}

void SegmentUnits::reserved(const vram::ReservedSpan& span) noexcept {
  try {
    std::lock_guard lock(mutex_);
    units_[span.address] = Unit{span.address, span.bytes, span.virtual_memory, next_order_++};
  } catch (...) {  // no host memory: snapshots miss this unit; its events still go out
  }
  tell(device_, span, true);
}

void SegmentUnits::giving_back(const vram::ReservedSpan& span) noexcept {
  {
    std::lock_guard lock(mutex_);
    units_.erase(span.address);
  }
  tell(device_, span, false);
}

std::vector<SegmentUnits::Unit> SegmentUnits::units() const {
  std::lock_guard lock(mutex_);
  std::vector<Unit> out;
  out.reserve(units_.size());
  for (const auto& [address, unit] : units_) out.push_back(unit);
  return out;
}

DeviceState& state_for(int device) {
  if (DeviceState* state = find_state(device)) return *state;
  if (device < 0 || device >= kMaxDevices) {
    throw std::invalid_argument("device " + std::to_string(device) + " is out of range");
  }
  std::lock_guard<std::mutex> lock(g_create_mutex);
  auto& slot = g_devices[static_cast<std::size_t>(device)];
  if (DeviceState* state = slot.load(std::memory_order_acquire)) return *state;
  auto* state = new DeviceState(device, pool_options(g_max_cached_bytes));  // never deleted
  slot.store(state, std::memory_order_release);
  return *state;
}

bool configure_pools(std::size_t max_cached_bytes) {
  std::lock_guard<std::mutex> lock(g_create_mutex);
  g_max_cached_bytes = max_cached_bytes;
  for (const auto& slot : g_devices) {
    if (slot.load(std::memory_order_acquire) != nullptr) return false;
  }
  return true;
}

}  // namespace vram_torch
