// src/tier/tier_arenas.hpp: one tier as several arenas, each a SegmentTier with its own
// mutexes, books and (virtual mode) reservation, over the one growth gauge of the pool.
//
// Threads that meet on one tier's mutex convoy; with arenas they mostly do not meet. A
// thread's home arena is its slot (a process-wide number given to a thread on its first
// request to any arena set) less the slot of the first thread that used this set, modulo
// the count: threads that start together get distinct arenas. A request tries its home arena, then
// every other arena whose mutex is free at once (SegmentTier::try_allocate: no fence, no wait, no
// growth); only then does the caller grow, and it grows the home arena. A block goes back
// to the arena that holds it, whichever thread frees it: the home arena is asked first,
// then the others in turn (SegmentTier::free_keeping answers foreign, changing nothing, for
// a block it does not hold).
//
// Arenas are made on first use: a program whose calls all come from one thread makes one
// arena and behaves as a single SegmentTier, call for call (the recorded traces replay
// identically). Each arena keeps up to max_free_bytes free, as a lone tier does: what an
// arena holds follows the peak of what was used from it (the growth budget counts every
// arena's peak), so free memory spread over arenas is bounded by the arenas' peaks, not by
// max_free_bytes alone.
//
// Calls that concern the whole tier (trim, the marks of a quiesce, counters, describe,
// giving empty segments back, stranded segments) cover every arena made so far. The growth
// budget is shared through the gauge: an arena's growth sees every arena's reserved bytes,
// and the budget is the sum of every arena's peak of used bytes plus the headroom.
//
// Invariant: arenas_[i] is null or a tier that lives as long as this set; once published
// (release store under make_mutex_) it never changes.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "segment_tier.hpp"

namespace vram::detail {

class TierArenas {
 public:
  static constexpr std::size_t kMaxArenas = 16;
  using Counters = SegmentTier::Counters;
  // `count`: the arenas the set may make (clamped to 1 .. kMaxArenas, rounded down to a
  // power of two).
  TierArenas(Upstream& upstream, StreamFence& fence, ReservedGauge& gauge,
             SegmentTier::Options options, std::size_t count);
  ~TierArenas();
  TierArenas(const TierArenas&) = delete;
  TierArenas& operator=(const TierArenas&) = delete;

  // The arena count for `asked` (0: one per hardware thread), at most kMaxArenas, rounded
  // down to a power of two (a thread's home is found with a mask).
  static std::size_t count_for(std::size_t asked) noexcept;
  // The calling thread's slot: given on its first call, never changes.
  static std::size_t thread_slot() noexcept {
    if (tl_slot == kNoSlot) [[unlikely]]
      tl_slot = next_slot();
    return tl_slot;
  }

