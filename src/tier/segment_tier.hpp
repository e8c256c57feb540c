// src/tier/segment_tier.hpp: DevicePool's segment tier: best-fit split and coalesce over segments
// from the upstream, stream-tagged free ranges, one short mutex.
//
// Every block DevicePool hands out lives in a segment: small blocks (size classes up to
// 1 MiB; over virtual memory, by default only those up to 256 KiB) in a SegmentTier of
// 2 MiB segments, the others in a second SegmentTier whose segments are 20 MiB for requests
// under 10 MiB and the request rounded up to 2 MiB above that (or one reserved range of
// mapped granules). A request takes the smallest free range that fits (best fit; ties:
// lowest address) and splits off the rest; a freed range merges with free neighbours
// (free_ranges.hpp). So memory is reused across sizes, not only within a size class.
//
// The tier composes:
//   FreeRanges   (free_ranges.hpp)   ranges, segments' nodes, best fit, split, coalesce;
//   StreamTags   (stream_tags.hpp)   stream tags, lazily recorded markers, untagging;
//   GranuleMap   (granule_map.hpp)   virtual mode: mapped granules, runs, map-ahead;
//   GrowthBudget (growth_budget.hpp) reserved/used accounting against the shared gauge.
// segment_tier.cpp holds the public calls (each takes the mutex, lock()) and the fit;
// segment_tier_growth.cpp how the tier takes memory from the upstream and gives it back.
//
// Growth: when a request fits no free range, the tier grows. Reserved (of all tiers
// sharing the ReservedGauge) may exceed the sum of each tier's own peak of used bytes by a
// headroom (DevicePool::Options::growth_headroom, 1/16); past that, wholly free segments
// covering the excess go back to the upstream before the new segment is taken (none of
// them could serve the request; the smallest that covers it, else the largest ones; one
// freed with a stream after the host waited for a marker on that stream). A wholly free
// segment is not split for a request that would leave more than max_segment_waste idle in
// it: the tier grows instead. Free bytes above max_free_bytes are given back on release.
// trim() gives back every wholly free segment.
//
// Streams (stream_tags.hpp): a range freed with a stream serves that stream at once and
// any stream once a marker recorded on it has completed (or after a quiesce). A marker on a
// caller's stream is only wanted here (stream_wants.hpp): that stream's next call records
// it (adopt_marker). Before growing, a segment tier waits for the recorded markers of wholly
// free segments that could serve the request (past the budget: of every wholly free
// segment, which may then go back); a virtual tier takes back the requester's own fenced
// ranges and, only past the budget, waits for the other streams' fenced ranges that could
// serve it; within the budget it maps at once. Past the budget with ranges of wanted
// streams that could serve (stranded), allocate() asks its caller to quiesce instead.
// Plain frees are untagged.
//
// Two mutexes. `mutex_` (a TierMutex) guards the books; it is held only for short critical
// sections with no driver or upstream call in them: no map, unmap, reservation, cudaMalloc,
// cudaFree, event record, query or wait. `grow_mutex_` orders the calls that change what
// the tier holds: growing (allocate with may_grow), trim(), release_empty_for(), and the
// give-back after a free() (give_back_over_cap(); only when the growth mutex is free at once:
// otherwise it gives nothing back and the holder of the growth mutex does it before it lets
// go, end_growth()). Its holder decides under `mutex_`, releases it for the upstream calls (a
// new segment; the address reservation; the runs under a block and its map-ahead, and their
// out-of-memory retry; segments or runs given back, taken off the books first, `detached_`),
// and takes it again to file the result. Meanwhile the other threads allocate and free from
// the free ranges: the grower's range is used (nothing merges with it) and granules being
// mapped read as unmapped, so a request that needs them grows, that is, waits for the
// growth mutex and then fits again. Lock order: grow_mutex_, then mutex_.
//
// Stream markers the same way, on any thread: a fence lists the streams to record on
// (StreamTags::take_listed); the caller records with the mutex released, then files under
// each marker the ranges freed before it (as DevicePoolCore::serve_want does for a wanted
// stream), so a range freed during the record keeps its stream. Pending markers are queried
// a few at a time at the start of every allocate (StreamTags::begin_query), and the host's
// waits (growing past the budget, trim with wait) are made by the growth mutex holder, each
// with the markers kept alive meanwhile. A wait untags only the entries it waited for.
// Only fallbacks make a driver call under `mutex_`: when no host memory is left for a list
// (a segment or run given back at once, a wait under the mutex).
// The figures during a growth: memory given back leaves the books (reserved, the shared
// gauge) before its upstream call, a map or segment enters them after its call, so they
// may read low by what is in flight; the grower's range is neither used nor free.
//
// Invariants (under the mutex): reserved == sum of segment sizes (virtual mode: of mapped
// runs) == used + free bytes (free includes tagged and pending ranges); the free-range
// invariants of free_ranges.hpp; every used range is in `live_`, and no other, but the one
// range of the growth in progress, which is in neither.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "free_ranges.hpp"
#include "granule_map.hpp"
#include "growth_budget.hpp"
#include "lease_owner.hpp"
#include "stream_key.hpp"
#include "stream_tags.hpp"
#include "vram/detail/pointer_map.hpp"
#include "vram/detail/tier_mutex.hpp"
#include "vram/memory_map.hpp"
#include "vram/stream_fence.hpp"
#include "vram/upstream.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::detail {

