// src/tier/stream_tags.hpp: a segment tier's stream-tagged free ranges and the markers that untag
// them.
//
// Reuse rule (DevicePool::deallocate_async): a range freed with stream S is tagged S and
// serves later requests on S at once. It becomes untagged (usable by any stream) only after
// a StreamFence marker recorded on S has completed, or after a device-wide quiesce that
// began after its free (forget()). Markers are recorded lazily, when another stream's
// request would otherwise grow the tier or on trim, so a free costs no event record:
// fencing a stream moves its free ranges (those freed before the record) to one Pending
// entry (state pending, unfiled) under one marker; polling untags the ranges of every completed
// marker and files them as free again. A stream may take back its own pending ranges at any time
// (they are safe for it in stream order).
//
// Which streams a fence records on (always with the tier's mutex released, see
// take_listed()): with a StreamWants (a DevicePool's tiers), only those
// that always_recordable() says exist whatever the caller did (the legacy default stream,
// for the null stream and every cudaStreamPerThread). A caller's stream is only wanted
// there: its marker is recorded by the next call that passes that stream (which proves it
// alive), and handed here by adopt(). Without one (a tier on its own, in tests) every
// stream is recorded on at once.
//
// Invariants: a pending range is in exactly one Pending entry, whose stream is its tag;
// pending ranges merge only with neighbours of their own entry (file_pending(): one marker
// covers both; the merged range keeps the later epoch) until untagged; every marker in
// pending_ is released exactly once (when its ranges are untagged or taken back, or at
// release_markers()); a kept marker (kept_: queried or waited for with no mutex held) is
// not released before its last holder is done (a release meanwhile is deferred to then).
//
// Not thread-safe: the owning tier calls it under its mutex (wait_outside(),
// query_outside() and record_outside() without it; begin_wait() .. end_wait() only by the
// holder of the tier's growth mutex).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "free_ranges.hpp"
#include "granule_map.hpp"
#include "stream_key.hpp"
#include "stream_wants.hpp"
#include "vram/stream_fence.hpp"

namespace vram::detail {

class StreamTags {
 public:
  using Range = FreeRanges::Range;

  // `map`: the tier's granules (a virtual-memory tier's never-mapped bytes serve any stream
  // without a fence, see could_serve()).
  // `wants`: where a caller's stream is wanted instead of recorded on (null: every stream
  // is recorded on at once).
  StreamTags(StreamFence& fence, FreeRanges& ranges, const GranuleMap& map,
             StreamWants* wants) noexcept
      : fence_(fence), ranges_(ranges), map_(map), wants_(wants) {}
  StreamTags(const StreamTags&) = delete;
  StreamTags& operator=(const StreamTags&) = delete;

  bool any_pending() const noexcept { return !pending_.empty(); }
  std::size_t pending_count() const noexcept { return pending_.size(); }
  // The epoch a free is stamped with; mark() advances it (DevicePool's synchronize, a
  // record: a range freed after the mark is not filed under the marker).
  std::uint64_t epoch() const noexcept { return epoch_; }
  std::uint64_t mark() noexcept { return ++epoch_; }

