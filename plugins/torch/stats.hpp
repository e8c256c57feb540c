// stats.hpp: the plug-in's counters of one device, read by vram_torch_stats.
//
// Rules:
// - Every counter is a relaxed atomic: the warm path updates them without a lock, and a
//   summed view (current = added - removed) is exact only when no allocation or free runs
//   at the same moment.
// - A peak is raised at each addition, never lowered except by restart_peak(), which
//   restarts it from the current value.
#pragma once

#include <atomic>
#include <cstdint>

#include "vram_torch.h"

namespace vram_torch {

struct DeviceState;

// One quantity handed out and given back: bytes or blocks.
class Tally {
 public:
  void add(std::uint64_t amount) noexcept {
    const std::uint64_t now = added_.fetch_add(amount, std::memory_order_relaxed) + amount -
                              removed_.load(std::memory_order_relaxed);
    std::uint64_t seen = peak_.load(std::memory_order_relaxed);
    while (now > seen && !peak_.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
  void remove(std::uint64_t amount) noexcept {
    removed_.fetch_add(amount, std::memory_order_relaxed);
  }
  std::uint64_t added() const noexcept { return added_.load(std::memory_order_relaxed); }
  std::uint64_t removed() const noexcept { return removed_.load(std::memory_order_relaxed); }
  std::uint64_t peak() const noexcept { return peak_.load(std::memory_order_relaxed); }
  // added - removed, 0 while a removal is seen before its addition.
  std::uint64_t current() const noexcept {
    const std::uint64_t a = added();
    const std::uint64_t r = removed();
    return a > r ? a - r : 0;
  }
  void restart_peak() noexcept { peak_.store(current(), std::memory_order_relaxed); }

 private:
  std::atomic<std::uint64_t> added_{0}, removed_{0}, peak_{0};
};

struct Counters {
  Tally class_bytes;      // size-class bytes (DevicePool::block_bytes) of live blocks
  Tally requested_bytes;  // the bytes PyTorch asked for
  Tally allocations;      // live blocks
  std::atomic<std::uint64_t> ooms{0}, retries{0}, record_calls{0};

  void count_allocation(std::uint64_t block_bytes, std::uint64_t size) noexcept {
    class_bytes.add(block_bytes);
    requested_bytes.add(size);
    allocations.add(1);
  }
  void count_free(std::uint64_t block_bytes, std::uint64_t size) noexcept {
    class_bytes.remove(block_bytes);
    requested_bytes.remove(size);
    allocations.remove(1);
  }
  // The plug-in's peaks; the pool's own peak is restarted by DevicePool::reset_peak.
  void restart_peaks() noexcept {
    class_bytes.restart_peak();
    requested_bytes.restart_peak();
    allocations.restart_peak();
  }
};

// The counters of `state` (the plug-in's, its pool's and its stream tracking's).
vram_torch_stats_t stats_of(DeviceState& state);

}  // namespace vram_torch
