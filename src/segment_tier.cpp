#include "segment_tier.hpp"

#include <bit>

#include <algorithm>
#include <cassert>
#include <memory>
#include <new>
#include <string>

#include "vram/cuda/error.hpp"

namespace vram::detail {

StreamKey per_thread_stream_key() noexcept {
  static std::atomic<StreamKey> next{1};
  thread_local const StreamKey key = kPerThreadKey | next.fetch_add(1, std::memory_order_relaxed);
  return key;
}

SegmentTier::SegmentTier(Upstream& upstream, StreamFence& fence, ReservedGauge& gauge,
                         Options options)
    : upstream_(upstream),
      fence_(fence),
      gauge_(gauge),
      options_(options),
      untagged_(static_cast<unsigned>(std::countr_zero(options.granularity))) {
  if (options_.virtual_memory != nullptr) {
    granule_ = options_.virtual_memory->granularity();
    if (!std::has_single_bit(granule_)) {
      throw InvalidArgument("vram::DevicePool: virtual memory granularity " +
                            std::to_string(granule_) + " is not a power of two");
    }
    granule_shift_ = static_cast<unsigned>(std::countr_zero(granule_));
  }
}

SegmentTier::~SegmentTier() {
  for (Pending& p : pending_) fence_.release(p.marker);
  if (base_ != nullptr) {
    for (std::size_t g = 0; g < run_of_.size(); ++g) {
      if (run_of_[g] != g) continue;
      const std::size_t bytes = run_granules_[g] * granule_;
      options_.virtual_memory->unmap(base_ + g * granule_, bytes, handles_[g]);
      gauge_.sub(bytes);
    }
    options_.virtual_memory->unreserve(base_, options_.reservation);
  }
  for (Segment* segment : segments_) {
    if (segment->base != base_) {
      upstream_.deallocate(segment->base, segment->size);
      gauge_.sub(segment->size);
    }
    for (Range* r = segment->first; r != nullptr;) {
      Range* next = r->next;
      delete r;
      r = next;
    }
    delete segment;
  }
  while (spare_ranges_ != nullptr) {
    Range* next = spare_ranges_->next;
    delete spare_ranges_;
    spare_ranges_ = next;
  }
}

SegmentTier::Range* SegmentTier::take_range() noexcept {
  Range* r = spare_ranges_;
  if (r != nullptr) {
    spare_ranges_ = r->next;
    --spare_count_;
  }
  return r;
}

void SegmentTier::recycle(Range* range) noexcept {
  range->next = spare_ranges_;
  spare_ranges_ = range;
  ++spare_count_;
}

void SegmentTier::keep_spares(std::size_t count) {
  while (spare_count_ < count) recycle(new Range{nullptr, 0, nullptr});
}

std::size_t SegmentTier::stream_slot(StreamKey key) const noexcept {
  std::size_t slot = 0;
  while (slot < tagged_.size() && tagged_[slot].key != key) ++slot;
  return slot;
}

// The warm path's lookups are inline (index_of, file, remove_free, best_fit: one call each
// per split, merge or fit), their rare branches out of line.
inline SegmentTier::Index* SegmentTier::index_of(StreamKey key) noexcept {
  if (key == kUntagged) return &untagged_;
  if (cached_index_ != nullptr && cached_key_ == key) return cached_index_;
  return stream_index(key);
}

SegmentTier::Index* SegmentTier::stream_index(StreamKey key) noexcept {
  const std::size_t slot = stream_slot(key);
  if (slot == tagged_.size()) return nullptr;
  cached_key_ = key;
  cached_index_ = tagged_[slot].index.get();
  return cached_index_;
}

void SegmentTier::erase_index(std::size_t slot) noexcept {
  assert(tagged_[slot].index->empty());
  if (spare_indices_.size() < spare_indices_.capacity()) {  // reserved in file(): no throw
    spare_indices_.push_back(std::move(tagged_[slot].index));
  }
  if (slot + 1 != tagged_.size()) tagged_[slot] = std::move(tagged_.back());
  tagged_.pop_back();
  cached_index_ = nullptr;
}

inline bool SegmentTier::file(Range* range) noexcept {
  Index* index = index_of(range->tag);
  if (index == nullptr) [[unlikely]] {
    return file_new_index(range);
  }
  index->insert(range);
  return true;
}

bool SegmentTier::file_new_index(Range* range) noexcept {
  Index* index = nullptr;
  try {
    if (tagged_.size() == tagged_.capacity()) tagged_.reserve(2 * tagged_.size() + 4);
    spare_indices_.reserve(kSpareIndices);
    std::unique_ptr<Index> fresh;
    if (!spare_indices_.empty()) {
      fresh = std::move(spare_indices_.back());
      spare_indices_.pop_back();
    } else {
      fresh =
          std::make_unique<Index>(static_cast<unsigned>(std::countr_zero(options_.granularity)));
    }
    index = fresh.get();
    tagged_.push_back(StreamIndex{range->tag, std::move(fresh)});  // reserved: no throw
  } catch (...) {
    return false;
  }
  cached_key_ = range->tag;
  cached_index_ = index;
  index->insert(range);
  return true;
}

std::size_t SegmentTier::segment_size_for(std::size_t bytes) const noexcept {
  const std::size_t rounding = options_.segment_rounding;
  std::size_t size = (bytes + rounding - 1) / rounding * rounding;
  if (bytes < options_.packed_limit) size = std::max(size, options_.packed_segment);
  return std::max(size, options_.min_segment);
}

inline SegmentTier::Range* SegmentTier::best_fit(StreamKey key, std::size_t bytes,
                                                 bool& mapped) noexcept {
  Index* index = index_of(key);
  if (index == nullptr || index->empty()) {
    mapped = true;
    return nullptr;
  }
  Range* best = index->best(bytes);
  mapped = best == nullptr || base_ == nullptr || mapped_under(best, bytes);
  if (mapped) return best;
  return mapped_fit(index, best, bytes, mapped);
}

// Virtual mode: among the few best fits (in (size, address) order), prefer one whose
// granules are all mapped (no driver call, nothing unmapped elsewhere for it).
SegmentTier::Range* SegmentTier::mapped_fit(Index* index, Range* best, std::size_t bytes,
                                            bool& mapped) noexcept {
  Range* candidates[8];
  const std::size_t n = index->best_k(bytes, candidates, 8);
  for (std::size_t i = 1; i < n; ++i) {
    if (mapped_under(candidates[i], bytes)) {
      mapped = true;
      return candidates[i];
    }
  }
  mapped = false;
  return best;
}

inline void SegmentTier::remove_free(Range* range) noexcept {
  Index* index = range->index;
  if (index == nullptr) return;  // unfiled (or pending)
  index->erase(range);
  // An emptied stream index stays for the stream's next free (creating one clears its bins)
  // while there are few; past that it goes, so that streams come and go without leaking.
  if (index->empty() && index != &untagged_ && tagged_.size() > kKeptEmptyIndices) [[unlikely]] {
    drop_index(index);
  }
}

void SegmentTier::drop_index(const Index* index) noexcept {
  std::size_t slot = 0;
  while (tagged_[slot].index.get() != index) ++slot;  // filed in it: present
  erase_index(slot);
}

// A range freed with stream S also absorbs untagged free neighbours (memory usable by any
// stream may be restricted to S: that is always safe), so stream-ordered frees coalesce as
// well as plain ones. An untagged range merges only with untagged neighbours: untagging a
// range after its marker must make it usable by every stream, not hand it back to a stream.
// Virtual mode: a stream free beside the untagged tail of the reservation absorbs it too;
// the part of it never mapped stays usable by every stream (fresh_tail()).
bool SegmentTier::mergeable(const Range* range, const Range* neighbour) const noexcept {
  return neighbour != nullptr && neighbour->state == Range::State::free &&
         (neighbour->tag == range->tag || neighbour->tag == kUntagged);
}

// Virtual mode: granules at or above mapped_high_ were never mapped, so no work can use
// them whatever the tag of the range they sit in. When the last range of the reservation
// is a stream's (tagged, or pending on its marker) and nothing else fits, its never-mapped
// part is split off as an untagged range for the request.
SegmentTier::Range* SegmentTier::fresh_tail(std::size_t need) noexcept {
  if (base_ == nullptr || segments_.empty()) return nullptr;
  Range* last = segments_.front()->first;
  while (last->next != nullptr) last = last->next;
  if (last->state == Range::State::used || last->tag == kUntagged) return nullptr;
  char* end = last->addr + last->size;
  char* fresh = std::max(base_ + mapped_high_ * granule_, last->addr);
  fresh = base_ + (static_cast<std::size_t>(fresh - base_) + granule_ - 1) / granule_ * granule_;
  if (fresh <= last->addr || fresh >= end || static_cast<std::size_t>(end - fresh) < need) {
    return nullptr;
  }
  Range* tail = take_range();
  if (tail == nullptr) {
    tail = new (std::nothrow) Range{nullptr, 0, nullptr};
    if (tail == nullptr) return nullptr;
  }
  *tail = Range{fresh,         static_cast<std::size_t>(end - fresh),
                last->segment, last,
                nullptr,       Range::State::free,
                kUntagged,     0};
  const bool filed = last->state == Range::State::free;
  if (filed) remove_free(last);  // its size is its key
  last->size = static_cast<std::size_t>(fresh - last->addr);
  last->next = tail;
  if (filed) file(last);  // false: left unfiled (accounting unchanged)
  untagged_.insert(tail);
  return tail;
}

void SegmentTier::insert_free(Range* range) noexcept {
  range->state = Range::State::free;
  auto absorb_prev = [this, &range] {
    Range* prev = range->prev;
    remove_free(prev);
    prev->tag = range->tag;
    prev->size += range->size;
    prev->epoch = std::max(prev->epoch, range->epoch);
    prev->next = range->next;
    if (range->next != nullptr) range->next->prev = prev;
    recycle(range);
    range = prev;
  };
  auto absorb_next = [this, &range] {
    Range* next = range->next;
    remove_free(next);
    range->size += next->size;
    range->epoch = std::max(range->epoch, next->epoch);
    range->next = next->next;
    if (next->next != nullptr) next->next->prev = range;
    recycle(next);
  };
  // A neighbour absorbed untagged may border a range of this stream beyond it (an untagged
  // range may border a tagged one): that one merges too, so no two adjacent free ranges
  // share a tag. (Adjacent untagged ranges never exist, so two steps per side suffice.)
  auto same_tag = [&range](const Range* n) {
    return n != nullptr && n->state == Range::State::free && n->tag == range->tag;
  };
  if (mergeable(range, range->prev)) {
    absorb_prev();
    if (same_tag(range->prev)) absorb_prev();
  }
  if (mergeable(range, range->next)) {
    absorb_next();
    if (same_tag(range->next)) absorb_next();
  }
  // False: no host memory for the stream's index: the range stays free but unfiled (not
  // reused, and its segment is given back only at destruction). Accounting is unchanged.
  file(range);
}

SegmentTier::Range* SegmentTier::fit(StreamKey stream, std::size_t need, bool& mapped) noexcept {
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
  // Growing while other streams hold free memory: fence those streams first (their ranges
  // serve any stream once their markers complete; on a device usually by a later request,
  // here only when already complete). In virtual mode a fit over unmapped granules is
  // growth too: the untagged rest of the reservation always fits, and without this a
  // stream whose own ranges did not fit mapped new memory while the other streams' free
  // memory stayed idle (16 streams replayed host-only: 97x the live bytes, growing every
  // pass). The fence runs only when the tier would otherwise grow. A segment tier fences
  // every other stream (as before); a virtual one, within the growth budget, only the
  // streams whose ranges could serve the request (a fence costs a CUDA event and takes the
  // stream's own frees from it), past the budget every one.
  auto others_hold_free = [this, stream] {
    return std::any_of(tagged_.begin(), tagged_.end(), [stream](const StreamIndex& s) {
      return s.key != stream && !s.index->empty();
    });
  };
  const bool grows =
      r == nullptr || (base_ != nullptr && !mapped && (!pending_.empty() || others_hold_free()));
  if (grows) {
    // The requester's own ranges that a fence made pending (another stream's growth, a
    // trim) are safe for it in stream order: they become its free ranges again.
    bool changed = base_ != nullptr && stream != kUntagged && take_back_pending(stream);
    const bool every_stream = base_ == nullptr || past_budget(changed ? nullptr : r, need);
    if (fence_other_streams(stream, every_stream ? 0 : need)) {
      poll_pending(false);
      changed = true;
    }
    if (changed) r = smaller_fit();  // ranges may have merged (r among them): look again
  }
  if (r == nullptr) {
    r = fresh_tail(need);
    mapped = r != nullptr && mapped_under(r, need);
  }
  if (r != nullptr && base_ == nullptr && r->prev == nullptr && r->next == nullptr &&
      r->size - need > options_.max_segment_waste) {
    return nullptr;  // the tier grows by one sized for the request (this one goes back past the
                     // budget)
  }
  return r;
}

std::size_t SegmentTier::growth_for(const Range* r, std::size_t need) const noexcept {
  if (r == nullptr) return growth_bytes(need);
  if (base_ == nullptr) return 0;
  return unmapped_granules(granule_of(r->addr), granule_of(r->addr + need - 1)) * granule_;
}

bool SegmentTier::past_budget(const Range* r, std::size_t need) const noexcept {
  const std::size_t grow = growth_for(r, need);
  return grow > 0 &&
         gauge_.excess_after_growth(grow, peak_growth(need), options_.growth_headroom_1024) > 0;
}

bool SegmentTier::could_serve(const Range* r, std::size_t need) const noexcept {
  // The stretch of ranges around r that are free (any tag) or pending: once untagged they
  // merge into one. Virtual mode counts only bytes below the highest granule ever mapped:
  // the never-mapped rest of the reservation serves any stream without a fence
  // (fresh_tail()), so a range beside it is no reason to fence or wait.
  auto unused = [](const Range* n) { return n != nullptr && n->state != Range::State::used; };
  const char* begin = r->addr;
  const char* end = r->addr + r->size;
  for (const Range* n = r->prev; unused(n); n = n->prev) begin = n->addr;
  for (const Range* n = r->next; unused(n); n = n->next) end = n->addr + n->size;
  if (base_ != nullptr) end = std::min<const char*>(end, base_ + mapped_high_ * granule_);
  return end > begin && static_cast<std::size_t>(end - begin) >= need;
}

bool SegmentTier::take_back_pending(StreamKey stream) noexcept {
  bool taken = false;
  for (std::size_t i = 0; i < pending_.size();) {
    Pending& p = pending_[i];
    if (p.stream != stream) {
      ++i;
      continue;
    }
    fence_.release(p.marker);
    for (Range* r : p.ranges) insert_free(r);  // tag still `stream`: filed as its own
    pending_[i] = std::move(pending_.back());
    pending_.pop_back();
    taken = true;
  }
  return taken;
}

bool SegmentTier::wait_for_pending(StreamKey stream, std::size_t need) noexcept {
  bool waited = false;
  for (const Pending& p : pending_) {
    if (p.stream == stream) continue;
    if (std::any_of(p.ranges.begin(), p.ranges.end(),
                    [&](const Range* r) { return could_serve(r, need); })) {
      fence_.wait(p.marker);
      waited = true;
    }
  }
  if (waited) poll_pending(false);
  return waited;
}

void* SegmentTier::allocate(std::size_t bytes, StreamKey stream, bool may_grow) {
  const std::size_t need = round(bytes);
  std::lock_guard lock(mutex_);
  // Before any change: a new segment's range and a split-off rest cannot fail, nor can
  // filing the block in live_.
  keep_spares(2);
  live_.reserve_one();
  if (options_.virtual_memory != nullptr && base_ == nullptr) reserve_range();
  if (!pending_.empty()) poll_pending(false);
  bool mapped = false;  // r's granules under `need` (virtual mode), as fit() found them
  Range* r = fit(stream, need, mapped);
  // Before growing: wholly free segments that wait for their streams' work are waited for
  // (see wait_for_empty_segments); one of them may serve the request.
  if (r == nullptr && may_grow) {
    // Only segments that could then serve the request are worth the wait, unless growing
    // passes the budget (then any of them may have to go back).
    if (wait_for_empty_segments(past_budget(nullptr, need) ? 0 : need))
      r = fit(stream, need, mapped);
  }
  // Virtual mode, the same rule for other streams' free memory: fit() fenced those streams
  // before growing, and their markers may not have completed yet. Growing past the budget
  // (the tiers' peaks of used bytes plus the headroom) waits for the markers of other
  // streams (a stream's own frees are safe for it in stream order) whose ranges could serve
  // the request; within it the tier grows without blocking. Without this bound, streams that
  // each capture free memory next to their own frees made the others grow again and again
  // (reserved 60x what is live, and rising, with 16 streams whose markers complete a few
  // requests later).
  if (base_ != nullptr && may_grow && !pending_.empty() && past_budget(r, need) &&
      wait_for_pending(stream, need)) {
    r = fit(stream, need, mapped);
  }
  // (Nothing maps or unmaps between fit() and here.)
  const bool needs_map = r != nullptr && base_ != nullptr && !mapped;
  if (needs_map && !may_grow) return nullptr;  // would need a new granule: that is growing
  if (r != nullptr) {
    remove_free(r);
  } else if (!may_grow) {
    return nullptr;
  } else if (base_ != nullptr) {
    throw OutOfMemory(bytes, counters_.free_bytes, used_,
                      "the pool's reserved address range is exhausted");
  } else {
    // Nothing free fits: wholly free segments cannot serve this request. Reserved may
    // exceed the peak of used bytes by the headroom; past that, wholly free
    // segments covering the excess go back first (the smallest that covers it, else the
    // largest ones). Giving back all of them would make the next step take them again.
    std::size_t size = segment_size_for(need);
    if (const std::size_t excess =
            gauge_.excess_after_growth(size, peak_growth(need), options_.growth_headroom_1024)) {
      release_empty_segments_for(excess);
    }
    auto segment = std::make_unique<Segment>(Segment{nullptr, size, nullptr});
    segments_.reserve(segments_.size() + 1);
    void* base = nullptr;
    try {
      base = allocate_non_null(upstream_, size);
    } catch (const OutOfMemory&) {
      ++counters_.failed_upstream_allocations;
      if (size == need) throw;
      size = need;  // a segment of just this block may still fit
      try {
        base = allocate_non_null(upstream_, size);
      } catch (...) {
        ++counters_.failed_upstream_allocations;
        throw;
      }
    } catch (...) {
      ++counters_.failed_upstream_allocations;
      throw;
    }
    segment->size = size;
    segment->base = static_cast<char*>(base);
    Range* whole = take_range();  // kept spare
    *whole = Range{segment->base, size, segment.get()};
    segment->first = whole;
    segments_.push_back(segment.release());
    r = whole;
    ++counters_.upstream_allocations;
    ++counters_.segments;
    counters_.reserved += size;
    counters_.free_bytes += size;
    counters_.peak_reserved = std::max(counters_.peak_reserved, counters_.reserved);
    gauge_.add(size);
  }
  if (r->size - need >= options_.granularity) {
    Range* rest = take_range();  // kept spare, or recycled by a merge since
    *rest = Range{r->addr + need, r->size - need,     r->segment, r,
                  r->next,        Range::State::free, r->tag,     r->epoch};
    if (r->next != nullptr) r->next->prev = rest;
    r->next = rest;
    r->size = need;
    file(rest);  // r was maximal: rest has no free same-tag neighbour
  }
  r->state = Range::State::used;  // before mapping: nothing may merge it meanwhile
  if (needs_map) {                // computed for this r: after the split, r->size == need
    try {
      map_range(r);
    } catch (...) {  // give the range back as it was (it merges with its split-off rest)
      insert_free(r);
      throw;
    }
  }
  live_.insert(r->addr, r);  // reserved above
  r->tag = kUntagged;
  counters_.free_bytes -= r->size;
  used_ += r->size;
  if (used_ > used_peak_) {
    gauge_.tier_peaks.fetch_add(used_ - used_peak_, std::memory_order_relaxed);
    used_peak_ = used_;
  }
  ahead_peak_ = std::max(ahead_peak_, used_);
  return r->addr;
}

bool SegmentTier::free(void* block, StreamKey tag, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  // Null for a foreign block, for null itself, and for a block of another size than
  // `bytes` (a small class's released under a large size, say).
  const std::size_t need = bytes != 0 ? round(bytes) : 0;
  Range* r =
      live_.erase_if(block, [need](const Range* live) { return need == 0 || live->size == need; });
  if (r == nullptr) return false;
  counters_.free_bytes += r->size;
  used_ -= r->size;
  r->tag = tag;
  r->epoch = epoch_;
  insert_free(r);
  if (tag == kUntagged && counters_.free_bytes > options_.max_free_bytes) {
    if (base_ != nullptr) {
      unmap_free_granules(options_.max_free_bytes, nullptr);
    } else {
      release_empty_segments(options_.max_free_bytes);
    }
  }
  return true;
}

void SegmentTier::poll_pending(bool wait) noexcept {
  for (std::size_t i = 0; i < pending_.size();) {
    Pending& p = pending_[i];
    if (wait) fence_.wait(p.marker);
    if (!fence_.completed(p.marker)) {
      ++i;
      continue;
    }
    fence_.release(p.marker);
    for (Range* r : p.ranges) {
      r->tag = kUntagged;
      insert_free(r);
    }
    pending_[i] = std::move(pending_.back());
    pending_.pop_back();
  }
}

bool SegmentTier::fence_other_streams(StreamKey except, std::size_t need) noexcept {
  bool fenced = false;
  for (std::size_t slot = 0; slot < tagged_.size();) {
    const Index& index = *tagged_[slot].index;
    bool serves = need == 0;
    if (!serves && tagged_[slot].key != except) {
      index.for_each([&](const Range* r) { serves = serves || could_serve(r, need); });
    }
    if (tagged_[slot].key == except || index.empty() || !serves) {
      ++slot;
      continue;
    }
    if (fence_stream(slot)) {
      erase_index(slot);  // the last slot moved here: look at this one again
      fenced = true;
    } else {
      ++slot;
    }
  }
  return fenced;
}

bool SegmentTier::fence_stream(std::size_t slot) noexcept {
  Index& index = *tagged_[slot].index;
  try {
    Pending p{fence_.record(fence_stream_of(tagged_[slot].key)), tagged_[slot].key, {}};
    p.ranges.reserve(index.size());
    index.for_each([&p](Range* r) { p.ranges.push_back(r); });  // reserved: no throw
    pending_.push_back(std::move(p));
  } catch (...) {  // no marker (or no host memory): these ranges stay with their stream
    return false;
  }
  // (Order within p.ranges does not matter: pending ranges never merge with each other
  // until untagged, and untagging merges to the same ranges in any order.)
  for (Range* r : pending_.back().ranges) {
    r->state = Range::State::pending;
    r->bin_prev = r->bin_next = nullptr;
    r->index = nullptr;
  }
  index.clear();
  return true;
}

bool SegmentTier::wait_for_empty_segments(std::size_t need) noexcept {
  if (base_ != nullptr) return false;
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
    const std::size_t slot = stream_slot(only->tag);
    if (slot != tagged_.size() && fence_stream(slot)) erase_index(slot);
  }
  // Only the markers of wholly free segments are waited for (a pending range never merges,
  // so "wholly free" cannot change while it waits); other pending markers are polled.
  bool waited = false;
  for (const Pending& p : pending_) {
    const bool whole = std::any_of(p.ranges.begin(), p.ranges.end(), [&](const Range* r) {
      return r->prev == nullptr && r->next == nullptr && could_serve(r);
    });
    if (whole) {
      fence_.wait(p.marker);
      waited = true;
    }
  }
  if (waited) poll_pending(false);
  return waited;
}

