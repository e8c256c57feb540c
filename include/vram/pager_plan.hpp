// vram/pager_plan.hpp: the weight pager's decisions, as pure host code (no CUDA call).
//
// The WeightPager (weight_pager.hpp) executes what this file decides:
//   plan_residency()  which layers stay resident for good under the VRAM budget, and the ring
//                     of slots the others stream through (slot_count x slot_bytes);
//   PagerSchedule     at each acquire: hit or page-in, which slot (Belady: evict the layer
//                     whose next use in the cyclic schedule is furthest away), and which
//                     layers to prefetch ahead (prefetch_depth positions of the schedule).
// Both are deterministic, so the CPU tests check them exactly.
//
// The plan
//   The schedule is cyclic: the layer order of one step, repeated every step (a layer may
//   appear more than once; a layer absent from it is paged on demand only). Everything
//   resident when the aligned layers fit the budget. Otherwise the ring needs
//   (prefetch_depth + 1) slots of the largest streamed layer; the rest of the budget keeps
//   resident the layers worth most per byte of budget (uses per step, then size), chosen
//   over every candidate "largest streamed size" to minimise the bytes streamed per step.
//   When the budget cannot hold depth + 1 slots, the depth is lowered (a warning says so);
//   a layer larger than the budget, a zero budget or a zero-byte layer is an error.
//
// The plan check (warnings)
//   The depth was lowered; or no prefetch at all (one slot: every copy waits for the
//   compute before it); or, with an estimate of copy time / compute time per streamed
//   layer (copy_to_compute_ratio > 1), a run of R consecutive streamed layers that the
//   prefetch cannot cover: the copy engine needs R * ratio layer-computes of time and the
//   depth gives it R + depth, so the compute waits when R * (ratio - 1) > depth.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace vram {

struct PagerPlanOptions {
  std::size_t budget_bytes = 0;
  std::size_t prefetch_depth = 1;
  std::size_t alignment = 256;  // every layer's place in the arena starts aligned to this
  // Estimated copy time / compute time of a streamed layer; 0: unknown (no run check).
  double copy_to_compute_ratio = 0;
};

struct PagerPlan {
  std::vector<std::size_t> layer_bytes;     // as given
  std::vector<std::size_t> schedule;        // one step, layer indices (validated)
  std::vector<bool> resident;               // per layer: kept in VRAM for good
  std::vector<std::size_t> offset;          // per resident layer: its place in the arena
  std::size_t resident_bytes = 0;           // aligned, at the start of the arena
  std::size_t slot_bytes = 0;               // aligned largest streamed layer (0: no ring)
  std::size_t slot_count = 0;               // prefetch_depth + 1 (0: everything resident)
  std::size_t arena_bytes = 0;              // resident_bytes + slot_count * slot_bytes <= budget
  std::size_t prefetch_depth = 0;           // effective depth (<= the requested one)
  std::size_t streamed_bytes_per_step = 0;  // bytes of the streamed layers' uses in one step
  std::size_t longest_streamed_run = 0;     // consecutive streamed uses in the cyclic step
  std::vector<std::string> warnings;        // the plan check; empty when nothing to say

  std::size_t slot_offset(std::size_t slot) const noexcept {
    return resident_bytes + slot * slot_bytes;
  }
  std::size_t streamed_layers() const noexcept;
};

// Throws vram::InvalidArgument: no layers, a zero-byte layer, budget 0, a layer larger
// than the budget, a schedule entry out of range. An empty schedule means 0, 1, ..., n-1.
PagerPlan plan_residency(std::vector<std::size_t> layer_bytes, std::vector<std::size_t> schedule,
                         const PagerPlanOptions& options);

enum class EvictionPolicy { belady, lru };

// The pager's bookkeeping for one plan: where each layer is, which slots may be reused, the
// position in the schedule. Not thread-safe (the WeightPager holds its lock around it).
// Warm path: acquire() and release() allocate nothing (the page-in list is reserved).
class PagerSchedule {
 public:
  static constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();

  struct PageIn {
    std::size_t layer;
    std::size_t slot;
    bool prefetch;  // issued ahead of its acquire
  };
  struct Acquired {
    bool resident = false;
    std::size_t slot = kNone;          // the slot holding the layer when not resident
    bool hit = false;                  // no page-in had to be issued for this acquire
    std::span<const PageIn> page_ins;  // to issue now, in order; valid until the next call
  };

  explicit PagerSchedule(PagerPlan plan, EvictionPolicy policy = EvictionPolicy::belady);

  const PagerPlan& plan() const noexcept { return plan_; }

  // Throws vram::InvalidArgument for a layer out of range, vram::OutOfMemory when every slot
  // holds a layer still acquired (release some first). On a throw nothing changed.
  Acquired acquire(std::size_t layer);
  // Returns the slot the layer occupies (kNone when resident). Throws InvalidArgument when
  // the layer is not acquired (nothing changes).
  std::size_t release(std::size_t layer);

  std::size_t slot_of(std::size_t layer) const noexcept { return where_[layer]; }
  std::size_t acquired_count(std::size_t layer) const noexcept { return holds_[layer]; }
  std::size_t layers_acquired() const noexcept;
  std::size_t cursor() const noexcept { return cursor_; }

 private:
  std::size_t next_use(std::size_t layer, std::size_t from) const noexcept;
  std::size_t advance_cursor(std::size_t layer) const noexcept;
  // The slot to page `layer` into, or kNone. `needed_in` is the distance of `layer`'s use.
  std::size_t choose_slot(std::size_t needed_in, std::size_t cursor) const noexcept;
  void place(std::size_t layer, std::size_t slot, bool prefetch);

  PagerPlan plan_;
  EvictionPolicy policy_;
  std::vector<std::vector<std::size_t>> uses_;  // per layer: its positions in the schedule
  std::vector<std::size_t> where_;              // per layer: slot or kNone
  std::vector<std::size_t> occupant_;           // per slot: layer or kNone
  std::vector<std::size_t> holds_;              // per layer: acquire count
  std::vector<std::uint64_t> last_used_;        // per slot: LRU clock of its last acquire
  std::vector<PageIn> page_ins_;                // reserved: depth + 1
  std::size_t cursor_ = kNone;                  // schedule position of the last acquire
  std::uint64_t clock_ = 0;
};

}  // namespace vram
