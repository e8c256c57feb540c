// stats.hpp: the plug-in's counters of one device, read by vram_torch_stats.
//
// Rules:
// - Every counter is a relaxed atomic: the warm path updates them without a lock, and a
//   summed view (current = added - removed) is exact only when no allocation or free runs
//   at the same moment.
// - A peak is raised at each addition, never lowered except by restart_peak(), which
//   restarts it from the current value.
#pragma once

#include <array>
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
  // Totals since the start or the last restart_totals().
  std::uint64_t added() const noexcept {
    return added_.load(std::memory_order_relaxed) - added_base_;
  }
  std::uint64_t removed() const noexcept {
    return removed_.load(std::memory_order_relaxed) - removed_base_;
  }
  std::uint64_t peak() const noexcept { return peak_.load(std::memory_order_relaxed); }
  // added - removed, 0 while a removal is seen before its addition.
  std::uint64_t current() const noexcept {
    const std::uint64_t a = added_.load(std::memory_order_relaxed);
    const std::uint64_t r = removed_.load(std::memory_order_relaxed);
    return a > r ? a - r : 0;
  }
  void restart_peak() noexcept { peak_.store(current(), std::memory_order_relaxed); }
  // The totals count from now (torch.cuda.reset_accumulated_memory_stats); current stays.
  // Not atomic with add/remove running at the same moment (the totals may then be off by
  // those), as PyTorch's own reset.
  void restart_totals() noexcept {
    added_base_.store(added_.load(std::memory_order_relaxed), std::memory_order_relaxed);
    removed_base_.store(removed_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }

 private:
  std::atomic<std::uint64_t> added_{0}, removed_{0}, peak_{0};
  std::atomic<std::uint64_t> added_base_{0}, removed_base_{0};
};

// PyTorch's split of its statistics: blocks of at most 1 MiB come from its small pool.
enum class BlockKind : int { small = 0, large = 1 };
inline constexpr std::uint64_t kSmallBlockMaxBytes = std::uint64_t{1} << 20;
inline BlockKind kind_of(std::uint64_t block_bytes) noexcept {
  return block_bytes <= kSmallBlockMaxBytes ? BlockKind::small : BlockKind::large;
}

// One statistic, over all blocks and per kind.
struct SplitTally {
  Tally all;
  std::array<Tally, 2> by_kind;

  void add(BlockKind kind, std::uint64_t amount) noexcept {
    all.add(amount);
    by_kind[static_cast<int>(kind)].add(amount);
  }
  void remove(BlockKind kind, std::uint64_t amount) noexcept {
    all.remove(amount);
    by_kind[static_cast<int>(kind)].remove(amount);
  }
  template <typename Fn>
  void each(Fn&& fn) noexcept {
    fn(all);
    for (Tally& t : by_kind) fn(t);
  }
};

struct Counters {
  SplitTally class_bytes;      // size-class bytes (DevicePool::block_bytes) of live blocks
  SplitTally requested_bytes;  // the bytes PyTorch asked for
  SplitTally allocations;      // live blocks
  std::atomic<std::uint64_t> ooms{0}, retries{0}, record_calls{0};
  // Segments of MemPools' own allocators made and given back (ForeignPool): PyTorch counts
  // them as device allocations and frees.
  std::atomic<std::uint64_t> foreign_segments_made{0}, foreign_segments_freed{0};

  void count_allocation(std::uint64_t block_bytes, std::uint64_t size) noexcept {
    const BlockKind kind = kind_of(block_bytes);
    class_bytes.add(kind, block_bytes);
    requested_bytes.add(kind, size);
    allocations.add(kind, 1);
  }
  void count_free(std::uint64_t block_bytes, std::uint64_t size) noexcept {
    const BlockKind kind = kind_of(block_bytes);
    class_bytes.remove(kind, block_bytes);
    requested_bytes.remove(kind, size);
    allocations.remove(kind, 1);
  }
  // The plug-in's peaks; the pool's own peak is restarted by DevicePool::reset_peak.
  void restart_peaks() noexcept {
    for (SplitTally* s : {&class_bytes, &requested_bytes, &allocations}) {
      s->each([](Tally& t) { t.restart_peak(); });
    }
  }
  void restart_totals() noexcept {
    for (SplitTally* s : {&class_bytes, &requested_bytes, &allocations}) {
      s->each([](Tally& t) { t.restart_totals(); });
    }
  }
};

// The counters of `state` (the plug-in's, its pool's and its stream tracking's).
vram_torch_stats_t stats_of(DeviceState& state);

}  // namespace vram_torch
