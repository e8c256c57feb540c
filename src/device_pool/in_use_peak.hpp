// src/device_pool/in_use_peak.hpp: the bytes in use of one DevicePool and their peak, kept only
// with Options::track_peak_in_use (a counter shared by every call, so off by default).
//
// Rule: the bytes in use are the sum of every note(); peak() is the largest sum a note()
// reached since the pool's start or the latest reset(). Relaxed atomics: under concurrent
// calls the peak is that of one order of the notes.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace vram::detail {

class InUsePeak {
 public:
  void note(std::int64_t delta) noexcept {
    const std::int64_t now = now_.fetch_add(delta, std::memory_order_relaxed) + delta;
    std::int64_t peak = peak_.load(std::memory_order_relaxed);
    while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  std::size_t peak() const noexcept {
    return static_cast<std::size_t>(
        std::max<std::int64_t>(0, peak_.load(std::memory_order_relaxed)));
  }
  // The peak restarts from the bytes in use now.
  void reset() noexcept {
    peak_.store(now_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }

 private:
  std::atomic<std::int64_t> now_{0};
  std::atomic<std::int64_t> peak_{0};
};

}  // namespace vram::detail