class SegmentTier {
 public:
  struct Options {
    std::size_t granularity = 512;  // every range is a multiple of it
    std::size_t min_segment = std::size_t{2} << 20;
    std::size_t packed_segment = std::size_t{20} << 20;  // for requests under packed_limit
    std::size_t packed_limit = std::size_t{10} << 20;
    std::size_t segment_rounding = std::size_t{2} << 20;
    std::size_t max_free_bytes = SIZE_MAX;
    // A wholly free segment is not split for a request that would leave more than this
    // idle in it: a segment sized for the request is taken (the idle one goes back only
    // when growing passes the budget, like any wholly free segment).
    std::size_t max_segment_waste = SIZE_MAX;
    // Virtual-memory mode: one reserved range of `reservation` bytes instead of segments;
    // reserved bytes are the granules mapped, in runs (the unmapped granules under a new
    // range, one physical allocation). Runs wholly inside free, untagged ranges are
    // unmapped on trim, when free mapped bytes pass max_free_bytes, when a map fails, and,
    // with unmap_before_map, before a new map that would pass the growth budget of the
    // ReservedGauge (the sum of its tiers' peaks of used bytes plus growth_headroom_1024/1024).
    VirtualMemory* virtual_memory = nullptr;
    std::size_t reservation = std::size_t{64} << 30;
    bool unmap_before_map = false;
    // The longest run one map covers (also at most 1/16 of the physical memory still
    // available, GranuleMap::run_granule_cap()): a run goes back only whole, so a block left
    // in a freed run keeps at most this much mapped.
    std::size_t max_run_bytes = std::size_t{1} << 30;
    // A map for a block that raises the tier's peak of used bytes (since it last unmapped
    // granules) also covers up to this much of the untagged free range after it
    // (GranuleMap::map_ahead_end()).
    std::size_t map_ahead_bytes = 0;
    // Reserved may reach the tiers' peaks of used bytes plus this many 1024ths before growing
    // gives wholly free segments back (64: 1/16).
    std::size_t growth_headroom_1024 = 64;
    // Where a caller's stream is wanted instead of recorded on (stream_tags.hpp); null:
    // every stream is recorded on at once (a tier used on its own).
    StreamWants* wants = nullptr;
  };
  using Counters = TierCounters;

  SegmentTier(Upstream& upstream, StreamFence& fence, ReservedGauge& gauge, Options options);
  ~SegmentTier();
  SegmentTier(const SegmentTier&) = delete;
  SegmentTier& operator=(const SegmentTier&) = delete;