void SegmentTier::release_segment(Segment* segment) noexcept {
  upstream_.deallocate(segment->base, segment->size);
  ++counters_.upstream_frees;
  --counters_.segments;
  counters_.reserved -= segment->size;
  counters_.free_bytes -= segment->size;
  gauge_.sub(segment->size);
  recycle(segment->first);
  delete segment;
}

void SegmentTier::release_empty_segments(std::size_t keep_free) noexcept {
  if (base_ != nullptr) return;  // virtual mode: granules, not segments, go back
  for (std::size_t i = 0; i < segments_.size() && counters_.free_bytes > keep_free;) {
    Segment* segment = segments_[i];
    Range* only = segment->first;
    if (only->next == nullptr && only->state == Range::State::free && only->tag == kUntagged) {
      remove_free(only);
      release_segment(segment);
      segments_[i] = segments_.back();
      segments_.pop_back();
    } else {
      ++i;
    }
  }
}

std::size_t SegmentTier::release_empty_segments_for(std::size_t bytes) noexcept {
  if (base_ != nullptr || bytes == 0) return 0;
  // The smallest wholly free segment that covers `bytes`; else the largest ones until
  // they do (or none is left).
  std::vector<Segment*> empty;
  try {
    for (Segment* segment : segments_) {
      const Range* only = segment->first;
      if (only->next == nullptr && only->state == Range::State::free && only->tag == kUntagged) {
        empty.push_back(segment);
      }
    }
  } catch (...) {  // no host memory for the list: give back every wholly free segment
    const std::size_t before = counters_.reserved;
    release_empty_segments(0);
    return before - counters_.reserved;
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
    remove_free(segment->first);
    segments_.erase(std::find(segments_.begin(), segments_.end(), segment));
    release_segment(segment);
  }
  return released;
}

