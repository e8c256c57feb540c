#include "vram/pager_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <string>

#include "vram/cuda/error.hpp"

namespace vram {
namespace {

std::string mib(std::size_t bytes) {
  const double value = static_cast<double>(bytes) / double(1 << 20);
  char text[64];
  std::snprintf(text, sizeof text, "%.1f MiB", value);
  return text;
}

bool overflows_round_up(std::size_t bytes, std::size_t alignment) {
  return bytes > std::numeric_limits<std::size_t>::max() - alignment;
}

std::size_t round_up(std::size_t bytes, std::size_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

}  // namespace

std::size_t PagerPlan::streamed_layers() const noexcept {
  return static_cast<std::size_t>(std::count(resident.begin(), resident.end(), false));
}

PagerPlan plan_residency(std::vector<std::size_t> layer_bytes, std::vector<std::size_t> schedule,
                         const PagerPlanOptions& options) {
  const std::size_t n = layer_bytes.size();
  if (n == 0) throw InvalidArgument("vram::WeightPager: no layers. Fix: give at least one layer.");
  if (options.budget_bytes == 0) {
    throw InvalidArgument(
        "vram::WeightPager: VRAM budget of 0 bytes. Fix: set budget_bytes to at least the "
        "largest layer (plus one more layer for prefetch).");
  }
  // The ratio only shapes a warning, but a value that is no ratio is a caller's mistake
  // (NaN, negative, infinite, or a unit error: a copy a million times its compute).
  if (const double ratio = options.copy_to_compute_ratio; !(ratio >= 0) || !(ratio <= 1e6)) {
    throw InvalidArgument("vram::WeightPager: copy_to_compute_ratio " + std::to_string(ratio) +
                          " is not a ratio of copy to compute time. Fix: 0 when unknown, else "
                          "the time to copy a layer over the time to compute it (0 to 1e6).");
  }
  const std::size_t alignment = options.alignment == 0 ? 1 : options.alignment;
  std::vector<std::size_t> aligned(n);
  std::size_t largest = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (layer_bytes[i] == 0) {
      throw InvalidArgument("vram::WeightPager: layer " + std::to_string(i) +
                            " has 0 bytes. Fix: leave empty layers out.");
    }
    if (overflows_round_up(layer_bytes[i], alignment) ||
        round_up(layer_bytes[i], alignment) > options.budget_bytes) {
      const bool by_alignment =
          !overflows_round_up(layer_bytes[i], alignment) && layer_bytes[i] <= options.budget_bytes;
      throw InvalidArgument(
          "vram::WeightPager: layer " + std::to_string(i) + " (" + std::to_string(layer_bytes[i]) +
          " bytes" +
          (by_alignment ? ", " + std::to_string(round_up(layer_bytes[i], alignment)) +
                              " at the arena's " + std::to_string(alignment) + "-byte alignment"
                        : std::string()) +
          ") does not fit the VRAM budget (" + std::to_string(options.budget_bytes) +
          " bytes). Fix: raise budget_bytes or split the layer.");
    }
    aligned[i] = round_up(layer_bytes[i], alignment);
    largest = std::max(largest, aligned[i]);
  }
  if (schedule.empty()) {
    schedule.resize(n);
    std::iota(schedule.begin(), schedule.end(), std::size_t{0});
  }
  std::vector<std::size_t> uses(n, 0);
  for (std::size_t position = 0; position < schedule.size(); ++position) {
    if (schedule[position] >= n) {
      throw InvalidArgument("vram::WeightPager: schedule position " + std::to_string(position) +
                            " names layer " + std::to_string(schedule[position]) + " of only " +
                            std::to_string(n) + ". Fix: list layer indices below the count.");
    }
    ++uses[schedule[position]];
  }

  PagerPlan plan;
  plan.layer_bytes = std::move(layer_bytes);
  plan.schedule = std::move(schedule);
  plan.resident.assign(n, false);
  plan.offset.assign(n, 0);