  std::size_t round(std::size_t bytes) const noexcept {
    return (bytes + options_.granularity - 1) & ~(options_.granularity - 1);
  }
  // Every call below that takes `bytes` takes them rounded already (bytes == round(bytes),
  // asserted): the caller rounds once (DevicePoolCore's Request) and carries the result.
  // A range of `bytes` usable on `stream` (kUntagged: any stream, completed work only).
  // Without may_grow: null when no free range fits. With it, a new segment (after giving
  // back the wholly free ones); throws the upstream's OutOfMemory or CudaError.
  // `quiesce` (may_grow only): growing would pass the budget while free ranges of wanted
  // streams (stream_tags.hpp: stranded()) could serve the request or go back: nothing is
  // done, *quiesce is set and null returned, so that the caller quiesces the device
  // (outside any tier mutex) and asks again without it.
  // `owner`: the thread cache the block is handed to, filed with it (lease_owner.hpp).
  // `served`, when given: the tag of the free range the block was cut from (`stream`, or
  // kUntagged: memory any stream may use).
  void* allocate(std::size_t bytes, StreamKey stream, bool may_grow, bool* quiesce = nullptr,
                 LeaseOwner* owner = nullptr, StreamKey* served = nullptr);
  // The marker protocol of a wanted stream (DevicePoolCore::serve_want): whether `key` has
  // free ranges here; after mark_frees() returned `mark` and `marker` was recorded on the
  // stream, its ranges freed before the mark wait for the marker (false: none, the caller
  // releases the marker).
  bool holds_stream(StreamKey key) const noexcept;
  bool adopt_marker(StreamKey key, std::uint64_t marker, std::uint64_t mark) noexcept;
  // Wholly free segments of wanted streams exist (past the budget only a quiesce could
  // give them back).
  bool stranded_segments() const noexcept;
  // What a growth for a request of `bytes` would do, read under one taking of the mutex
  // (DevicePoolCore::tier_grow decides from it whether the tiers give segments back first).
  struct GrowthQuote {
    std::size_t growth_bytes = 0;  // the segment (virtual mode: the granules) it takes
    std::size_t peak_growth = 0;   // by how much it raises the tier's peak of used bytes
    std::size_t empty_bytes = 0;   // wholly free, untagged segments (virtual mode: 0)
    bool stranded = false;         // stranded_segments()
  };
  GrowthQuote quote_growth(std::size_t bytes) const noexcept;
  // Returns a block from allocate(); `tag` is the freeing stream or kUntagged; `by`: the
  // thread cache it is released through (null: none). False (and nothing changed) when the
  // block is not live here, when `bytes` (0: not checked) is not what allocate() was asked
  // for, or when its owner holds it cached and `by` is not that
  // owner (a double release; lease_owner.hpp). A block released by another than its owner
  // revokes the owner's records.
  bool free(void* block, StreamKey tag, std::size_t bytes = 0,
            const LeaseOwner* by = nullptr) noexcept {
    const Freed freed = free_keeping(block, tag, bytes, by);
    if (freed == Freed::over_cap) give_back_over_cap();
    return freed != Freed::foreign;
  }
  // free() without its give-back, for a caller that must mark the upstream calls of that
  // one (a SlowSection): over_cap when an untagged free left more than max_free_bytes free;
  // the caller then calls give_back_over_cap(). foreign: as free()'s false.
  // `marker`: one recorded on `tag`'s stream after the work queued on it before the free (the
  // freeing call recorded it first): the block is filed pending under it at once, with no
  // moment free under its tag alone (stream_tags.hpp: file_pending()), and the tier owns the
  // marker (taken); not taken (the caller releases it) when the block is foreign or no host
  // memory was left for the entry (then freed under its tag, as without a marker).
  struct FreeMarker {
    std::uint64_t marker = 0;
    const void* recorder = nullptr;  // who recorded it (stream_tags.hpp: file_pending())
    bool taken = false;
  };
  enum class Freed { foreign, kept, over_cap };
  Freed free_keeping(void* block, StreamKey tag, std::size_t bytes = 0,
                     const LeaseOwner* by = nullptr, FreeMarker* marker = nullptr) noexcept;
  // A block handed out whole to LeaseOwner::heap_chunks() and returned in pieces that each
  // carry their own tag (a thread heap's chunk, thread_heap.hpp): `pieces` cover the block in
  // address order, each a multiple of the granularity. Each piece is freed as free_keeping() frees
  // a block with its tag (merging with its free neighbours by the coalescing rule,
  // free_ranges.hpp). As free_keeping() otherwise; foreign also when no host memory is left for the
  // cuts (nothing changed: the caller keeps the block).
  struct Piece {
    std::size_t bytes;
    StreamKey tag;
  };
  // `marker` (or null): recorded on stream `marked` by the returning call after every use of
  // the chunk's blocks on it; the largest piece tagged `marked` goes pending under it
  // (free_keeping's rule; marker->taken then set), so other streams' requests find it free
  // once the marker completed, with no want or quiesce.
  Freed free_pieces(void* block, std::size_t bytes, const Piece* pieces, std::size_t count,
                    FreeMarker* marker = nullptr, StreamKey marked = kUntagged) noexcept;
  // Gives free memory back down to max_free_bytes (the upstream calls with the mutex
  // released); when a growth is under way, its holder does it before it lets go.
  void give_back_over_cap() noexcept;
  // Untags ranges whose markers completed (recording markers for every tagged stream;
  // with `wait`, blocking until they complete), then gives back wholly free segments
  // while more than keep_free bytes are free.
  void trim(std::size_t keep_free, bool wait) noexcept;
  // Marks the frees made so far: call it before the fence's quiesce(), then pass its
  // result to forget_streams().
  std::uint64_t mark_frees() noexcept;
  // After the fence's quiesce() that followed mark_frees() (every stream's work queued
  // before it has completed): every range freed on a stream before the mark becomes free
  // for all streams, with no marker recorded on any stream (a stream may have been
  // destroyed since its frees). A range freed after the mark (while the device was being
  // synchronized, on another thread) keeps its stream: work queued after the synchronize
  // began may still use it.
  void forget_streams(std::uint64_t mark) noexcept;
  std::size_t growth_headroom_1024() const noexcept { return options_.growth_headroom_1024; }
  // The tier's peak of used bytes restarts from what is used now (DevicePool::trim).
  void restart_peak() noexcept;
  // False for a virtual-memory tier without unmap_before_map: it maps new granules without
  // checking the growth budget (its free mapped bytes are bounded by max_free_bytes).
  bool enforces_growth_budget() const noexcept {
    return options_.virtual_memory == nullptr || options_.unmap_before_map;
  }
  // Gives back wholly free segments covering at least `bytes` (waiting first for the
  // streams of stream-tagged ones): what a sibling tier calls before it grows.
  void release_empty_for(std::size_t bytes) noexcept;
  bool owns(void* block) const noexcept;
  // Calls that found the tier's mutex held so far (wraps): whether threads meet here.
  std::uint32_t contentions() const noexcept { return mutex_.contentions(); }
  Counters counters() const noexcept;
  void reset_peak() noexcept;
  // Appends the tier's segments (virtual mode: its extents of wholly mapped ranges) to
  // `out`, marked `large`. Throws std::bad_alloc (the tier unchanged).
  void describe(bool large, std::vector<DevicePoolSegment>& out) const;