  std::size_t round(std::size_t bytes) const noexcept {
    return (bytes + options_.granularity - 1) & ~(options_.granularity - 1);
  }
  std::size_t count() const noexcept { return count_; }
  // Arenas made so far (1 once the set exists: arena 0 is made with it).
  std::size_t made() const noexcept { return made_.load(std::memory_order_acquire); }
  // Arena `i` when made, else null.
  SegmentTier* arena(std::size_t i) const noexcept {
    return i < count_ ? arenas_[i].load(std::memory_order_acquire) : nullptr;
  }
  // The calling thread's home arena, made on first use. Throws std::bad_alloc.
  SegmentTier& home() { return arena_for(home_index()); }
  // A block of `bytes` (rounded) usable on `stream`, from the home arena (without growing),
  // else from any other arena whose mutex is free; null when none served it.
  void* allocate(std::size_t bytes, StreamKey stream, LeaseOwner* owner = nullptr) {
    SegmentTier& own = home();
    if (void* block = own.allocate(bytes, stream, /*may_grow=*/false, nullptr, owner)) [[likely]]
      return block;
    return borrow(bytes, stream, owner, own);
  }
  // allocate() over every arena, each locked in turn (the out-of-memory retry). Throws as
  // SegmentTier::allocate without may_grow.
  void* allocate_anywhere(std::size_t bytes, StreamKey stream, LeaseOwner* owner = nullptr);
  // SegmentTier::free_keeping on the arena that holds `block`; `holder`: that arena (for
  // give_back_over_cap()), null when foreign.
  SegmentTier::Freed free_keeping(void* block, StreamKey tag, std::size_t bytes,
                                  const LeaseOwner* by, SegmentTier*& holder) noexcept;
  bool free(void* block, StreamKey tag, std::size_t bytes = 0,
            const LeaseOwner* by = nullptr) noexcept {
    SegmentTier* holder = nullptr;
    const SegmentTier::Freed freed = free_keeping(block, tag, bytes, by, holder);
    if (freed == SegmentTier::Freed::over_cap) holder->give_back_over_cap();
    return freed != SegmentTier::Freed::foreign;
  }
  // SegmentTier::trim over every arena: `keep_free` bytes are kept free in all of them
  // together (the first arenas keep theirs first).
  void trim(std::size_t keep_free, bool wait) noexcept;
  // The marks of every arena (SegmentTier::mark_frees), for forget_streams after a quiesce.
  using Marks = std::array<std::uint64_t, kMaxArenas>;
  Marks mark_frees() noexcept;
  void forget_streams(const Marks& marks) noexcept;
  void restart_peak() noexcept;
  void reset_peak() noexcept;
  bool stranded_segments() const noexcept;
  // Wholly free segments of the arenas other than `except` given back until they cover
  // `bytes` (each arena's SegmentTier::release_empty_for); returns the bytes given back.
  std::size_t release_empty_for(std::size_t bytes, const SegmentTier* except = nullptr) noexcept;
  bool owns(void* block) const noexcept;
  // Calls that found the calling thread's home arena's mutex held (wraps): whether threads
  // meet where this one allocates (one arena's counter: the warm large path reads it).
  std::uint32_t contentions() const noexcept;
  SegmentTier::Counters counters() const noexcept;
  void describe(bool large, std::vector<DevicePoolSegment>& out) const;
  std::size_t growth_headroom_1024() const noexcept { return options_.growth_headroom_1024; }
  bool enforces_growth_budget() const noexcept {
    return options_.virtual_memory == nullptr || options_.unmap_before_map;
  }
  // Calls `visit(SegmentTier&)` on every arena made so far.
  template <class Visit>
  void for_each(Visit visit) const {
    for (std::size_t i = 0; i < count_; ++i) {
      if (SegmentTier* tier = arena(i)) visit(*tier);
    }
  }

 private:
  static constexpr std::size_t kNoSlot = SIZE_MAX;
  static inline thread_local std::size_t tl_slot = kNoSlot;
  static std::size_t next_slot() noexcept;
  std::size_t home_index() const noexcept {
    const std::size_t first = first_slot_.load(std::memory_order_relaxed);
    if (first == kNoSlot) [[unlikely]]
      return first_home_index();
    return (thread_slot() - first) & (count_ - 1);
  }
  // home_index() before any thread asked: the caller becomes the first (arena 0).
  std::size_t first_home_index() const noexcept;
  // allocate() once the home arena `own` had no fit: the other arenas, by try_lock.
  void* borrow(std::size_t bytes, StreamKey stream, LeaseOwner* owner, SegmentTier& own);
  SegmentTier& arena_for(std::size_t i) {
    if (SegmentTier* tier = arenas_[i].load(std::memory_order_acquire)) [[likely]]
      return *tier;
    return make(i);
  }
  [[gnu::cold]] SegmentTier& make(std::size_t i);

  Upstream& upstream_;
  StreamFence& fence_;
  ReservedGauge& gauge_;
  const SegmentTier::Options options_;
  const std::size_t count_;
  std::mutex make_mutex_;  // orders the making of arenas
  std::atomic<std::size_t> made_{0};
  // The slot of the first thread that asked for its home arena: that thread's is arena 0.
  mutable std::atomic<std::size_t> first_slot_{kNoSlot};
  std::array<std::atomic<SegmentTier*>, kMaxArenas> arenas_{};
};

}  // namespace vram::detail
