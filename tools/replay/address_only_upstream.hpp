// AddressOnlyUpstream: an upstream that hands out addresses with no memory behind them, for
// replays without a device. The pools never touch their blocks, so traces of many GiB
// replay on any host, and the addresses depend only on the requests: the same trace gives
// the same blocks, the same fits and the same figures in every run and every process
// (addresses from malloc change with the heap, and a best fit that ties on size prefers the
// lower address).
//
// Rules: the lowest free address range that fits is taken (freed ranges are reused, as a
// device's allocator reuses freed addresses); a gap of one page follows every segment, so no
// two are contiguous by accident; `capacity` emulates the device's size (OutOfMemory past
// it). Not thread-safe: a replay drives one pool from one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <string_view>

#include "vram/cuda/error.hpp"
#include "vram/upstream.hpp"

namespace vram::replay {

class AddressOnlyUpstream final : public Upstream {
 public:
  explicit AddressOnlyUpstream(std::size_t capacity = SIZE_MAX) : capacity_(capacity) {}
  void* allocate(std::size_t bytes) override {
    const std::size_t rounded = round(bytes);
    if (rounded > capacity_ - live_) throw OutOfMemory(bytes, 0, 0, "address-only capacity");
    const std::size_t span = rounded + kGap;
    auto it = free_.begin();
    while (it != free_.end() && it->second < span) ++it;
    std::uintptr_t at;
    if (it == free_.end()) {
      at = end_;
      end_ += span;
    } else {
      at = it->first;
      const std::size_t left = it->second - span;
      free_.erase(it);
      if (left != 0) free_.emplace(at + span, left);
    }
    live_ += rounded;
    return reinterpret_cast<void*>(at);
  }
  void deallocate(void* block, std::size_t bytes) noexcept override {
    const std::size_t rounded = round(bytes);
    live_ -= rounded;
    std::uintptr_t at = reinterpret_cast<std::uintptr_t>(block);
    std::size_t span = rounded + kGap;
    try {
      auto next = free_.lower_bound(at);
      if (next != free_.begin()) {  // joins the free range below
        auto prev = std::prev(next);
        if (prev->first + prev->second == at) {
          at = prev->first;
          span += prev->second;
          free_.erase(prev);
        }
      }
      if (next != free_.end() && at + span == next->first) {  // and the one above
        span += next->second;
        free_.erase(next);
      }
      if (at + span == end_) {
        end_ = at;
      } else {
        free_.emplace(at, span);
      }
    } catch (...) {  // no host memory for the map: the range is not reused
    }
  }
  MemoryKind kind() const noexcept override { return MemoryKind::host; }
  std::string_view name() const noexcept override { return "address-only"; }
  std::size_t available_bytes() const noexcept override { return capacity_ - live_; }
  std::size_t live_bytes() const noexcept { return live_; }

 private:
  static constexpr std::size_t kAlignment = 256;
  static constexpr std::size_t kGap = 4096;
  static std::size_t round(std::size_t bytes) noexcept {
    return (bytes + kAlignment - 1) & ~(kAlignment - 1);
  }

  std::size_t capacity_;
  std::size_t live_ = 0;
  std::map<std::uintptr_t, std::size_t> free_;    // address -> bytes, gaps included
  std::uintptr_t end_ = std::uintptr_t{1} << 40;  // above every range handed out
};

}  // namespace vram::replay