 private:
  using Range = FreeRanges::Range;
  using Segment = FreeRanges::Segment;
  using Lock = std::unique_lock<TierMutex>;

  // The one place the tier takes its mutex. Each public call above that reads or changes
  // the tier holds it for its body (segment_tier.cpp), but a growth mutex holder's upstream
  // calls; every private member function runs under it unless it says otherwise. No holder
  // blocks on a marker but in a fallback (no host memory for a list).
  [[nodiscard]] Lock lock() const noexcept { return Lock(mutex_); }
  // Gives `detached_` back to the upstream (or unmaps it): the growth mutex held, the tier's
  // mutex not.
  void give_back_detached() noexcept;
  // Holds the growth mutex for its life; at its end hands back what is detached and lets go
  // through end_growth().
  class Growth {
   public:
    explicit Growth(SegmentTier& tier) : tier_(tier) { tier_.grow_mutex_.lock(); }
    ~Growth();
    Growth(const Growth&) = delete;
    Growth& operator=(const Growth&) = delete;

   private:
    SegmentTier& tier_;
  };
  // Unlocks the growth mutex (held, the tier's mutex not), first giving back what frees
  // owed meanwhile (give_back_owed_), with the final check and the unlock under the tier's
  // mutex.
  void end_growth() noexcept;
  // Waits for the markers of other streams than `skip` whose pending ranges `serves`, with
  // `locked` released (the growth mutex held), then untags what completed; false (and the
  // mutex never released) when there was none, true when the ranges may have changed (the
  // caller fits again).
  template <class Serves>
  bool wait_unlocked(Lock& locked, StreamKey skip, Serves serves) noexcept {
    if (!tags_.begin_wait(skip, serves)) return false;
    locked.unlock();
    tags_.wait_outside();
    locked.lock();
    tags_.end_wait();
    return true;
  }
  // Untags what completed among a few pending markers (StreamTags::begin_query), asking
  // the fence with `locked` released; returns with it held.
  static constexpr std::size_t kPollBatch = 32;
  void poll_unlocked(Lock& locked) noexcept {
    if (tags_.any_pending()) [[unlikely]]
      poll_batch_unlocked(locked);
  }
  [[gnu::noinline]] void poll_batch_unlocked(Lock& locked) noexcept {
    std::uint64_t markers[kPollBatch];
    bool done[kPollBatch];
    query_unlocked(locked, markers, done, kPollBatch);
  }
  // Up to `most` pending markers, in turn (StreamTags::begin_query), asked with `locked`
  // released (`markers`, `done`: room for `most`); untags what completed.
  void query_unlocked(Lock& locked, std::uint64_t* markers, bool* done, std::size_t most) noexcept {
    const std::size_t count = tags_.begin_query(markers, most);
    if (count == 0) return;
    locked.unlock();
    tags_.query_outside(markers, done, count);
    locked.lock();
    tags_.end_query(markers, done, count);
  }
  // Records a marker on each stream the fences listed (StreamTags::take_listed) with `locked`
  // released, then files the ranges freed before the records under them; false (the mutex
  // never released) when none was listed.
  bool record_listed(Lock& locked) noexcept;
  // Fences every stream with free ranges (trim, a reclaim) and asks every pending marker,
  // the driver calls with `locked` released.
  void fence_all_unlocked(Lock& locked) noexcept;
  // Asks every pending marker (listed at once, kept meanwhile) with `locked` released, then
  // untags what completed.
  void poll_all_unlocked(Lock& locked) noexcept;
  // Before any change, and again after `mutex_` was released (other threads may have used
  // the spares): a new range, a split-off rest and the filing of a block cannot fail.
  // Throws bad_alloc.
  void reserve_spares() {
    ranges_.keep_spares(2);
    live_.reserve_one();
  }
  // A used range `r` (split to its block) filed as a live block: its address. live_ reserved.
  void* file_used(Range* r, LeaseOwner* owner, StreamKey* served) noexcept {
    if (served != nullptr) *served = r->tag;
    live_.insert(r->addr, r);
    r->tag = kUntagged;
    r->owner = owner;
    budget_.take(r->size);
    return r->addr;
  }
  // allocate() with may_grow, the growth mutex held.
  void* allocate_growing(std::size_t need, StreamKey stream, bool* quiesce, LeaseOwner* owner,
                         StreamKey* served);
  // Bytes of the segment (virtual mode: the granules) a request of `need` bytes grows by.
  std::size_t growth_bytes(std::size_t need) const noexcept {
    const std::size_t granule = map_.granule();
    if (granule != 0) return (need + granule - 1) / granule * granule;  // virtual
    return segment_size_for(need);
  }
  // Bytes of wholly free, untagged segments (virtual mode: 0, granules are not segments).
  std::size_t empty_bytes_locked() const noexcept;
  bool stranded_segments_locked() const noexcept;

