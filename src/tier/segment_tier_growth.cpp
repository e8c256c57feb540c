// How a SegmentTier takes memory from its upstream (a segment, or granules of its reserved
// range) and gives it back. Every function here runs under the tier's mutex, but the
// driver and upstream calls of a growth mutex holder (segment_tier.hpp): grow_segment(),
// reserve_range(), map_runs() and available_unlocked() release it for them, and so do the
// fences and waits of reclaim(), unmap_before_mapping() and wait_for_empty_segments();
// memory given back goes off the books here and to the upstream in give_back_detached().
#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "segment_tier.hpp"
#include "vram/cuda/error.hpp"

namespace vram::detail {

std::size_t SegmentTier::segment_size_for(std::size_t bytes) const noexcept {
  const std::size_t rounding = options_.segment_rounding;
  std::size_t size = (bytes + rounding - 1) / rounding * rounding;
  if (bytes < options_.packed_limit) size = std::max(size, options_.packed_segment);
  return std::max(size, options_.min_segment);
}

SegmentTier::Range* SegmentTier::grow_segment(std::size_t need, Lock& locked) {
  // Nothing free fits: wholly free segments cannot serve this request. Reserved may
  // exceed the peak of used bytes by the headroom; past that, wholly free segments covering
  // the excess go back first (the smallest that covers it, else the largest ones). Giving
  // back all of them would make the next step take them again.
  std::size_t size = segment_size_for(need);
  if (const std::size_t excess = budget_.excess_after_growth(size, need)) {
    release_empty_segments_for(excess);  // off the books, into detached_
  }
  auto segment = std::make_unique<Segment>(Segment{nullptr, size, nullptr});
  segments_.reserve(segments_.size() + 1);  // only the growth mutex holder adds segments
  locked.unlock();
  give_back_detached();  // their memory may be what the new segment needs
  void* base = nullptr;
  std::uint64_t failed = 0;
  try {
    try {
      base = allocate_non_null(upstream_, size);
    } catch (const OutOfMemory&) {
      if (size == need) throw;
      ++failed;
      size = need;  // a segment of just this block may still fit
      base = allocate_non_null(upstream_, size);
    }
  } catch (...) {
    locked.lock();
    budget_.counters().failed_upstream_allocations += failed + 1;
    throw;
  }
  locked.lock();
  budget_.counters().failed_upstream_allocations += failed;
  // Other threads used the spares meanwhile: again before any change.
  try {
    reserve_spares();
  } catch (...) {
    locked.unlock();
    upstream_.deallocate(base, size);
    locked.lock();
    throw;
  }
  segment->size = size;
  segment->base = static_cast<char*>(base);
  Range* whole = ranges_.take_range();  // kept spare
  *whole = Range{segment->base, size, segment.get()};
  segment->first = whole;
  segments_.push_back(segment.release());
  ++budget_.counters().segments;
  budget_.add_reserved(size);
  return whole;
}

// Virtual mode: granules at or above mapped_high() were never mapped, so no work can use
// them whatever the tag of the range they sit in. When the last range of the reservation
// is a stream's (tagged, or pending on its marker) and nothing else fits, its never-mapped
// part is split off as an untagged range for the request.
SegmentTier::Range* SegmentTier::fresh_tail(std::size_t need) noexcept {
  char* const base = map_.base();
  if (base == nullptr || segments_.empty()) return nullptr;
  Range* last = segments_.front()->first;
  while (last->next != nullptr) last = last->next;
  if (last->state == Range::State::used || last->tag == kUntagged) return nullptr;
  const std::size_t granule = map_.granule();
  char* end = last->addr + last->size;
  char* fresh = std::max(map_.mapped_end(), last->addr);
  fresh = base + (static_cast<std::size_t>(fresh - base) + granule - 1) / granule * granule;
  if (fresh <= last->addr || fresh >= end || static_cast<std::size_t>(end - fresh) < need) {
    return nullptr;
  }
  return ranges_.split_off_untagged(last, fresh);
}

void SegmentTier::reserve_range(Lock& locked) {
  const std::size_t bytes = map_.prepare();  // the run tables: nobody reads them before base()
  auto segment = std::make_unique<Segment>(Segment{nullptr, bytes, nullptr});
  auto whole = std::make_unique<Range>(Range{nullptr, bytes, nullptr});
  segments_.reserve(segments_.size() + 1);
  // The driver call with the mutex released: until base() is set, every request grows,
  // that is, waits for the growth mutex this thread holds.
  locked.unlock();
  char* base = nullptr;
  try {
    base = map_.reserve_now(bytes);
  } catch (...) {
    locked.lock();
    throw;
  }
  locked.lock();
  map_.set_base(base);
  segment->base = base;
  whole->addr = base;
  whole->segment = segment.get();
  segment->first = whole.get();
  segments_.push_back(segment.release());
  ranges_.untagged().insert(whole.release());
  ++budget_.counters().segments;
}

void SegmentTier::reclaim(std::size_t keep_free, const Range* except, Lock& locked) noexcept {
  // Stream-tagged free ranges may still be used by queued work: fence every stream and
  // untag what has completed (without blocking), so that its granules can be unmapped.
  fence_all_unlocked(locked);
  map_.unmap_free(ranges_.untagged(), keep_free, except, &detached_);
}

// The runs to map for `range`: each stretch of unmapped granules in [first, last], at most
// `cap` granules long.
static void plan_runs(const GranuleMap& map, std::size_t first, std::size_t last, std::size_t cap,
                      std::vector<std::pair<std::size_t, std::size_t>>& runs) {
  for (std::size_t g = first; g <= last;) {
    if (map.mapped(g)) {
      ++g;
      continue;
    }
    std::size_t end = g;
    while (end <= last && !map.mapped(end) && end - g < cap) ++end;
    runs.emplace_back(g, end);
    g = end;
  }
}

// The growth budget the tiers share (ReservedGauge), with unmap_before_map: past it, free
// runs go back before new ones are mapped. Below it, mapped free granules stay for reuse,
// so a loop that frees and reallocates makes no driver call.
void SegmentTier::unmap_before_mapping(const Range* range, std::size_t new_granules,
                                       Lock& locked) noexcept {
  if (!options_.unmap_before_map) return;
  const std::size_t grow = new_granules * map_.granule();
  if (budget_.excess_after_growth(grow, range->size) == 0) return;
  fence_all_unlocked(locked);  // releases the mutex: the figures again after it
  if (const std::size_t excess = budget_.excess_after_growth(grow, range->size)) {
    const std::size_t free_bytes = budget_.free_bytes();
    map_.unmap_free(ranges_.untagged(), free_bytes > excess ? free_bytes - excess : 0, range,
                    &detached_);
  }
}

void SegmentTier::map_range(Range* range, Lock& locked) {
  // `range` is this thread's (used) and only this thread maps or unmaps: the granules
  // planned below stay unmapped, and nobody else maps them, while the mutex is released.
  const std::size_t first = map_.granule_of(range->addr);
  const std::size_t block_last = map_.granule_of(range->addr + range->size - 1);
  if (!map_.all_mapped(first, block_last)) {
    const std::size_t available = available_unlocked(locked);
    const std::size_t new_granules = map_.unmapped_granules(first, block_last);
    unmap_before_mapping(range, new_granules, locked);  // into detached_
    const std::size_t cap = map_.run_granule_cap(available);
    const std::size_t last = map_.map_ahead_end(range, block_last, new_granules, cap, available);
    if (!map_runs(first, last, cap, locked, /*last_try=*/false)) {
      // Out of memory: without map-ahead first (only the block's granules are needed), then
      // after every free run (but this range's) went back: the one try that throws.
      ++budget_.counters().failed_upstream_allocations;
      if (last == block_last || !map_runs(first, block_last, cap, locked, /*last_try=*/false)) {
        if (last != block_last) ++budget_.counters().failed_upstream_allocations;
        reclaim(0, range, locked);
        const std::size_t retry_cap = map_.run_granule_cap(available_unlocked(locked));
        (void)map_runs(first, block_last, retry_cap, locked, /*last_try=*/true);
      }
    }
  }
  live_.reserve_one();  // other threads filed blocks meanwhile
}

std::size_t SegmentTier::available_unlocked(Lock& locked) noexcept {
  locked.unlock();
  const std::size_t available = options_.virtual_memory->available_bytes();
  locked.lock();
  return available;
}

bool SegmentTier::map_runs(std::size_t first, std::size_t last, std::size_t cap, Lock& locked,
                           bool last_try) {
  // Each stretch of unmapped granules in [first, last] is one run: one physical allocation
  // and one map, however many granules it spans, up to `cap`.
  std::vector<std::pair<std::size_t, std::size_t>> runs;
  std::vector<std::uint64_t> handles;
  plan_runs(map_, first, last, cap, runs);  // may throw bad_alloc: nothing mapped yet
  handles.reserve(runs.size());
  // The driver calls with the mutex released. Meanwhile the planned granules read as
  // unmapped: a request over them grows (waits for the growth mutex), nobody unmaps them.
  locked.unlock();
  give_back_detached();  // reclaimed runs first: their memory may be what the maps need
  // What mapped goes on the books, whatever failed after it.
  auto relock_and_commit = [&]() noexcept {
    locked.lock();
    for (std::size_t i = 0; i < handles.size(); ++i) {
      map_.commit_run(runs[i].first, runs[i].second, handles[i]);
    }
  };
  try {
    for (const auto& [g, end] : runs) {
      handles.push_back(map_.map_now(g, end));  // reserved: no throw of its own
    }
  } catch (const OutOfMemory&) {
    relock_and_commit();
    if (!last_try) return false;
    ++budget_.counters().failed_upstream_allocations;
    throw;
  } catch (...) {  // another driver error: the range goes back (allocate_growing)
    relock_and_commit();
    ++budget_.counters().failed_upstream_allocations;
    throw;
  }
  relock_and_commit();
  return true;
}

void SegmentTier::give_back(std::size_t keep_free) noexcept {
  if (map_.base() != nullptr) {
    map_.unmap_free(ranges_.untagged(), keep_free, nullptr, &detached_);
  } else {
    release_empty_segments(keep_free);
  }
}

SegmentTier::Growth::~Growth() {
  if (!tier_.detached_.empty()) tier_.give_back_detached();
  tier_.end_growth();
}

void SegmentTier::end_growth() noexcept {
  for (;;) {
    Lock locked = lock();
    if (!give_back_owed_) {
      // Under the tier's mutex: a free that finds the growth mutex held after this check
      // cannot happen, so no give-back is owed to nobody.
      grow_mutex_.unlock();
      return;
    }
    give_back_owed_ = false;
    give_back(options_.max_free_bytes);
    locked.unlock();
    give_back_detached();
  }
}

void SegmentTier::give_back_detached() noexcept {
  const bool runs = map_.base() != nullptr;  // set once, by a growth mutex holder
  for (const DetachedMemory& gone : detached_) {
    if (runs) {
      map_.unmap_detached(gone);
    } else {
      upstream_.deallocate(gone.addr, gone.bytes);
    }
  }
  detached_.clear();
}

bool SegmentTier::wait_for_empty_segments(std::size_t need, Lock& locked) noexcept {
  if (map_.base() != nullptr) return false;
  // A wholly free segment whose range is still stream-tagged (or pending) may be read by
  // work queued on that stream: fence that stream and wait for its marker, after which
  // the segment can serve any request or go back. Only growing waits (the slow path
  // already: an upstream allocation, and a device upstream's free synchronizes the device
  // anyway); without it a pool driven only through allocate_async/deallocate_async would
  // never give a segment back before growing and would hold far more than is live.
  // need > 0: only segments that could serve a request of `need` bytes (fit()'s rule).
  auto could_serve = [this, need](const Range* only) {
    return need == 0 || (only->size >= need && only->size - need <= options_.max_segment_waste);
  };
  for (const Segment* segment : segments_) {
    const Range* only = segment->first;
    if (only->next != nullptr || only->state != Range::State::free || only->tag == kUntagged ||
        !could_serve(only)) {
      continue;
    }
    tags_.fence(only->tag);
  }
  // With the mutex released; a marker complete at once untags its segment already: the
  // caller fits again then too.
  const bool recorded = record_listed(locked);
  // Only the markers of wholly free segments are waited for (a pending range that fills its
  // segment has no neighbour to merge with, so "wholly free" cannot change while it waits);
  // other pending markers wait for the next poll.
  const bool waited = wait_unlocked(locked, kUntagged, [&could_serve](const Range* r) {
    return r->prev == nullptr && r->next == nullptr && could_serve(r);
  });
  return recorded || waited;
}

void SegmentTier::release_segment(Segment* segment) noexcept {
  const DetachedMemory gone{segment->base, segment->size, 0};
  --budget_.counters().segments;
  budget_.sub_reserved(segment->size);
  ranges_.recycle(segment->first);
  delete segment;
  try {
    detached_.push_back(gone);
  } catch (...) {  // no host memory for the list: back now, under the mutex
    upstream_.deallocate(gone.addr, gone.bytes);
  }
}

void SegmentTier::release_empty_segments(std::size_t keep_free) noexcept {
  if (map_.base() != nullptr) return;  // virtual mode: granules, not segments, go back
  for (std::size_t i = 0; i < segments_.size() && budget_.free_bytes() > keep_free;) {
    Segment* segment = segments_[i];
    if (segment->idle()) {
      ranges_.remove_free(segment->first);
      release_segment(segment);
      segments_[i] = segments_.back();
      segments_.pop_back();
    } else {
      ++i;
    }
  }
}

std::size_t SegmentTier::release_empty_segments_for(std::size_t bytes) noexcept {
  if (map_.base() != nullptr || bytes == 0) return 0;
  // The smallest wholly free segment that covers `bytes`; else the largest ones until
  // they do (or none is left).
  std::vector<Segment*> empty;
  try {
    for (Segment* segment : segments_) {
      if (segment->idle()) empty.push_back(segment);
    }
  } catch (...) {  // no host memory for the list: give back every wholly free segment
    const std::size_t before = budget_.reserved();
    release_empty_segments(0);
    return before - budget_.reserved();
  }
  std::sort(empty.begin(), empty.end(),
            [](const Segment* a, const Segment* b) { return a->size < b->size; });
  auto cover = std::lower_bound(empty.begin(), empty.end(), bytes,
                                [](const Segment* s, std::size_t n) { return s->size < n; });
  if (cover != empty.end()) {
    empty.assign(1, *cover);
  } else {
    std::reverse(empty.begin(), empty.end());
  }
  std::size_t released = 0;
  for (Segment* segment : empty) {
    if (released >= bytes) break;
    released += segment->size;
    ranges_.remove_free(segment->first);
    segments_.erase(std::find(segments_.begin(), segments_.end(), segment));
    release_segment(segment);
  }
  return released;
}

}  // namespace vram::detail