std::size_t SegmentTier::empty_bytes() const noexcept {
  if (options_.virtual_memory != nullptr) return 0;
  std::lock_guard lock(mutex_);
  std::size_t bytes = 0;
  for (const Segment* segment : segments_) {
    const Range* only = segment->first;
    if (only->next == nullptr && only->state == Range::State::free && only->tag == kUntagged) {
      bytes += segment->size;
    }
  }
  return bytes;
}

void SegmentTier::release_empty_for(std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  wait_for_empty_segments(0);
  release_empty_segments_for(bytes);
}

std::uint64_t SegmentTier::mark_frees() noexcept {
  std::lock_guard lock(mutex_);
  return ++epoch_;
}

void SegmentTier::forget_streams(std::uint64_t mark) noexcept {
  std::lock_guard lock(mutex_);
  // Pending ranges are never merged, so each keeps its own epoch.
  for (std::size_t i = 0; i < pending_.size();) {
    Pending& p = pending_[i];
    auto older = std::partition(p.ranges.begin(), p.ranges.end(),
                                [mark](const Range* r) { return r->epoch >= mark; });
    for (auto it = older; it != p.ranges.end(); ++it) {
      (*it)->tag = kUntagged;
      insert_free(*it);
    }
    p.ranges.erase(older, p.ranges.end());
    if (!p.ranges.empty()) {  // freed after the mark: still waits for its marker
      ++i;
      continue;
    }
    fence_.release(p.marker);
    pending_[i] = std::move(pending_.back());
    pending_.pop_back();
  }
  // Untagging merges a range only with untagged neighbours, so every range collected here
  // stays alive until its own turn.
  std::vector<Range*> tagged;
  try {
    for (const StreamIndex& stream : tagged_) {
      stream.index->for_each([&tagged, mark](Range* r) {
        if (r->epoch < mark) tagged.push_back(r);
      });
    }
  } catch (...) {  // no host memory for the list: the ranges keep their streams
    return;
  }
  for (Range* r : tagged) {
    remove_free(r);
    r->tag = kUntagged;
    insert_free(r);
  }
}

