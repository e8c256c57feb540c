#include "granule_map.hpp"

#include <algorithm>
#include <string>

#include "vram/cuda/error.hpp"

namespace vram::detail {

GranuleMap::GranuleMap(const Options& options, GrowthBudget& budget)
    : options_(options), budget_(budget) {
  if (options_.virtual_memory != nullptr) {
    granule_ = options_.virtual_memory->granularity();
    if (!std::has_single_bit(granule_)) {
      throw InvalidArgument("vram::DevicePool: virtual memory granularity " +
                            std::to_string(granule_) + " is not a power of two");
    }
    granule_shift_ = static_cast<unsigned>(std::countr_zero(granule_));
  }
}

std::size_t GranuleMap::prepare() {
  const std::size_t bytes = options_.reservation / granule_ * granule_;
  const std::size_t granules = bytes / granule_;
  handles_.assign(granules, 0);
  run_granules_.assign(granules, 0);
  run_of_.assign(granules, kNoRun);
  mapped_bits_.assign((granules + 63) / 64, 0);
  return bytes;
}

void GranuleMap::release() noexcept {
  if (base_ == nullptr) return;
  for (std::size_t g = 0; g < run_of_.size(); ++g) {
    if (run_of_[g] != g) continue;
    const std::size_t bytes = run_granules_[g] * granule_;
    options_.virtual_memory->unmap(base_ + g * granule_, bytes, handles_[g]);
    budget_.forget_reserved(bytes);
  }
  // prepare()'s bytes: one table entry per granule reserved
  options_.virtual_memory->unreserve(base_, run_of_.size() * granule_);
}

// A map costs about the same for a short run as for a long one, so long runs make a pool
// that starts empty cheap to fill. But a run goes back only whole: one block left in it
// keeps it all mapped. Far from the end of physical memory that costs nothing (nothing is
// unmapped); near it, the unmaps that make room for a new run must find whole free runs.
// So a run is at most 1/kRunShareOfAvailable of the physical memory still available (and
// at most max_run_bytes): runs shrink to single granules as memory runs out.
std::size_t GranuleMap::run_granule_cap(std::size_t available) const noexcept {
  const std::size_t bytes = std::min(options_.max_run_bytes, available / kRunShareOfAvailable);
  return std::max<std::size_t>(1, bytes / granule_);
}

// Map-ahead: the map a block needs anyway also covers granules of the free range right
// after it, so that a tier growing in many small steps makes few maps. Bounds:
// options_.map_ahead_bytes; 1/4 of what the tier holds (growth stays geometric: a steady
// workload whose peak the tier already holds needs no map at all); the run's cap (no extra
// map for it); only granules wholly inside that range and only when it is untagged (a
// stream's free range stays its own); and only while the tier holds at most 1/4 of the
// physical memory still available, so near the end of memory (where a reclaim must find
// whole free runs) every granule mapped is one a block needs. The extra granules count as
// reserved and free, and serve later blocks. If the map fails (out of memory), the tier
// drops them before reclaiming anything: the available figure may be unknown (SIZE_MAX)
// or stale, and map-ahead must never make a block that fits fail.
std::size_t GranuleMap::map_ahead_end(const Range* range, std::size_t last,
                                      std::size_t new_granules, std::size_t cap,
                                      std::size_t available) const noexcept {
  const Range* next = range->next;
  // Not with unmap_before_map (its growth budget keeps reserved at what is used), not for a
  // stream's range, and only where the extra granules extend the block's last run (mapped
  // last granule: they would be a run, a map, of their own).
  if (options_.map_ahead_bytes == 0 || options_.unmap_before_map || next == nullptr ||
      next->state != Range::State::free || next->tag != kUntagged || new_granules >= cap ||
      mapped(last)) {
    return last;
  }
  const std::size_t held = budget_.reserved();
  if (available / 4 < held) return last;
  // Only for a block that raises the tier's peak of used bytes since it last gave granules
  // back (a workload still growing; after an unmap, growing again is too). Below that peak
  // the tier grows because its free memory is in the wrong places: extra granules would
  // stay reserved for good.
  if (!budget_.raises_ahead_peak(range->size)) return last;
  // Free bytes after this map without map-ahead; the extra granules are free bytes too and
  // stay within max_free_bytes (they share a run with the block, so a free cannot unmap
  // them to honour it).
  const std::size_t free_after = held + new_granules * granule_ - budget_.used() - range->size;
  if (free_after >= options_.max_free_bytes) return last;
  const std::size_t ahead =
      std::min({options_.map_ahead_bytes, held / 4, (cap - new_granules) * granule_, next->size,
                options_.max_free_bytes - free_after});
  // Granules wholly below next->addr + ahead (those after `last` start at or past
  // next->addr, which is where the range ends), up to the first one already mapped.
  const std::size_t end = granule_of(next->addr + ahead);
  std::size_t extended = last;
  while (extended + 1 < end && !mapped(extended + 1)) ++extended;
  return extended;
}

void GranuleMap::commit_run(std::size_t first, std::size_t end, std::uint64_t handle) noexcept {
  const std::size_t bytes = (end - first) * granule_;
  for (std::size_t k = first; k < end; ++k) run_of_[k] = first;
  set_mapped_bits(first, end, true);
  run_granules_[first] = end - first;
  handles_[first] = handle;
  mapped_high_ = std::max(mapped_high_, end);
  ++budget_.counters().maps;
  budget_.add_reserved(bytes);
}

void GranuleMap::set_mapped_bits(std::size_t first, std::size_t end, bool mapped) noexcept {
  for (std::size_t g = first; g < end; ++g) {
    const std::uint64_t bit = std::uint64_t{1} << (g % 64);
    if (mapped) {
      mapped_bits_[g / 64] |= bit;
    } else {
      mapped_bits_[g / 64] &= ~bit;
    }
  }
}

DetachedMemory GranuleMap::detach_run(std::size_t first) noexcept {
  const std::size_t granules = run_granules_[first];
  const std::size_t bytes = granules * granule_;
  const DetachedMemory run{base_ + first * granule_, bytes, handles_[first]};
  for (std::size_t k = first; k < first + granules; ++k) run_of_[k] = kNoRun;
  set_mapped_bits(first, first + granules, false);
  run_granules_[first] = 0;
  budget_.sub_reserved(bytes);
  budget_.restart_ahead_peak();
  return run;
}

void GranuleMap::unmap_free(const FreeRanges::Index& untagged, std::size_t keep_free,
                            const Range* except, std::vector<DetachedMemory>* detached) noexcept {
  // In ascending (size, address) order: the smallest free ranges go back first.
  untagged.for_each_ordered(scratch_, [&](const Range* r) noexcept {
    if (budget_.free_bytes() <= keep_free) return false;
    if (r == except) return true;
    const auto begin = static_cast<std::size_t>(r->addr - base_);
    const std::size_t first = (begin + granule_ - 1) / granule_;
    const std::size_t end = std::min((begin + r->size) / granule_, mapped_high_);  // wholly inside
    for (std::size_t g = first; g < end && budget_.free_bytes() > keep_free;) {
      if (!mapped(g)) {
        ++g;
        continue;
      }
      const std::size_t run = run_of_[g];
      const std::size_t next = run + run_granules_[run];
      if (run >= first && next <= end) {
        const DetachedMemory gone = detach_run(run);
        bool later = false;
        if (detached != nullptr) {
          try {
            detached->push_back(gone);
            later = true;
          } catch (...) {  // no host memory for the list: unmapped now, under the mutex
          }
        }
        if (!later) unmap_detached(gone);
      }
      g = next;
    }
    return true;
  });
}

}  // namespace vram::detail
