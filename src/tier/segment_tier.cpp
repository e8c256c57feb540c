#include "segment_tier.hpp"

#include <algorithm>
#include <cassert>
#include <memory>
#include <vector>

#include "vram/cuda/error.hpp"

namespace vram::detail {

SegmentTier::SegmentTier(Upstream& upstream, StreamFence& fence, ReservedGauge& gauge,
                         Options options)
    : upstream_(upstream),
      options_(options),
      budget_(gauge, options.growth_headroom_1024),
      ranges_(options.granularity),
      map_(GranuleMap::Options{options.virtual_memory, options.reservation, options.max_run_bytes,
                               options.map_ahead_bytes, options.max_free_bytes,
                               options.unmap_before_map},
           budget_),
      tags_(fence, ranges_, map_, options.wants) {}

SegmentTier::~SegmentTier() {
  tags_.release_markers();
  map_.release();
  for (Segment* segment : segments_) {
    if (segment->base != map_.base()) {
      upstream_.deallocate(segment->base, segment->size);
      budget_.forget_reserved(segment->size);
    }
    FreeRanges::destroy(segment);
  }
}

// ---------------------------------------------------------------------------------------
// The public calls: each holds the tier's mutex for its body, but a growth mutex holder's
// upstream calls (segment_tier.hpp).

void* SegmentTier::allocate(std::size_t bytes, StreamKey stream, bool may_grow, bool* quiesce,
                            LeaseOwner* owner, StreamKey* served) {
  assert(bytes == round(bytes));
  const std::size_t need = bytes;
  if (may_grow) {
    const Growth growing(*this);  // also when growing throws or asks for a quiesce
    return allocate_growing(need, stream, quiesce, owner, served);
  }
  Lock locked = lock();
  poll_unlocked(locked);
  reserve_spares();  // before any change
  if (options_.virtual_memory != nullptr && map_.base() == nullptr) return nullptr;  // growing
  bool mapped = false;
  Range* r = fit_fenced(stream, need, mapped, locked);
  // A fit over a granule not mapped yet (or one being mapped) would be growing.
  if (r == nullptr || (map_.base() != nullptr && !mapped)) return nullptr;
  claim_fit(r, need);
  r->state = Range::State::used;
  return file_used(r, owner, served);  // reserved above
}

void* SegmentTier::allocate_growing(std::size_t need, StreamKey stream, bool* quiesce,
                                    LeaseOwner* owner, StreamKey* served) {
  Lock locked = lock();
  poll_unlocked(locked);
  reserve_spares();  // before any change (again after each release of the mutex)
  if (options_.virtual_memory != nullptr && map_.base() == nullptr) reserve_range(locked);
  bool mapped = false;  // r's granules under `need` (virtual mode), as fit() found them
  Range* r = fit_fenced(stream, need, mapped, locked);
  // Before growing: wholly free segments that wait for their streams' work are waited for
  // (see wait_for_empty_segments); one of them may serve the request. Only segments that
  // could then serve the request are worth the wait, unless growing passes the budget
  // (then any of them may have to go back).
  if (r == nullptr) {
    if (wait_for_empty_segments(past_budget(nullptr, need) ? 0 : need, locked)) {
      reserve_spares();  // the mutex was released
      r = fit(stream, need, mapped, /*fence=*/false);
    }
  }
  // Virtual mode, the same rule for other streams' free memory: fit() fenced those streams
  // before growing, and their markers may not have completed yet. Growing past the budget
  // waits for the markers of other streams (a stream's own frees are safe for it in stream
  // order) whose ranges could serve the request; within it the tier grows without
  // blocking. Without this bound, streams that each capture free memory next to their own
  // frees would make the others grow again and again.
  if (map_.base() != nullptr && tags_.any_pending() && past_budget(r, need) &&
      wait_unlocked(locked, stream,
                    [this, need](const Range* p) { return tags_.could_serve(p, need); })) {
    reserve_spares();  // the mutex was released: r may be gone, the spares used
    r = fit(stream, need, mapped, /*fence=*/false);
  }
  // (Nothing maps or unmaps between fit() and here: only this thread, holding the growth
  // mutex, does.)
  const bool needs_map = r != nullptr && map_.base() != nullptr && !mapped;
  // Growth past the budget, or to a new peak of reserved bytes, while free memory that no
  // marker can be recorded for now (streams not seen since they freed it, maybe destroyed)
  // could serve the request: the caller quiesces instead. (A new peak is reached a bounded
  // number of times: at most once per growth step of the peak.)
  if (quiesce != nullptr && (r == nullptr || needs_map) &&
      (past_budget(r, need) || budget_.raises_peak_reserved(growth_for(r, need))) &&
      tags_.stranded(stream, need, map_.base() == nullptr)) {
    *quiesce = true;
    return nullptr;
  }
  if (r != nullptr) {
    claim_fit(r, need);
  } else if (map_.base() != nullptr) {
    throw OutOfMemory(need, budget_.free_bytes(), budget_.used(),
                      "the pool's reserved address range is exhausted");
  } else {
    r = grow_segment(need, locked);  // the upstream call with the mutex released
    ranges_.split(r, need);
  }
  r->state = Range::State::used;  // before mapping: nothing may merge it meanwhile
  if (needs_map) {                // computed for this r: after the split, r->size == need
    try {
      map_range(r, locked);         // the maps with the mutex released
    } catch (const OutOfMemory&) {  // the range goes back as it was (merged with its rest)
      ranges_.insert_free(r);
      // The runs mapped for it before the failure go back too (detached: the growth's end
      // unmaps them), so a failed request leaves its memory to others. Before the last try
      // the tier gave back every other free run (reclaim), so this takes little else.
      give_back(0);
      throw;
    } catch (...) {  // another driver error, or no host memory: the range goes back as it was
      ranges_.insert_free(r);
      throw;
    }
  }
  return file_used(r, owner, served);  // reserved (again, after the mutex was released)
}

SegmentTier::Freed SegmentTier::free_keeping(void* block, StreamKey tag, std::size_t bytes,
                                             const LeaseOwner* by, FreeMarker* marker) noexcept {
  const Lock locked = lock();
  // Null for a foreign block, for null itself, for a block of another size than `bytes` (a
  // small class's released under a large size, say) and for a block its owner holds cached
  // (released to it already) when another releases it.
  assert(bytes == round(bytes));
  const std::size_t need = bytes;
  Range* r = live_.erase_if(block, [need, by](const Range* live) {
    if (need != 0 && live->size != need) return false;
    if (live->owner == by) return true;  // most frees: its owner's (or no owner's, by none)
    if (live->owner == &LeaseOwner::heap_chunks()) return false;  // a heap's chunk: by its heap
    return live->owner == nullptr || !live->owner->holds(live->addr);
  });
  if (r == nullptr) return Freed::foreign;
  if (r->owner != by && r->owner != nullptr) r->owner->revoke(block);  // its record is stale
  budget_.give(r->size);
  r->tag = tag;
  r->epoch = tags_.epoch();
  if (marker != nullptr && tag != kUntagged &&
      tags_.file_pending(r, marker->marker, marker->recorder)) {
    marker->taken = true;
    return Freed::kept;
  }
  ranges_.insert_free(r);
  return tag == kUntagged && budget_.free_bytes() > options_.max_free_bytes ? Freed::over_cap
                                                                            : Freed::kept;
}

SegmentTier::Freed SegmentTier::free_pieces(void* block, std::size_t bytes, const Piece* pieces,
                                            std::size_t count, FreeMarker* marker,
                                            StreamKey marked) noexcept {
  assert(bytes == round(bytes) && count > 0);
  const Lock locked = lock();
  try {
    ranges_.keep_spares(count + 2);  // a node per cut, the merges recycle theirs
  } catch (...) {
    return Freed::foreign;
  }
  Range* r = live_.erase_if(block, [bytes](const Range* live) {
    return live->size == bytes && live->owner == &LeaseOwner::heap_chunks();
  });
  if (r == nullptr) return Freed::foreign;
  budget_.give(r->size);
  // The one piece filed under the marker: the largest of `marked`'s.
  std::size_t pending = count;
  if (marker != nullptr && marked != kUntagged) {
    for (std::size_t i = 0; i < count; ++i) {
      if (pieces[i].tag == marked &&
          (pending == count || pieces[i].bytes > pieces[pending].bytes)) {
        pending = i;
      }
    }
  }
  bool untagged_free = false;
  for (std::size_t i = 0; i < count; ++i) {
    assert(pieces[i].bytes == round(pieces[i].bytes));
    // The last piece is what is left of r; the others are cut off its front.
    Range* rest = i + 1 < count ? ranges_.cut_used(r, pieces[i].bytes) : nullptr;
    r->tag = pieces[i].tag;
    r->epoch = tags_.epoch();
    untagged_free = untagged_free || pieces[i].tag == kUntagged;
    if (i == pending && tags_.file_pending(r, marker->marker, marker->recorder)) {
      marker->taken = true;
    } else {
      ranges_.insert_free(r);  // merges with the piece before it by the coalescing rule
    }
    r = rest;
  }
  return untagged_free && budget_.free_bytes() > options_.max_free_bytes ? Freed::over_cap
                                                                         : Freed::kept;
}

void SegmentTier::give_back_over_cap() noexcept {
  Lock locked = lock();
  if (budget_.free_bytes() <= options_.max_free_bytes) return;  // another call gave back
  // Only when no growth is under way, else it is owed to the growth mutex's holder, which
  // gives back before it lets go (end_growth); the upstream calls after the tier's mutex
  // is released. (try_lock: the lock order is not broken.)
  if (grow_mutex_.try_lock()) {
    give_back(options_.max_free_bytes);
    locked.unlock();
    give_back_detached();
    end_growth();
  } else {
    give_back_owed_ = true;
  }
}

void SegmentTier::trim(std::size_t keep_free, bool wait) noexcept {
  const Growth growing(*this);
  Lock locked = lock();
  fence_all_unlocked(locked);
  if (wait) (void)wait_unlocked(locked, kUntagged, [](const Range*) { return true; });
  give_back(keep_free);
}

std::uint64_t SegmentTier::mark_frees() noexcept {
  const Lock locked = lock();
  return tags_.mark();
}

void SegmentTier::forget_streams(std::uint64_t mark) noexcept {
  const Lock locked = lock();
  tags_.forget(mark);
}

bool SegmentTier::holds_stream(StreamKey key) const noexcept {
  const Lock locked = lock();
  return tags_.holds(key);
}

bool SegmentTier::adopt_marker(StreamKey key, std::uint64_t marker, std::uint64_t mark) noexcept {
  const Lock locked = lock();
  return tags_.adopt(key, marker, mark);
}

bool SegmentTier::stranded_segments() const noexcept {
  if (options_.virtual_memory != nullptr) return false;
  const Lock locked = lock();
  return stranded_segments_locked();
}

bool SegmentTier::stranded_segments_locked() const noexcept {
  if (options_.virtual_memory != nullptr) return false;
  for (const Segment* segment : segments_) {
    const Range* only = segment->first;
    if (only->next == nullptr && only->state == Range::State::free && only->tag != kUntagged &&
        options_.wants != nullptr && !always_recordable(only->tag)) {
      return true;
    }
  }
  return false;
}

SegmentTier::GrowthQuote SegmentTier::quote_growth(std::size_t bytes) const noexcept {
  assert(bytes == round(bytes));
  const Lock locked = lock();
  return GrowthQuote{.growth_bytes = growth_bytes(bytes),
                     .peak_growth = budget_.peak_growth(bytes),
                     .empty_bytes = empty_bytes_locked(),
                     .stranded = stranded_segments_locked()};
}

void SegmentTier::restart_peak() noexcept {
  const Lock locked = lock();
  budget_.restart_peak();
}

std::size_t SegmentTier::empty_bytes_locked() const noexcept {
  if (options_.virtual_memory != nullptr) return 0;
  std::size_t bytes = 0;
  for (const Segment* segment : segments_) {
    if (segment->idle()) bytes += segment->size;
  }
  return bytes;
}

void SegmentTier::release_empty_for(std::size_t bytes) noexcept {
  const Growth growing(*this);
  Lock locked = lock();
  wait_for_empty_segments(0, locked);
  release_empty_segments_for(bytes);
}

bool SegmentTier::owns(void* block) const noexcept {
  const Lock locked = lock();
  return live_.find(block) != nullptr;
}

SegmentTier::Counters SegmentTier::counters() const noexcept {
  const Lock locked = lock();
  return budget_.counters();
}

void SegmentTier::reset_peak() noexcept {
  const Lock locked = lock();
  budget_.reset_peak_reserved();
}

// ---------------------------------------------------------------------------------------
// The fit (under the mutex). The warm path's lookups are inline (index_of, file,
// remove_free, best_fit: one call each per split, merge or fit), their rare branches out
// of line.

inline SegmentTier::Range* SegmentTier::best_fit(StreamKey key, std::size_t bytes,
                                                 bool& mapped) noexcept {
  FreeRanges::Index* index = ranges_.index_of(key);
  if (index == nullptr || index->empty()) {
    mapped = true;
    return nullptr;
  }
  Range* best = index->best(bytes);
  mapped = best == nullptr || map_.base() == nullptr || map_.mapped_under(best, bytes);
  if (mapped) return best;
  return mapped_fit(index, best, bytes, mapped);
}

// Virtual mode: among the few best fits (in (size, address) order), prefer one whose
// granules are all mapped (no driver call, nothing unmapped elsewhere for it).
SegmentTier::Range* SegmentTier::mapped_fit(FreeRanges::Index* index, Range* best,
                                            std::size_t bytes, bool& mapped) noexcept {
  Range* candidates[8];
  const std::size_t n = index->best_k(bytes, candidates, 8);
  for (std::size_t i = 1; i < n; ++i) {
    if (map_.mapped_under(candidates[i], bytes)) {
      mapped = true;
      return candidates[i];
    }
  }
  mapped = false;
  return best;
}

SegmentTier::Range* SegmentTier::refit_after_records(StreamKey stream, std::size_t need,
                                                     bool& mapped, Lock& locked, Range* r) {
  if (!record_listed(locked)) return r;
  // As before the change: every pending marker asked once the fenced streams have theirs.
  poll_all_unlocked(locked);
  reserve_spares();  // the mutex was released: r may be gone, the spares used
  return fit(stream, need, mapped, /*fence=*/false);
}

void SegmentTier::poll_all_unlocked(Lock& locked) noexcept {
  const std::size_t count = tags_.pending_count();
  if (count == 0) return;
  std::vector<std::uint64_t> markers;
  std::unique_ptr<bool[]> done;
  try {
    markers.resize(count);
    done = std::make_unique<bool[]>(count);
  } catch (...) {  // no host memory for the lists: a batch at a time
    for (std::size_t rounds = (count + kPollBatch - 1) / kPollBatch; rounds > 0; --rounds) {
      poll_unlocked(locked);
    }
    return;
  }
  query_unlocked(locked, markers.data(), done.get(), count);  // every one
}

bool SegmentTier::record_listed(Lock& locked) noexcept {
  if (!tags_.any_listed()) return false;
  std::vector<StreamTags::Record> records;
  if (!tags_.take_listed(records)) return false;
  const std::uint64_t mark = tags_.mark();
  locked.unlock();
  tags_.record_outside(records);
  locked.lock();
  tags_.end_record(records, mark);
  return true;
}

void SegmentTier::fence_all_unlocked(Lock& locked) noexcept {
  tags_.fence_all();
  (void)record_listed(locked);
  poll_all_unlocked(locked);
}

SegmentTier::Range* SegmentTier::fit(StreamKey stream, std::size_t need, bool& mapped,
                                     bool fence) noexcept {
  // The smaller fit of the stream's own ranges and the untagged ones.
  auto smaller_fit = [this, stream, need, &mapped] {
    Range* r = best_fit(kUntagged, need, mapped);
    if (stream != kUntagged) {
      bool own_mapped = false;
      Range* own = best_fit(stream, need, own_mapped);
      if (own != nullptr && (r == nullptr || own->size <= r->size)) {
        r = own;
        mapped = own_mapped;
      }
    }
    return r;
  };
  Range* r = smaller_fit();
  // The stream's own pending ranges (its frees under a marker not yet complete) first: safe for
  // it in stream order, and idle for every other stream until the marker completes. Where
  // nothing else serves without growing, one with the untagged range after it, all mapped (a
  // stream that frees a block and asks for a larger one): as the coalescing rule does for a
  // free on a stream, but only when a request needs it, so untagged memory stays every
  // stream's.
  if (stream != kUntagged && tags_.any_pending()) {
    if (Range* own = tags_.own_pending_fit(stream, need, /*stretch=*/r == nullptr || !mapped)) {
      mapped = true;  // own_pending_fit() takes none with a granule to map
      return own;
    }
  }
  // Growing while other streams hold free memory: fence those streams first (their ranges
  // serve any stream once their markers complete; on a device usually by a later request,
  // here only when already complete). In virtual mode a fit over unmapped granules is
  // growth too: the untagged rest of the reservation always fits, and without this a
  // stream whose own ranges did not fit would map new memory while the other streams' free
  // memory stayed idle. The fence runs only when the tier would otherwise grow. A segment
  // tier fences every other stream; a virtual one, within the growth budget, only the
  // streams whose ranges could serve the request (a fence costs a CUDA event and takes the
  // stream's own frees from it), past the budget every one.
  const bool grows = r == nullptr || (map_.base() != nullptr && !mapped &&
                                      (tags_.any_pending() || ranges_.others_hold_free(stream)));
  if (grows) [[unlikely]] {
    if (fence) {
      // The requester's own ranges that a fence made pending (another stream's growth, a
      // trim) are safe for it in stream order: they become its free ranges again.
      const bool changed = map_.base() != nullptr && stream != kUntagged && tags_.take_back(stream);
      const bool every_stream = map_.base() == nullptr || past_budget(changed ? nullptr : r, need);
      // Listed for a record (fit_fenced() records them with the mutex released).
      (void)tags_.fence_other_streams(stream, every_stream ? 0 : need);
      if (changed) r = smaller_fit();  // ranges may have merged (r among them): look again
    }
    if (r == nullptr) {
      r = fresh_tail(need);
      mapped = r != nullptr && map_.mapped_under(r, need);
    }
  }
  if (r != nullptr && map_.base() == nullptr && r->prev == nullptr && r->next == nullptr &&
      r->size - need > options_.max_segment_waste) {
    return nullptr;  // the tier grows by one sized for the request (this one goes back past
                     // the budget)
  }
  return r;
}

std::size_t SegmentTier::growth_for(const Range* r, std::size_t need) const noexcept {
  if (r == nullptr) return growth_bytes(need);
  if (map_.base() == nullptr) return 0;
  return map_.unmapped_granules(map_.granule_of(r->addr), map_.granule_of(r->addr + need - 1)) *
         map_.granule();
}

void SegmentTier::claim_fit(Range* r, std::size_t need) noexcept {
  if (r->state == Range::State::pending) {
    tags_.take_pending(r, need);  // its rest stays pending under its marker
    return;
  }
  ranges_.remove_free(r);
  ranges_.split(r, need);
}

bool SegmentTier::past_budget(const Range* r, std::size_t need) const noexcept {
  const std::size_t grow = growth_for(r, need);
  return grow > 0 && budget_.excess_after_growth(grow, need) > 0;
}

void SegmentTier::describe(bool large, std::vector<DevicePoolSegment>& out) const {
  const Lock held = lock();
  const bool virtual_mode = map_.granule() != 0;
  for (const Segment* segment : segments_) {
    bool open = false;  // out.back() is being filled
    for (const Range* r = segment->first; r != nullptr; r = r->next) {
      if (virtual_mode && !map_.mapped_under(r, r->size)) {
        open = false;  // an unmapped gap ends the extent
        continue;
      }
      if (!open) {
        DevicePoolSegment& opened = out.emplace_back();
        opened.address = reinterpret_cast<std::uintptr_t>(r->addr);
        opened.large = large;
        opened.virtual_memory = virtual_mode;
        open = true;
      }
      DevicePoolSegment& extent = out.back();
      extent.ranges.push_back(
          {reinterpret_cast<std::uintptr_t>(r->addr), r->size, r->state == Range::State::used});
      extent.bytes += r->size;
    }
  }
}

}  // namespace vram::detail