void SegmentTier::trim(std::size_t keep_free, bool wait) noexcept {
  std::lock_guard lock(mutex_);
  fence_other_streams(kUntagged);
  poll_pending(wait);
  if (base_ != nullptr) {
    unmap_free_granules(keep_free, nullptr);
  } else {
    release_empty_segments(keep_free);
  }
}

void SegmentTier::reserve_range() {
  const std::size_t bytes = options_.reservation / granule_ * granule_;
  const std::size_t granules = bytes / granule_;
  handles_.assign(granules, 0);
  run_granules_.assign(granules, 0);
  run_of_.assign(granules, kNoRun);
  mapped_bits_.assign((granules + 63) / 64, 0);
  auto segment = std::make_unique<Segment>(Segment{nullptr, bytes, nullptr});
  auto whole = std::make_unique<Range>(Range{nullptr, bytes, nullptr});
  segments_.reserve(segments_.size() + 1);
  base_ = options_.virtual_memory->reserve(bytes);
  segment->base = base_;
  whole->addr = base_;
  whole->segment = segment.get();
  segment->first = whole.get();
  segments_.push_back(segment.release());
  untagged_.insert(whole.release());
  ++counters_.segments;
}

// Stream-tagged free ranges may still be used by queued work: fence every stream and
// untag what has completed (without blocking), so that its granules can be unmapped.
void SegmentTier::make_reclaimable() noexcept {
  fence_other_streams(kUntagged);
  poll_pending(false);
}