  // Untags the ranges whose markers completed (querying each, no wait).
  void poll() noexcept;
  // Fencing a stream lists it for a record (fence_stream()); the markers are recorded with
  // the tier's mutex released: see take_listed().
  // Lists every stream with free ranges: what trim() and a reclaim start with.
  void fence_all() noexcept { fence_other_streams(kUntagged); }
  // Lists every stream but `except` with free ranges (need > 0: only those with a range
  // that could_serve(need)); true when some were listed.
  bool fence_other_streams(StreamKey except, std::size_t need = 0) noexcept;
  // Lists `key`'s stream, when it has an index of free ranges.
  void fence(StreamKey key) noexcept;
  // Recording (any thread): the caller takes the listed streams (take_listed(), false when
  // none), takes a mark(), releases the mutex, calls record_outside() (records a marker on
  // each stream and asks at once whether it completed), takes the mutex again and calls
  // end_record(), which moves each stream's ranges freed before the mark to one Pending
  // entry under its marker (adopt()) and untags at once those whose marker had completed.
  // A range freed after the mark keeps its stream: work queued after the marker may use it.
  struct Record {
    StreamKey key;
    std::uint64_t marker = 0;
    bool recorded = false;  // false: captured, or a driver error: the ranges keep their tag
    bool done = false;
  };
  bool any_listed() const noexcept { return !to_record_.empty(); }
  bool take_listed(std::vector<Record>& out) noexcept;
  void record_outside(std::vector<Record>& records) noexcept;
  void end_record(const std::vector<Record>& records, std::uint64_t mark) noexcept;
  // `r` (just taken out of the live blocks, tag and epoch set) was freed by a call that first
  // recorded `marker` on r's stream; `recorder` names the caller (its thread's cache). r
  // becomes pending under the marker, joining the entry of an earlier free on the stream by
  // the same recorder (program order: its marker came earlier on the stream, so it is
  // released and the new one covers both) while that entry has fewer than kMaxJoined ranges;
  // else in an entry of its own. Never joins another recorder's entry or adopt()'s: their
  // markers may have been recorded after this one. False (nothing changed, the caller frees r
  // as usual and keeps the marker) when no host memory is left for a new entry.
  // r merges with its neighbours in that entry (merge_in_entry()).
  bool file_pending(Range* r, std::uint64_t marker, const void* recorder) noexcept;
  // The smallest of `stream`'s pending ranges that spans `need` bytes of mapped memory: safe
  // for the stream itself in stream order, so its own requests use them before its marker
  // completed. With `stretch`, when none does: the one too small for `need` whose next
  // neighbour is an untagged free range that makes up the rest, all mapped under `need`, the
  // two smallest together (a stream that frees a block and asks for a larger one; no map can
  // fail after the claim). Null: none.
  Range* own_pending_fit(StreamKey stream, std::size_t need, bool stretch) const noexcept;
  // `r` (an own_pending_fit() result) leaves its entry for a block of
  // `need` bytes: its rest past `need` stays pending in its place (FreeRanges::split_pending),
  // or, when r is smaller than `need`, it takes the rest from its untagged next neighbour
  // (FreeRanges::take_with_untagged_next); an entry left with no range releases its marker.
  // The caller marks r used.
  void take_pending(Range* r, std::size_t need) noexcept;
  // `marker` was recorded on `key`'s stream after mark() returned `mark`: the stream's free
  // ranges freed before the mark become one Pending entry under it. False (the caller
  // releases the marker) when there was none.
  bool adopt(StreamKey key, std::uint64_t marker, std::uint64_t mark) noexcept;
  // Some free range of a stream other than `except` that no marker can be recorded for
  // now (a wanted one) could serve `need` bytes, or (whole_segments) fills a whole segment:
  // only a quiesce would free it for other streams now.
  bool stranded(StreamKey except, std::size_t need, bool whole_segments) const noexcept;
  // The stream has free ranges here.
  bool holds(StreamKey key) const noexcept {
    const std::size_t slot = ranges_.stream_slot(key);
    return slot != ranges_.streams().size() && !ranges_.streams()[slot].index->empty();
  }
  // The pending ranges of `stream` that a want's or a fence's marker covers (adopt()'s entries)
  // become its free ranges again (their markers are released unawaited); false when there
  // were none. file_pending()'s stay: their stream may be gone by the time another needs them,
  // and the stream itself takes them through own_pending_fit().
  bool take_back(StreamKey stream) noexcept;
  // `r` (free or pending) with the free or pending ranges beside it, which it merges with
  // once all are untagged, spans `need` bytes (virtual mode: of memory mapped before).
  bool could_serve(const Range* r, std::size_t need) const noexcept;
  // Waits for the marker of every Pending entry (but `skip`'s stream's; kUntagged: none
  // skipped) with a range for which `serves(range)` holds, then polls; false when there was
  // none.
  template <class Serves>
  bool wait_for(StreamKey skip, Serves serves) noexcept {
    bool waited = false;
    for (const Pending& p : pending_) {
      if (p.stream == skip) continue;
      if (std::any_of(p.ranges.begin(), p.ranges.end(), serves)) {
        fence_.wait(p.marker);
        waited = true;
      }
    }
    if (waited) poll();
    return waited;
  }
  // Markers are queried and waited for with the tier's mutex released: a marker listed for
  // that is kept (kept_) until the caller is done with it, and a release meanwhile (its
  // entry untagged or taken back by another thread) is deferred to then, so the number never
  // names a recycled event while it is queried or waited for. Each call below but
  // wait_outside() and query_outside() runs under the mutex.
  //
  // Waiting (the growth mutex holder only): begin_wait() lists the markers wait_for(skip,
  // serves) would wait for in waiting_; the caller releases the mutex, calls
  // wait_outside() (waits, then asks each whether it completed), takes the mutex again and
  // calls end_wait(), which untags the entries of those that completed. False from
  // begin_wait(): nothing to wait for. With no host memory for the lists it waits under the
  // mutex (as wait_for()) and returns whether it did, with nothing listed: the caller's
  // wait_outside() and end_wait() then do nothing, and the ranges may have changed.
  template <class Serves>
  bool begin_wait(StreamKey skip, Serves serves) noexcept {
    try {
      for (const Pending& p : pending_) {
        if (p.stream != skip && std::any_of(p.ranges.begin(), p.ranges.end(), serves)) {
          waiting_.push_back(p.marker);
        }
      }
      waited_done_.assign(waiting_.size(), 0);
      kept_.reserve(kept_.size() + waiting_.size());
    } catch (...) {  // nothing listed: waits under the mutex instead
      waiting_.clear();
      waited_done_.clear();
      return wait_for(skip, serves);
    }
    for (const std::uint64_t marker : waiting_) keep(marker);  // reserved: no throw
    return !waiting_.empty();
  }
  void wait_outside() noexcept {
    for (std::size_t i = 0; i < waiting_.size(); ++i) {
      fence_.wait(waiting_[i]);
      waited_done_[i] = fence_.completed(waiting_[i]) ? 1 : 0;
    }
  }
  void end_wait() noexcept;
  // Polling (any thread): begin_query() lists up to `most` markers in `markers` (a few at a
  // time, in turn: each call starts where the last one stopped) and returns how many; the
  // caller releases the mutex, calls query_outside(), takes the mutex again and calls
  // end_query(), which untags the entries of those that completed.
  std::size_t begin_query(std::uint64_t* markers, std::size_t most) noexcept;
  void query_outside(const std::uint64_t* markers, bool* done, std::size_t count) noexcept {
    for (std::size_t i = 0; i < count; ++i) done[i] = fence_.completed(markers[i]);
  }
  void end_query(const std::uint64_t* markers, const bool* done, std::size_t count) noexcept;
  // After the fence's quiesce() that followed mark() returned `mark`: every range freed on
  // a stream before the mark becomes untagged, with no marker recorded.
  void forget(std::uint64_t mark) noexcept;
  // Releases every marker still pending (the tier's destruction).
  void release_markers() noexcept;

