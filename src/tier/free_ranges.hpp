// src/tier/free_ranges.hpp: a segment tier's ranges and its free ones: best-fit lookup, split and
// coalesce, one FreeIndex per stream tag.
//
// A segment is a span of upstream memory (or the one reserved range of a virtual-memory
// tier), cut into ranges linked in address order; every byte of a segment is in exactly one
// range. A range is used (a block handed out), free, or pending (freed on a stream whose
// marker has not completed, unfiled: see stream_tags.hpp). A free range is filed in the
// index of its tag: the untagged index, or its stream's.
//
// Coalescing rule: a range freed with stream S also absorbs untagged free neighbours
// (memory usable by any stream may be restricted to S: that is always safe), so
// stream-ordered frees coalesce as well as plain ones. An untagged range merges only with
// untagged neighbours: untagging a range after its marker must make it usable by every
// stream, not hand it back to a stream.
//
// Invariants: no two adjacent free ranges have the same tag (an untagged range may border
// a stream-tagged one) and neither is pending; a filed range's `index` is the index of its
// tag; a pending or unfiled range's `index` is null.
//
// Not thread-safe: the owning tier calls it under its mutex. Range nodes are recycled
// through a spare list, so splitting and merging allocate nothing once the tier has run a
// while; keep_spares() before a change makes the split and the new segment's range of that
// change unable to fail.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "free_index.hpp"
#include "stream_key.hpp"

namespace vram::detail {

class LeaseOwner;  // lease_owner.hpp

class FreeRanges {
 public:
  struct Segment;
  struct Range {
    char* addr;
    std::size_t size;
    Segment* segment;
    Range* prev = nullptr;
    Range* next = nullptr;
    enum class State : std::uint8_t { used, free, pending } state = State::free;
    StreamKey tag = kUntagged;
    std::uint64_t epoch = 0;  // the tier's epoch at its (latest merged) stream-tagged free
    // A used range: the thread cache it was handed to (lease_owner.hpp), or null.
    LeaseOwner* owner = nullptr;
    // Filing in a FreeIndex (the one of `tag`) while free; index is null when unfiled.
    Range* bin_prev = nullptr;
    Range* bin_next = nullptr;
    FreeIndex<Range>* index = nullptr;
  };
  struct Segment {
    char* base;
    std::size_t size;
    Range* first;
    std::size_t holder_slot = 0;  // the holder's own number for it (a thread heap's chunk slot)
    // Wholly free and untagged: nothing uses it and no stream's queued work may; it can
    // serve any request or go back to the upstream.
    bool idle() const noexcept {
      return first->next == nullptr && first->state == Range::State::free &&
             first->tag == kUntagged;
    }
  };
  using Index = FreeIndex<Range>;
  struct StreamIndex {
    StreamKey key;
    std::unique_ptr<Index> index;
  };

  explicit FreeRanges(std::size_t granularity) noexcept
      : granularity_(granularity),
        unit_shift_(static_cast<unsigned>(std::countr_zero(granularity))),
        untagged_(unit_shift_) {}
  ~FreeRanges();  // deletes the spare nodes
  FreeRanges(const FreeRanges&) = delete;
  FreeRanges& operator=(const FreeRanges&) = delete;

  Index& untagged() noexcept { return untagged_; }
  // The streams' free ranges, one index per stream (few streams: a flat table); an entry
  // goes only through erase_index().
  std::vector<StreamIndex>& streams() noexcept { return tagged_; }
  std::size_t stream_slot(StreamKey key) const noexcept;  // streams().size(): none
  // Drops streams()[slot] (its index empty), keeping the index as a spare.
  void erase_index(std::size_t slot) noexcept;
  // Some stream other than `stream` has a free range.
  bool others_hold_free(StreamKey stream) const noexcept {
    return std::any_of(tagged_.begin(), tagged_.end(), [stream](const StreamIndex& s) {
      return s.key != stream && !s.index->empty();
    });
  }

  // The index of `key`'s free ranges; null: none for the stream (none free).
  Index* index_of(StreamKey key) noexcept {
    if (key == kUntagged) return &untagged_;
    if (cached_index_ != nullptr && cached_key_ == key) return cached_index_;
    return stream_index(key);
  }
  // Files a free range under its tag; false (left unfiled: not reused until destruction,
  // accounting unchanged) when a stream's index could not be created.
  bool file(Range* range) noexcept {
    Index* index = index_of(range->tag);
    if (index == nullptr) [[unlikely]] {
      return file_new_index(range);
    }
    index->insert(range);
    return true;
  }
  // Unfiles a free range (no-op for an unfiled or pending one). An emptied stream index
  // stays for the stream's next free (creating one clears its bins) while there are few;
  // past that it goes, so that streams come and go without leaking.
  void remove_free(Range* range) noexcept {
    Index* index = range->index;
    if (index == nullptr) return;
    index->erase(range);
    if (index->empty() && index != &untagged_ && tagged_.size() > kKeptEmptyIndices) [[unlikely]] {
      drop_index(index);
    }
  }

  // A node from the spares; null when there is none.
  Range* take_range() noexcept {
    Range* r = spare_ranges_;
    if (r != nullptr) {
      spare_ranges_ = r->next;
      --spare_count_;
    }
    return r;
  }
  void recycle(Range* range) noexcept {
    range->next = spare_ranges_;
    spare_ranges_ = range;
    ++spare_count_;
  }
  // At least `count` spare nodes; throws std::bad_alloc (the ranges unchanged).
  void keep_spares(std::size_t count) {
    while (spare_count_ < count) recycle(new Range{nullptr, 0, nullptr});
  }