  // Every sum below (layers forced resident, resident bytes, bytes streamed per step) is at
  // most this total times the uses, so refusing a total past the address space keeps them
  // exact: weights that large cannot be in host memory anyway.
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  std::size_t total = 0;
  bool overflows = false;
  for (std::size_t bytes : aligned) {
    overflows = overflows || total > kMax - bytes;
    total += bytes;
  }
  const std::size_t most_uses =
      std::max<std::size_t>(1, *std::max_element(uses.begin(), uses.end()));
  if (overflows || total > kMax / most_uses) {
    throw InvalidArgument(
        "vram::WeightPager: the layers' sizes (times their uses per step) add up past the "
        "address space. Fix: give each layer's real size in bytes.");
  }
  if (total <= options.budget_bytes) {
    plan.resident.assign(n, true);  // nothing streams: no slots, no prefetch
  } else {
    // Candidates for the largest streamed (slot) size: every distinct aligned layer size.
    std::vector<std::size_t> sizes(aligned);
    std::sort(sizes.begin(), sizes.end());
    sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
    // Layers by value per byte of budget: uses per step first, then size (fewer, larger
    // layers fill the budget with less slack), then index (determinism).
    std::vector<std::size_t> by_value(n);
    std::iota(by_value.begin(), by_value.end(), std::size_t{0});
    std::stable_sort(by_value.begin(), by_value.end(), [&](std::size_t a, std::size_t b) {
      if (uses[a] != uses[b]) return uses[a] > uses[b];
      return aligned[a] > aligned[b];
    });
    bool found = false;
    std::size_t best_depth = 0;
    std::size_t best_streamed = 0;
    std::vector<bool> best_resident;
    for (std::size_t slot : sizes) {
      std::size_t forced = 0;
      for (std::size_t i = 0; i < n; ++i) {
        if (aligned[i] > slot) forced += aligned[i];
      }
      if (forced > options.budget_bytes || options.budget_bytes - forced < slot) continue;
      const std::size_t slots_fit = (options.budget_bytes - forced) / slot;
      const std::size_t depth = std::min(options.prefetch_depth, slots_fit - 1);
      std::size_t room = options.budget_bytes - forced - (depth + 1) * slot;
      std::vector<bool> resident(n, false);
      for (std::size_t i = 0; i < n; ++i) resident[i] = aligned[i] > slot;
      for (std::size_t i : by_value) {
        if (!resident[i] && aligned[i] <= room) {
          resident[i] = true;
          room -= aligned[i];
        }
      }
      std::size_t streamed = 0;
      for (std::size_t i = 0; i < n; ++i) {
        if (!resident[i]) streamed += uses[i] * plan.layer_bytes[i];
      }
      if (!found || depth > best_depth || (depth == best_depth && streamed < best_streamed)) {
        found = true;
        best_depth = depth;
        best_streamed = streamed;
        best_resident = std::move(resident);
      }
    }
    // The largest layer alone always fits (checked above), so some candidate was taken.
    plan.resident = std::move(best_resident);
    plan.prefetch_depth = best_depth;
    plan.streamed_bytes_per_step = best_streamed;
    for (std::size_t i = 0; i < n; ++i) {
      if (!plan.resident[i]) plan.slot_bytes = std::max(plan.slot_bytes, aligned[i]);
    }
    plan.slot_count = best_depth + 1;
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (!plan.resident[i]) continue;
    plan.offset[i] = plan.resident_bytes;
    plan.resident_bytes += aligned[i];
  }
  plan.arena_bytes = plan.resident_bytes + plan.slot_count * plan.slot_bytes;

  // The longest run of consecutive streamed uses in the cyclic step.
  const std::size_t length = plan.schedule.size();
  std::size_t run = 0;
  for (std::size_t k = 0; k < 2 * length && plan.slot_count > 0; ++k) {
    run = plan.resident[plan.schedule[k % length]] ? 0 : run + 1;
    plan.longest_streamed_run = std::max(plan.longest_streamed_run, std::min(run, length));
  }