 private:
  struct Pending {
    std::uint64_t marker;
    StreamKey stream;  // the stream the marker was recorded on (the ranges' tag)
    std::vector<Range*> ranges;
    // file_pending()'s entries: the caller that recorded the marker (its next frees on the
    // stream may join: their markers come later on it); null for adopt()'s (a want, a fence).
    const void* recorder = nullptr;
  };
  // An entry takes at most this many frees before a new one starts: a stream that keeps
  // freeing does not hold its older ranges back behind ever newer markers.
  static constexpr std::size_t kMaxJoined = 16;
  // Lists streams()[slot]'s stream in to_record_ (a wanted one: asks for its marker
  // instead, StreamWants); false when it was not listed.
  bool fence_stream(std::size_t slot) noexcept;
  // Untags and refiles every range of pending_[i], releases its marker and drops the entry
  // (the last entry moves to i).
  void untag(std::size_t i) noexcept;
  // `r`, just joined to `entry`, absorbs or is absorbed by its neighbours pending in the same
  // entry.
  void merge_in_entry(Pending& entry, Range* r) noexcept;
  // Releases `marker`, or defers that while it is kept.
  void release(std::uint64_t marker) noexcept;
  // One more holder of `marker` (false, nothing kept, when no host memory for the entry).
  bool keep(std::uint64_t marker) noexcept;
  // One holder less; the last releases it when a release was deferred.
  void unkeep(std::uint64_t marker) noexcept;
  // The entry of `marker` completed: untagged (no-op when it is no longer pending).
  void untag_marker(std::uint64_t marker) noexcept;
  void drop(std::size_t i) noexcept {  // the last entry moves to i
    pending_[i] = std::move(pending_.back());
    pending_.pop_back();
  }

  StreamFence& fence_;
  FreeRanges& ranges_;
  const GranuleMap& map_;
  StreamWants* const wants_;
  std::vector<Pending> pending_;
  struct Kept {
    std::uint64_t marker;
    std::uint32_t holders;
    bool released;  // released while kept: the last holder releases it
  };
  std::vector<Kept> kept_;
  std::vector<StreamKey> to_record_;    // listed for a record (take_listed())
  std::vector<std::uint64_t> waiting_;  // begin_wait() .. end_wait()
  std::vector<char> waited_done_;       // waiting_[i] completed (wait_outside())
  std::size_t query_cursor_ = 0;        // where the next begin_query() starts
  std::uint64_t epoch_ = 0;
};

}  // namespace vram::detail