  // Marks `range` free and merges it with its mergeable neighbours (the coalescing rule
  // above), then files the result under its tag. A neighbour absorbed untagged may border a
  // range of this stream beyond it: that one merges too, so no two adjacent free ranges
  // share a tag (adjacent untagged ranges never exist, so two steps per side suffice).
  // When no host memory is left for the stream's index, the range stays free but unfiled
  // (not reused, its segment given back only at destruction); accounting is unchanged.
  void insert_free(Range* range) noexcept {
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
    file(range);
  }

  // Splits the unfiled range `r` (taken for a block) at `need` bytes: the rest, when at
  // least `granularity` bytes, becomes a free range of r's tag. Takes a kept spare node.
  void split(Range* r, std::size_t need) noexcept {
    if (r->size - need < granularity_) return;
    Range* rest = take_range();
    *rest = Range{r->addr + need, r->size - need,     r->segment, r,
                  r->next,        Range::State::free, r->tag,     r->epoch};
    if (r->next != nullptr) r->next->prev = rest;
    r->next = rest;
    r->size = need;
    file(rest);  // r was maximal: rest has no free same-tag neighbour
  }

  // Splits the pending range `r` (taken for a block by its own stream) at `need` bytes: the
  // rest, when at least `granularity` bytes, is returned as a pending range of r's tag and
  // epoch (its owner files it under r's marker); null: no rest. Takes a kept spare node.
  Range* split_pending(Range* r, std::size_t need) noexcept {
    if (r->size - need < granularity_) return nullptr;
    Range* rest = take_range();
    *rest = Range{r->addr + need, r->size - need,        r->segment, r,
                  r->next,        Range::State::pending, r->tag,     r->epoch};
    rest->index = nullptr;
    rest->bin_prev = rest->bin_next = nullptr;
    if (r->next != nullptr) r->next->prev = rest;
    r->next = rest;
    r->size = need;
    return rest;
  }

  // The pending range `r` (taken for a block by its own stream, out of its entry) absorbs its
  // next neighbour, an untagged free range, and is cut at `need` bytes (r->size < need <=
  // the two together): the block keeps r's tag (its first bytes may carry the stream's queued
  // work), the rest past `need`, when at least `granularity` bytes, is filed untagged (it is
  // what is left of the untagged range). Takes no node.
  void take_with_untagged_next(Range* r, std::size_t need) noexcept {
    Range* next = r->next;
    remove_free(next);
    const std::size_t rest = r->size + next->size - need;
    if (rest < granularity_) {  // the block takes all of it
      r->size += next->size;
      r->next = next->next;
      if (next->next != nullptr) next->next->prev = r;
      recycle(next);
      return;
    }
    next->addr += need - r->size;  // the untagged range keeps its node and its neighbours
    next->size = rest;
    r->size = need;
    file(next);
  }

  // `left` absorbs `left->next` (both pending under one marker: one range, the later epoch),
  // whose node is recycled.
  void merge_pending(Range* left) noexcept {
    Range* right = left->next;
    left->size += right->size;
    left->epoch = std::max(left->epoch, right->epoch);
    left->next = right->next;
    if (right->next != nullptr) right->next->prev = left;
    recycle(right);
  }

  // Cuts the used, unfiled range `r` at `at` bytes (0 < at < r->size, a multiple of the
  // granularity): r keeps the first `at` bytes, the returned range (used, unfiled, r's
  // owner cleared) the rest. Takes a kept spare node.
  Range* cut_used(Range* r, std::size_t at) noexcept {
    Range* rest = take_range();
    *rest =
        Range{r->addr + at, r->size - at, r->segment, r, r->next, Range::State::used, kUntagged, 0};
    if (r->next != nullptr) r->next->prev = rest;
    r->next = rest;
    r->size = at;
    return rest;
  }

  // Splits `last` (free or pending, the last range of its segment) at `at`: the bytes from
  // `at` on become an untagged free range, which is returned (null: no host memory for the
  // node, nothing changed). Only for bytes no work can use whatever their tag (never mapped).
  Range* split_off_untagged(Range* last, char* at) noexcept;

  // Deletes every range of `segment`, and the segment.
  static void destroy(Segment* segment) noexcept;

 private:
  // A stream free also absorbs untagged neighbours; an untagged one only untagged ones.
  static bool mergeable(const Range* range, const Range* neighbour) noexcept {
    return neighbour != nullptr && neighbour->state == Range::State::free &&
           (neighbour->tag == range->tag || neighbour->tag == kUntagged);
  }
  Index* stream_index(StreamKey key) noexcept;   // index_of past its cache
  bool file_new_index(Range* range) noexcept;    // file() for a stream without an index
  void drop_index(const Index* index) noexcept;  // erase_index of the (emptied) index

  const std::size_t granularity_;  // every range is a multiple of it
  const unsigned unit_shift_;
  Index untagged_;
  // A fenced stream's index is erased; an emptied one only when more than kKeptEmptyIndices
  // streams have one. An erased index is empty and kept in spare_indices_ (up to
  // kSpareIndices) for the next stream: creating one writes its ~8 KB of bins.
  std::vector<StreamIndex> tagged_;
  std::vector<std::unique_ptr<Index>> spare_indices_;
  static constexpr std::size_t kKeptEmptyIndices = 4;
  static constexpr std::size_t kSpareIndices = 16;
  // The last stream looked up; cached_index_ null: no cache (reset by every erase).
  StreamKey cached_key_ = kUntagged;
  Index* cached_index_ = nullptr;
  Range* spare_ranges_ = nullptr;  // linked by `next`
  std::size_t spare_count_ = 0;
};

}  // namespace vram::detail