  if (plan.slot_count > 0) {
    if (plan.prefetch_depth < options.prefetch_depth) {
      plan.warnings.push_back(
          "vram::WeightPager plan: prefetch depth lowered from " +
          std::to_string(options.prefetch_depth) + " to " + std::to_string(plan.prefetch_depth) +
          ": the budget (" + mib(options.budget_bytes) + ") holds only " +
          std::to_string(plan.slot_count) + " slot(s) of " + mib(plan.slot_bytes) +
          " beside the layers that must stay resident. Fix: raise budget_bytes.");
    }
    if (plan.prefetch_depth == 0) {
      plan.warnings.push_back(
          "vram::WeightPager plan: no prefetch (one slot): every page-in waits for the compute "
          "of the layer before it. Fix: a budget of at least 2 x " +
          mib(plan.slot_bytes) + " beside the resident layers.");
    }
    const double ratio = options.copy_to_compute_ratio;
    const double run_length = static_cast<double>(plan.longest_streamed_run);
    if (ratio > 1 && run_length * (ratio - 1) > static_cast<double>(plan.prefetch_depth)) {
      const auto needed = static_cast<std::size_t>(std::ceil(run_length * (ratio - 1)));
      plan.warnings.push_back(
          "vram::WeightPager plan: prefetch depth " + std::to_string(plan.prefetch_depth) +
          " cannot cover a run of " + std::to_string(plan.longest_streamed_run) +
          " consecutive streamed layers at copy/compute ratio " + std::to_string(ratio) +
          ": the compute will wait for copies (counted as stalls). Covering it needs depth >= " +
          std::to_string(needed) + " (more budget), or the step is copy-bound anyway.");
    }
  }
  return plan;
}

// ---------------------------------------------------------------------------------------

PagerSchedule::PagerSchedule(PagerPlan plan, EvictionPolicy policy)
    : plan_(std::move(plan)), policy_(policy) {
  const std::size_t n = plan_.layer_bytes.size();
  // A plan from plan_residency is consistent; one made or edited by hand is checked first.
  const auto refuse = [](const std::string& what) {
    throw InvalidArgument("vram::PagerSchedule: the plan " + what +
                          ". Fix: build plans with vram::plan_residency.");
  };
  if (n == 0) refuse("has no layers");
  if (plan_.resident.size() != n || plan_.offset.size() != n) {
    refuse("has " + std::to_string(n) + " layer sizes but " +
           std::to_string(plan_.resident.size()) + " residency flags and " +
           std::to_string(plan_.offset.size()) + " offsets");
  }
  if (plan_.schedule.empty()) refuse("has an empty schedule");
  for (std::size_t position = 0; position < plan_.schedule.size(); ++position) {
    if (plan_.schedule[position] >= n) {
      refuse("schedule position " + std::to_string(position) + " names layer " +
             std::to_string(plan_.schedule[position]) + " of only " + std::to_string(n));
    }
  }
  const bool streams =
      std::find(plan_.resident.begin(), plan_.resident.end(), false) != plan_.resident.end();
  if (streams && (plan_.prefetch_depth >= plan_.slot_count)) {
    refuse("streams layers with " + std::to_string(plan_.slot_count) +
           " slot(s) and prefetch depth " + std::to_string(plan_.prefetch_depth) +
           " (it needs depth + 1 slots)");
  }
  uses_.resize(n);
  for (std::size_t position = 0; position < plan_.schedule.size(); ++position) {
    uses_[plan_.schedule[position]].push_back(position);
  }
  where_.assign(n, kNone);
  holds_.assign(n, 0);
  occupant_.assign(plan_.slot_count, kNone);
  last_used_.assign(plan_.slot_count, 0);
  page_ins_.reserve(plan_.prefetch_depth + 1);
}

std::size_t PagerSchedule::next_use(std::size_t layer, std::size_t from) const noexcept {
  const auto& positions = uses_[layer];
  if (positions.empty()) return kNone;  // never used again: the best victim
  const std::size_t length = plan_.schedule.size();
  if (from == kNone) return positions.front() + 1;  // before position 0
  auto next = std::upper_bound(positions.begin(), positions.end(), from);
  if (next != positions.end()) return *next - from;
  return positions.front() + length - from;
}

std::size_t PagerSchedule::advance_cursor(std::size_t layer) const noexcept {
  const auto& positions = uses_[layer];
  if (positions.empty()) return cursor_;  // off-schedule: the schedule position stays
  if (cursor_ != kNone && plan_.schedule[cursor_] == layer) return cursor_;
  const std::size_t distance = next_use(layer, cursor_);
  const std::size_t start = cursor_ == kNone ? plan_.schedule.size() - 1 : cursor_;
  return (start + distance) % plan_.schedule.size();
}

std::size_t PagerSchedule::choose_slot(std::size_t needed_in, std::size_t cursor) const noexcept {
  std::size_t best = kNone;
  std::size_t best_distance = 0;
  std::uint64_t best_clock = 0;
  for (std::size_t slot = 0; slot < occupant_.size(); ++slot) {
    const std::size_t layer = occupant_[slot];
    if (layer == kNone) return slot;  // an empty slot: nothing to evict
    if (holds_[layer] > 0) continue;  // still acquired: never evicted
    // A layer needed no later than the one being paged in stays (evicting it would page
    // it in again before the new one is used): Belady's rule, applied to both policies.
    const std::size_t distance = next_use(layer, cursor);
    if (distance <= needed_in) continue;
    if (policy_ == EvictionPolicy::belady) {
      if (best == kNone || distance > best_distance) {
        best = slot;
        best_distance = distance;
      }
    } else if (best == kNone || last_used_[slot] < best_clock) {
      best = slot;
      best_clock = last_used_[slot];
    }
  }
  return best;
}

void PagerSchedule::place(std::size_t layer, std::size_t slot, bool prefetch) {
  if (occupant_[slot] != kNone) where_[occupant_[slot]] = kNone;
  occupant_[slot] = layer;
  where_[layer] = slot;
  last_used_[slot] = ++clock_;
  page_ins_.push_back(PageIn{layer, slot, prefetch});  // within the reserved capacity
}

PagerSchedule::Acquired PagerSchedule::acquire(std::size_t layer) {
  if (layer >= where_.size()) {
    throw InvalidArgument("vram::WeightPager: acquire of layer " + std::to_string(layer) +
                          " out of " + std::to_string(where_.size()) + " layers.");
  }
  page_ins_.clear();
  Acquired result;
  const std::size_t cursor = advance_cursor(layer);
  if (plan_.resident[layer]) {
    result.resident = true;
    result.hit = true;
  } else {
    std::size_t slot = where_[layer];
    result.hit = slot != kNone;
    if (slot == kNone) {
      slot = choose_slot(0, cursor);
      if (slot == kNone) {
        throw OutOfMemory(plan_.layer_bytes[layer], 0, plan_.slot_count * plan_.slot_bytes,
                          "vram::WeightPager: every one of the " +
                              std::to_string(plan_.slot_count) +
                              " streaming slots holds a layer still acquired. Fix: release "
                              "layers before acquiring more, or raise prefetch_depth (slots).");
      }
      place(layer, slot, false);
    }
    last_used_[slot] = ++clock_;
    result.slot = slot;
  }
  ++holds_[layer];
  cursor_ = cursor;
  // Prefetch the next streamed layers of the schedule, nearest first.
  if (cursor_ != kNone && !uses_[layer].empty()) {
    const std::size_t length = plan_.schedule.size();
    const std::size_t ahead = std::min(plan_.prefetch_depth, length - 1);
    for (std::size_t k = 1; k <= ahead; ++k) {
      const std::size_t next = plan_.schedule[(cursor_ + k) % length];
      if (plan_.resident[next] || where_[next] != kNone) continue;
      const std::size_t slot = choose_slot(k, cursor_);
      if (slot == kNone) break;  // no slot to spare: it is paged in when acquired
      place(next, slot, true);
    }
  }
  result.page_ins = std::span<const PageIn>(page_ins_.data(), page_ins_.size());
  return result;
}

std::size_t PagerSchedule::release(std::size_t layer) {
  if (layer >= holds_.size() || holds_[layer] == 0) {
    throw InvalidArgument("vram::WeightPager: release of layer " + std::to_string(layer) +
                          " that is not acquired. Fix: release each acquire exactly once.");
  }
  --holds_[layer];
  return plan_.resident[layer] ? kNone : where_[layer];
}

std::size_t PagerSchedule::layers_acquired() const noexcept {
  return static_cast<std::size_t>(
      std::count_if(holds_.begin(), holds_.end(), [](std::size_t h) { return h > 0; }));
}

}  // namespace vram
