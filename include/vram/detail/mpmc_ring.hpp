// vram/detail/mpmc_ring.hpp: a bounded lock-free multi-producer multi-consumer ring.
//
// Dmitry Vyukov's bounded queue: each cell carries a sequence number; a producer claims
// position p by CAS on the enqueue counter once cell[p % N].sequence == p, writes the
// value, then publishes sequence = p + 1; a consumer claims position p once
// sequence == p + 1 and hands the cell back with sequence = p + N. No locks, no
// allocation after construction. The enqueue and dequeue counters only grow, so
// pushes() and pops() double as exact event counters.
#pragma once

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace vram::detail {

inline constexpr std::size_t kCacheLine = 64;

template <class T>
class MpmcRing {
 public:
  explicit MpmcRing(std::size_t min_capacity)
      : capacity_(std::bit_ceil(min_capacity < 2 ? std::size_t{2} : min_capacity)),
        mask_(capacity_ - 1),
        cells_(std::make_unique<Cell[]>(capacity_)) {
    for (std::size_t i = 0; i < capacity_; ++i) {
      cells_[i].sequence.store(i, std::memory_order_relaxed);
    }
  }
  MpmcRing(const MpmcRing&) = delete;
  MpmcRing& operator=(const MpmcRing&) = delete;

  bool try_push(T value) noexcept {
    std::uint64_t position = enqueue_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& cell = cells_[position & mask_];
      const std::uint64_t sequence = cell.sequence.load(std::memory_order_acquire);
      const auto difference = static_cast<std::int64_t>(sequence - position);
      if (difference == 0) {
        if (enqueue_.compare_exchange_weak(position, position + 1, std::memory_order_relaxed)) {
          cell.value = value;
          cell.sequence.store(position + 1, std::memory_order_release);
          return true;
        }
      } else if (difference < 0) {
        return false;  // full
      } else {
        position = enqueue_.load(std::memory_order_relaxed);
      }
    }
  }

  bool try_pop(T& out) noexcept {
    std::uint64_t position = dequeue_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& cell = cells_[position & mask_];
      const std::uint64_t sequence = cell.sequence.load(std::memory_order_acquire);
      const auto difference = static_cast<std::int64_t>(sequence - (position + 1));
      if (difference == 0) {
        if (dequeue_.compare_exchange_weak(position, position + 1, std::memory_order_relaxed)) {
          out = cell.value;
          cell.sequence.store(position + capacity_, std::memory_order_release);
          return true;
        }
      } else if (difference < 0) {
        return false;  // empty
      } else {
        position = dequeue_.load(std::memory_order_relaxed);
      }
    }
  }

  std::size_t capacity() const noexcept { return capacity_; }
  std::uint64_t pushes() const noexcept { return enqueue_.load(std::memory_order_relaxed); }
  std::uint64_t pops() const noexcept { return dequeue_.load(std::memory_order_relaxed); }
  // Exact when no push or pop runs concurrently; an estimate otherwise.
  std::size_t size() const noexcept {
    const std::uint64_t out = pops();
    const std::uint64_t in = pushes();
    return in > out ? static_cast<std::size_t>(in - out) : 0;
  }

 private:
  struct Cell {
    std::atomic<std::uint64_t> sequence{0};
    T value{};
  };
  const std::size_t capacity_;
  const std::size_t mask_;
  std::unique_ptr<Cell[]> cells_;
  alignas(kCacheLine) std::atomic<std::uint64_t> enqueue_{0};
  alignas(kCacheLine) std::atomic<std::uint64_t> dequeue_{0};
  char padding_[kCacheLine - sizeof(std::atomic<std::uint64_t>)]{};
};

}  // namespace vram::detail