  // --- the fit (segment_tier.cpp) ---
  // `mapped`: whether the result's granules under `bytes` are all mapped (virtual mode; true
  // in segment mode and for null).
  Range* best_fit(StreamKey key, std::size_t bytes, bool& mapped) noexcept;
  Range* mapped_fit(FreeRanges::Index* index, Range* best, std::size_t bytes,
                    bool& mapped) noexcept;
  // Best fit for `need` bytes on `stream` (its own ranges or untagged ones); null when
  // nothing fits or the fit is a wholly free segment that would leave more than
  // max_segment_waste idle. With `fence`, when the tier would otherwise grow, other streams
  // are fenced first (listed for a record: fit_fenced()).
  // `mapped`: as best_fit's, for the result (no map or unmap happens between fit() and the
  // caller's use of it).
  Range* fit(StreamKey stream, std::size_t need, bool& mapped, bool fence) noexcept;
  // fit() with fence; when it listed streams, records their markers with `locked` released
  // (record_listed()), asks every pending marker and fits again. Throws bad_alloc (the books
  // consistent: markers filed, ranges taken back or untagged).
  Range* fit_fenced(StreamKey stream, std::size_t need, bool& mapped, Lock& locked) {
    Range* r = fit(stream, need, mapped, /*fence=*/true);
    if (!tags_.any_listed()) [[likely]]
      return r;
    return refit_after_records(stream, need, mapped, locked, r);
  }
  // fit_fenced() once fit() listed streams: `r` when record_listed() records nothing.
  Range* refit_after_records(StreamKey stream, std::size_t need, bool& mapped, Lock& locked,
                             Range* r);
  // Bytes the tier grows by when `r` (null: no fit) serves `need` bytes (virtual mode: the
  // granules under it not mapped yet), and whether that passes the growth budget.
  std::size_t growth_for(const Range* r, std::size_t need) const noexcept;
  bool past_budget(const Range* r, std::size_t need) const noexcept;
  // Takes fit()'s `r` out of the free ranges (a free one split at `need`, its rest filed free)
  // or out of its stream's pending entry (stream_tags.hpp: take_pending()); the caller marks
  // it used.
  [[gnu::always_inline]] inline void claim_fit(Range* r, std::size_t need) noexcept;