void SegmentTier::map_range(Range* range) {
  const std::size_t first = granule_of(range->addr);
  std::size_t last = granule_of(range->addr + range->size - 1);
  if (all_mapped(first, last)) return;  // allocate() calls it only when a granule is missing
  const std::size_t new_granules = unmapped_granules(first, last);
  const std::size_t new_bytes = new_granules * granule_;
  if (options_.unmap_before_map) {
    // The growth budget the tiers share (ReservedGauge): past it, free runs are unmapped
    // before new ones are mapped. Below it, mapped free granules stay for reuse, so a loop
    // that frees and reallocates makes no driver call.
    if (const std::size_t excess = gauge_.excess_after_growth(new_bytes, peak_growth(range->size),
                                                              options_.growth_headroom_1024)) {
      make_reclaimable();
      unmap_free_granules(counters_.free_bytes > excess ? counters_.free_bytes - excess : 0, range);
    }
  }
  // Each stretch of unmapped granules under the range is one run: one physical allocation
  // and one map, however many granules it spans, up to run_granule_cap().
  const std::size_t available = options_.virtual_memory->available_bytes();
  const std::size_t cap = run_granule_cap(available);
  const std::size_t block_last = last;
  last = map_ahead_end(range, last, new_granules, cap, available);
  for (std::size_t g = first; g <= last;) {
    if (mapped(g)) {
      ++g;
      continue;
    }
    std::size_t end = g;
    while (end <= last && !mapped(end) && end - g < cap) ++end;
    const std::size_t bytes = (end - g) * granule_;
    char* address = base_ + g * granule_;
    std::uint64_t handle = 0;
    try {
      handle = options_.virtual_memory->map(address, bytes);
    } catch (const OutOfMemory&) {
      ++counters_.failed_upstream_allocations;
      if (last > block_last) {  // map-ahead goes first: only the block's granules are needed
        last = block_last;
        continue;  // this run again without them (or done, when it held only those)
      }
      make_reclaimable();
      unmap_free_granules(0, range);
      try {
        handle = options_.virtual_memory->map(address, bytes);
      } catch (...) {
        ++counters_.failed_upstream_allocations;
        throw;
      }
    }
    for (std::size_t k = g; k < end; ++k) run_of_[k] = g;
    set_mapped_bits(g, end, true);
    run_granules_[g] = end - g;
    handles_[g] = handle;
    mapped_high_ = std::max(mapped_high_, end);
    ++counters_.maps;
    ++counters_.upstream_allocations;
    counters_.reserved += bytes;
    counters_.free_bytes += bytes;
    counters_.peak_reserved = std::max(counters_.peak_reserved, counters_.reserved);
    gauge_.add(bytes);
    g = end;
  }
}

