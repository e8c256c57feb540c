// src/tier/growth_budget.hpp: what a segment tier holds, and how far it may grow.
//
// ReservedGauge: the reserved bytes of the tiers of one pool together, their high-water
// mark, and the growth budget they share; beside them the pool's reserved bytes in all
// (the tiers' and sleep tags' mapped granules) and their high-water mark. The budget follows the
// sum of each tier's own peak of used (carved out of segments) bytes, not the peak of their sum: a
// tier's segments serve only that tier, so when the tiers peak at different moments (small blocks
// in one phase of a step, large ones in another) both peaks stay reserved; a budget on the
// peak of the sum would make each phase give back what the other takes again, every step.
//
// GrowthBudget: one tier's accounting against the gauge. Invariants (under the tier's
// mutex): counters.reserved == used + counters.free_bytes; used_peak >= used, and
// used_peak is this tier's share of gauge.tier_peaks; every byte added to reserved here is
// added to gauge.reserved, every byte taken off is taken off there.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace vram::detail {

struct ReservedGauge {
  std::atomic<std::size_t> reserved{0};  // the tiers'
  std::atomic<std::size_t> peak{0};      // the tiers' high-water mark of `reserved`
  // The pool's reserved bytes: the tiers' (add, sub) and those mapped outside them (sleep
  // tags' granules: add_total, sub_total alone), with their high-water mark (DevicePoolStats).
  // Bytes outside the tiers are never part of the growth budget or of `peak`.
  std::atomic<std::size_t> total{0};
  std::atomic<std::size_t> total_peak{0};
  std::atomic<std::size_t> tier_peaks{0};  // sum over the tiers of each one's peak of used
  static void raise(std::atomic<std::size_t>& high_mark, std::size_t now) noexcept {
    std::size_t high = high_mark.load(std::memory_order_relaxed);
    while (now > high && !high_mark.compare_exchange_weak(high, now, std::memory_order_relaxed)) {
    }
  }
  void add(std::size_t bytes) noexcept {
    raise(peak, reserved.fetch_add(bytes, std::memory_order_relaxed) + bytes);
    add_total(bytes);
  }
  void sub(std::size_t bytes) noexcept {
    reserved.fetch_sub(bytes, std::memory_order_relaxed);
    sub_total(bytes);
  }
  void add_total(std::size_t bytes) noexcept {
    raise(total_peak, total.fetch_add(bytes, std::memory_order_relaxed) + bytes);
  }
  void sub_total(std::size_t bytes) noexcept { total.fetch_sub(bytes, std::memory_order_relaxed); }
  // Both high-water marks restart from now (DevicePool::reset_peak).
  void restart_peaks() noexcept {
    peak.store(reserved.load(std::memory_order_relaxed), std::memory_order_relaxed);
    total_peak.store(total.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
  // The budget: reserved may exceed the tiers' peaks (plus `peak_growth`, by how much the
  // request raises its tier's peak) by headroom_1024/1024 of them. Returns by how much
  // taking `grow` more bytes would pass it (0: within).
  std::size_t excess_after_growth(std::size_t grow, std::size_t peak_growth,
                                  std::size_t headroom_1024) const noexcept {
    const std::size_t peaks = tier_peaks.load(std::memory_order_relaxed) + peak_growth;
    // (peaks >> 10) * headroom_1024 fits in 64 bits for peaks below 2^54 with headroom_1024
    // <= kMaxHeadroom1024 (2^20); a pool's used bytes are far below that.
    const std::size_t bound =
        peaks + (peaks >> 10) * headroom_1024 + (((peaks & 1023) * headroom_1024) >> 10);
    const std::size_t after = reserved.load(std::memory_order_relaxed) + grow;
    return after > bound ? after - bound : 0;
  }
  static constexpr std::size_t kMaxHeadroom1024 = std::size_t{1} << 20;  // 1024x
};

// A tier's figures, as SegmentTier::counters() reports them.
struct TierCounters {
  std::size_t reserved = 0;
  std::size_t peak_reserved = 0;
  std::size_t free_bytes = 0;  // reserved - used
  std::uint64_t upstream_allocations = 0;
  std::uint64_t upstream_frees = 0;
  std::uint64_t failed_upstream_allocations = 0;
  std::uint64_t segments = 0;
  std::uint64_t maps = 0;  // runs mapped (virtual mode; counted in upstream_allocations)
};

// Not thread-safe: every call is under the owning tier's mutex (the gauge it charges is
// shared with the other tiers, through atomics).
class GrowthBudget {
 public:
  GrowthBudget(ReservedGauge& gauge, std::size_t headroom_1024) noexcept
      : gauge_(gauge), headroom_1024_(headroom_1024) {}
  GrowthBudget(const GrowthBudget&) = delete;
  GrowthBudget& operator=(const GrowthBudget&) = delete;

  const TierCounters& counters() const noexcept { return counters_; }
  TierCounters& counters() noexcept { return counters_; }
  std::size_t reserved() const noexcept { return counters_.reserved; }
  std::size_t free_bytes() const noexcept { return counters_.free_bytes; }
  std::size_t used() const noexcept { return used_; }

  // `bytes` more reserved, all of it free: one upstream allocation (a segment or a run).
  void add_reserved(std::size_t bytes) noexcept {
    ++counters_.upstream_allocations;
    counters_.reserved += bytes;
    counters_.free_bytes += bytes;
    counters_.peak_reserved = std::max(counters_.peak_reserved, counters_.reserved);
    gauge_.add(bytes);
  }
  // `bytes` of free memory given back: one upstream free.
  void sub_reserved(std::size_t bytes) noexcept {
    ++counters_.upstream_frees;
    counters_.reserved -= bytes;
    counters_.free_bytes -= bytes;
    gauge_.sub(bytes);
  }
  // At destruction: the gauge forgets `bytes` (the tier's own figures are not kept).
  void forget_reserved(std::size_t bytes) noexcept { gauge_.sub(bytes); }

  // `bytes` of free memory handed out as a block.
  void take(std::size_t bytes) noexcept {
    counters_.free_bytes -= bytes;
    used_ += bytes;
    if (used_ > used_peak_) {
      gauge_.tier_peaks.fetch_add(used_ - used_peak_, std::memory_order_relaxed);
      used_peak_ = used_;
    }
    ahead_peak_ = std::max(ahead_peak_, used_);
  }
  // A block of `bytes` freed (free again, whatever its stream tag).
  void give(std::size_t bytes) noexcept {
    counters_.free_bytes += bytes;
    used_ -= bytes;
  }

  // By how much a block of `need` bytes would raise this tier's peak of used bytes.
  std::size_t peak_growth(std::size_t need) const noexcept {
    return used_ + need > used_peak_ ? used_ + need - used_peak_ : 0;
  }
  // By how much reserving `grow` more bytes for a block of `need` bytes would pass the
  // budget of the gauge (0: within).
  std::size_t excess_after_growth(std::size_t grow, std::size_t need) const noexcept {
    return gauge_.excess_after_growth(grow, peak_growth(need), headroom_1024_);
  }
  std::size_t headroom_1024() const noexcept { return headroom_1024_; }
  // Reserving `grow` more bytes would raise the tiers' peak of reserved bytes.
  bool raises_peak_reserved(std::size_t grow) const noexcept {
    return gauge_.reserved.load(std::memory_order_relaxed) + grow >
           gauge_.peak.load(std::memory_order_relaxed);
  }

  // The peak of used bytes restarts from what is used now.
  void restart_peak() noexcept {
    gauge_.tier_peaks.fetch_sub(used_peak_ - used_, std::memory_order_relaxed);
    used_peak_ = used_;
    ahead_peak_ = used_;
  }
  void reset_peak_reserved() noexcept { counters_.peak_reserved = counters_.reserved; }

  // The peak of used bytes since the tier last gave granules back (unmapped, or
  // restart_peak()): a block that raises it belongs to a growing workload (map-ahead).
  bool raises_ahead_peak(std::size_t need) const noexcept { return used_ + need > ahead_peak_; }
  // Granules went back: less is held than the peak needed, so regrowth is growth again.
  void restart_ahead_peak() noexcept { ahead_peak_ = used_; }

 private:
  ReservedGauge& gauge_;
  const std::size_t headroom_1024_;
  TierCounters counters_;
  std::size_t used_ = 0;
  std::size_t used_peak_ = 0;
  std::size_t ahead_peak_ = 0;
};

}  // namespace vram::detail