  // --- growing and giving back (segment_tier_growth.cpp) ---
  std::size_t segment_size_for(std::size_t bytes) const noexcept;
  // A new segment for `need` bytes, its one free range returned unfiled (after giving back
  // wholly free segments past the budget); throws the upstream's exceptions. Releases
  // `locked` for the upstream calls (the growth mutex held); returns with it held.
  Range* grow_segment(std::size_t need, Lock& locked);
  // Virtual mode: the never-mapped end of the reservation split off as an untagged range
  // of at least `need` bytes, when the last range is a stream's; null otherwise.
  Range* fresh_tail(std::size_t need) noexcept;
  // Virtual mode: the reserved range, taken with `locked` released (the growth mutex held).
  void reserve_range(Lock& locked);
  // Every granule under `range` (used, filed nowhere): the driver calls (the query of
  // available memory, the maps, the fences of a reclaim) made with `locked` released (the
  // growth mutex held); returns with it held. On out of memory: again without map-ahead,
  // then after a reclaim of every free run; throws OutOfMemory when that fails too.
  void map_range(Range* range, Lock& locked);
  // The physical memory left, as the driver tells it, asked with `locked` released.
  std::size_t available_unlocked(Lock& locked) noexcept;
  // Maps the unmapped granules in [first, last] in runs of at most `cap` granules, the
  // driver calls with `locked` released, after handing back `detached_`; what mapped is filed
  // whatever failed after it. False on out of memory (with `last_try`: throws it).
  bool map_runs(std::size_t first, std::size_t last, std::size_t cap, Lock& locked, bool last_try);
  // With unmap_before_map, free runs past the growth budget go (into `detached_`) before a
  // map of `new_granules` for `range`.
  void unmap_before_mapping(const Range* range, std::size_t new_granules, Lock& locked) noexcept;
  // Fences every stream, untags what completed, then takes free runs (but those under
  // `except`) off the books until at most keep_free bytes are free, into `detached_` (the
  // caller hands them back before it maps).
  void reclaim(std::size_t keep_free, const Range* except, Lock& locked) noexcept;
  // Takes free memory (segments or runs) off the books until at most keep_free is free,
  // into `detached_` (the growth mutex held).
  void give_back(std::size_t keep_free) noexcept;
  // Waits for the streams of wholly free stream-tagged (or pending) segments, so that they
  // become untagged, with `locked` released for the wait (the growth mutex held); false when
  // there was none. need > 0: only segments that could then serve a request of `need`
  // bytes (0: all, e.g. to give them back).
  bool wait_for_empty_segments(std::size_t need, Lock& locked) noexcept;
  void release_empty_segments(std::size_t keep_free) noexcept;
  // The smallest wholly free segment of at least `bytes`, else the largest ones until they
  // cover it; returns the bytes given back.
  std::size_t release_empty_segments_for(std::size_t bytes) noexcept;
  // Takes a wholly free segment off the books, into `detached_` (or back to the upstream at
  // once when the list cannot grow).
  void release_segment(Segment* segment) noexcept;

  Upstream& upstream_;
  const Options options_;
  mutable TierMutex mutex_;
  std::mutex grow_mutex_;
  // A free() past max_free_bytes found the growth mutex held: the holder gives back before
  // it lets go (under mutex_).
  bool give_back_owed_ = false;
  // Memory off the books, waiting for its upstream call (only the growth mutex holder
  // touches it).
  std::vector<DetachedMemory> detached_;
  GrowthBudget budget_;
  FreeRanges ranges_;
  GranuleMap map_;
  StreamTags tags_;
  PointerMap<Range> live_;
  std::vector<Segment*> segments_;
};

}  // namespace vram::detail