// A map costs about the same from 2 MiB to 256 MiB (60-86 us on the H200), so long runs
// make a pool that starts empty cheap to fill. But a run goes back only whole: one block
// left in it keeps it all mapped. Far from the end of physical memory that costs nothing
// (nothing is unmapped); near it, the unmaps that make room for a new run must find whole
// free runs. So a run is at most 1/kRunShareOfAvailable of the physical memory still
// available (and at most max_run_bytes): runs shrink to single granules as memory runs out.
std::size_t SegmentTier::run_granule_cap(std::size_t available) const noexcept {
  const std::size_t bytes = std::min(options_.max_run_bytes, available / kRunShareOfAvailable);
  return std::max<std::size_t>(1, bytes / granule_);
}

// Map-ahead: the map a block needs anyway also covers granules of the free range right
// after it, so that a tier growing in many small steps makes few maps (a map costs about
// the same for 2 MiB as for 256 MiB). Bounds: options_.map_ahead_bytes; 1/4 of what the
// tier holds (growth stays geometric: a steady workload whose peak the tier already holds
// needs no map at all); the run's cap (no extra map for it); only granules wholly inside
// that range and only when it is untagged (a stream's free range stays its own); and only
// while the tier holds at most 1/4 of the physical memory still available, so near the
// end of memory (where a reclaim must find whole free runs) every granule mapped is one a
// block needs. The extra granules count as reserved and free, and serve later blocks. If
// the map fails (out of memory), map_range() drops them before reclaiming anything: the
// available figure may be unknown (SIZE_MAX) or stale, and map-ahead must never make a
// block that fits fail.
std::size_t SegmentTier::map_ahead_end(const Range* range, std::size_t last,
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
  const std::size_t held = counters_.reserved;
  if (available / 4 < held) return last;
  // Only for a block that raises the tier's peak of used bytes since it last gave granules
  // back (a workload still growing; after an unmap, growing again is too). Below that peak
  // the tier grows because its free memory is in the wrong places: extra
  // granules would stay reserved for good (a four-stream decode trace replayed ten times
  // host-only grew by 126 MiB, two maps, in its fourth pass; 1.20x the live bytes at the
  // end instead of 1.06x).
  if (used_ + range->size <= ahead_peak_) return last;
  // Free bytes after this map without map-ahead; the extra granules are free bytes too and
  // stay within max_free_bytes (they share a run with the block, so free() cannot unmap
  // them to honour it).
  const std::size_t free_after = held + new_granules * granule_ - used_ - range->size;
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

// The bits of mapped_bits_[word] that stand for granules in [first, last].
std::uint64_t SegmentTier::granule_mask(std::size_t word, std::size_t first,
                                        std::size_t last) noexcept {
  std::uint64_t mask = ~std::uint64_t{0};
  if (word == first / 64) mask &= ~std::uint64_t{0} << (first % 64);
  if (word == last / 64 && last % 64 != 63) mask &= (std::uint64_t{1} << (last % 64 + 1)) - 1;
  return mask;
}

bool SegmentTier::mapped_under(const Range* r, std::size_t bytes) const noexcept {
  return all_mapped(granule_of(r->addr), granule_of(r->addr + bytes - 1));
}

bool SegmentTier::all_mapped(std::size_t first, std::size_t last) const noexcept {
  for (std::size_t word = first / 64; word <= last / 64; ++word) {
    const std::uint64_t want = granule_mask(word, first, last);
    if ((mapped_bits_[word] & want) != want) return false;
  }
  return true;
}

std::size_t SegmentTier::unmapped_granules(std::size_t first, std::size_t last) const noexcept {
  std::size_t mapped_count = 0;
  for (std::size_t word = first / 64; word <= last / 64; ++word) {
    mapped_count += static_cast<std::size_t>(
        std::popcount(mapped_bits_[word] & granule_mask(word, first, last)));
  }
  return last - first + 1 - mapped_count;
}

void SegmentTier::set_mapped_bits(std::size_t first, std::size_t end, bool mapped) noexcept {
  for (std::size_t g = first; g < end; ++g) {
    const std::uint64_t bit = std::uint64_t{1} << (g % 64);
    if (mapped) {
      mapped_bits_[g / 64] |= bit;
    } else {
      mapped_bits_[g / 64] &= ~bit;
    }
  }
}

void SegmentTier::unmap_run(std::size_t first) noexcept {
  const std::size_t granules = run_granules_[first];
  const std::size_t bytes = granules * granule_;
  options_.virtual_memory->unmap(base_ + first * granule_, bytes, handles_[first]);
  for (std::size_t k = first; k < first + granules; ++k) run_of_[k] = kNoRun;
  set_mapped_bits(first, first + granules, false);
  run_granules_[first] = 0;
  ++counters_.upstream_frees;
  counters_.reserved -= bytes;
  counters_.free_bytes -= bytes;
  gauge_.sub(bytes);
  ahead_peak_ = used_;  // less is held than the peak needed: regrowth is growth again
}

// A run goes back only whole: when every one of its granules lies inside one free,
// untagged range.
void SegmentTier::unmap_free_granules(std::size_t keep_free, const Range* except) noexcept {
  // In ascending (size, address) order: the smallest free ranges go back first.
  untagged_.for_each_ordered(scratch_, [&](const Range* r) noexcept {
    if (counters_.free_bytes <= keep_free) return false;
    if (r == except) return true;
    const auto begin = static_cast<std::size_t>(r->addr - base_);
    const std::size_t first = (begin + granule_ - 1) / granule_;
    const std::size_t end = std::min((begin + r->size) / granule_, mapped_high_);  // wholly inside
    for (std::size_t g = first; g < end && counters_.free_bytes > keep_free;) {
      if (!mapped(g)) {
        ++g;
        continue;
      }
      const std::size_t run = run_of_[g];
      const std::size_t next = run + run_granules_[run];
      if (run >= first && next <= end) unmap_run(run);
      g = next;
    }
    return true;
  });
}

std::size_t SegmentTier::peak_growth_for(std::size_t bytes) const noexcept {
  std::lock_guard lock(mutex_);
  return peak_growth(round(bytes));
}

void SegmentTier::restart_peak() noexcept {
  std::lock_guard lock(mutex_);
  gauge_.tier_peaks.fetch_sub(used_peak_ - used_, std::memory_order_relaxed);
  used_peak_ = used_;
  ahead_peak_ = used_;
}

bool SegmentTier::owns(void* block) const noexcept {
  std::lock_guard lock(mutex_);
  return live_.find(block) != nullptr;
}

SegmentTier::Counters SegmentTier::counters() const noexcept {
  std::lock_guard lock(mutex_);
  return counters_;
}

void SegmentTier::reset_peak() noexcept {
  std::lock_guard lock(mutex_);
  counters_.peak_reserved = counters_.reserved;
}

}  // namespace vram::detail
