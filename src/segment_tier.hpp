// segment_tier.hpp: DevicePool's segment tier: best-fit split and coalesce
// over segments from the upstream, stream-tagged free ranges, one short mutex.
//
// Every block DevicePool hands out lives in a segment: small blocks (size classes up to
// 1 MiB; over virtual memory, by default only those up to 256 KiB) in a SegmentTier of
// 2 MiB segments, the others in a second SegmentTier whose segments are 20 MiB for requests
// under 10 MiB and the request rounded up to 2 MiB above that (or one reserved range of
// mapped granules). A request takes the smallest free range that fits (best fit; ties: lowest
// address) and splits off the rest; a freed range merges with free neighbours of the
// same tag (a stream-tagged one also with untagged neighbours, and takes its tag). So memory is
// reused across sizes, not only within a size class.
//
// Reserved follows the peak of used: when a request fits no free range, the tier grows.
// Reserved (of all tiers sharing the ReservedGauge) may exceed the sum of each tier's own
// peak of used bytes by a headroom (DevicePool::Options::growth_headroom, 1/16); past that, wholly
// free segments covering the excess go back to the upstream before the new segment is taken (none
// of them could serve the request; the smallest that covers it, else the largest ones; one freed
// with a stream after the host waited for a marker on that stream). A wholly free segment is not
// split for a request that would leave more than max_segment_waste idle in it: the tier grows
// instead. Free bytes above max_free_bytes are given back on release. trim() gives back every
// wholly free segment.
//
// Stream tags (reuse rule of DevicePool::deallocate_async): a range freed with stream S
// is tagged S and serves later requests on S at once. It becomes untagged (usable by any
// stream) only after a StreamFence marker recorded on S has completed; markers are
// recorded lazily, when another stream's request would otherwise grow the tier (nothing
// fits, or in virtual mode only unmapped granules do) or on trim, so a free costs no event
// record. Before growing, a segment tier waits for the markers of wholly free segments that
// could serve the request (past the budget below: of every wholly free segment, which may
// then go back); a virtual tier takes back the requester's own fenced ranges and, only past
// the budget, waits for the other streams' fenced ranges that could serve it; within the
// budget it maps at once.
// Plain frees are untagged.
//
// Invariants (under the mutex): reserved == sum of segment sizes == used + free bytes
// (free includes tagged and pending ranges); no two adjacent free ranges have the same
// tag (an untagged range may border a stream-tagged one: untagging does not merge into a
// stream) and neither is pending; every used range is in `live_`.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "free_index.hpp"
#include "vram/detail/pointer_map.hpp"
#include "vram/detail/tier_mutex.hpp"
#include "vram/stream_fence.hpp"
#include "vram/upstream.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::detail {

using StreamKey = std::uintptr_t;
inline constexpr StreamKey kUntagged = ~StreamKey{0};
// A stream's key is its handle, except for cudaStreamPerThread, which names another stream
// on every thread: its key is the calling thread's own, kPerThreadKey plus a number never
// given to another thread (a block freed on a thread's stream is never taken for a later
// thread's stream, even after the thread exits), and a fence for it is recorded on the
// legacy default stream, which waits for all work queued before on every blocking stream,
// per-thread default streams among them. The null stream is the legacy default stream (one
// stream for all threads), as in code built without --default-stream per-thread. Code
// built with it must pass cudaStreamPerThread for its own stream: a 0 it passes means its
// per-thread stream to it but the one shared key here, and the pool cannot tell.
inline constexpr StreamKey kPerThreadKey = StreamKey{1} << (sizeof(StreamKey) * 8 - 1);
StreamKey per_thread_stream_key() noexcept;
inline StreamKey stream_key(cudaStream_t stream) noexcept {
  if (stream == cudaStreamPerThread) [[unlikely]]
    return per_thread_stream_key();
  return reinterpret_cast<StreamKey>(stream);
}
inline cudaStream_t fence_stream_of(StreamKey key) noexcept {
  return (key & kPerThreadKey) != 0 ? cudaStreamLegacy : reinterpret_cast<cudaStream_t>(key);
}

// Reserved bytes of several tiers together, their high-water mark, and the growth budget
// they share. The budget follows the sum of each tier's own peak of used (carved out of
// segments) bytes, not the peak of their sum: a tier's segments serve only that tier, so
// when the tiers peak at different moments (small blocks in one phase of a step, large
// ones in another) both peaks must stay reserved, else each phase gives back what the
// other takes again, every step (found by replaying a decode trace several times).
struct ReservedGauge {
  std::atomic<std::size_t> reserved{0};
  std::atomic<std::size_t> peak{0};
  std::atomic<std::size_t> tier_peaks{0};  // sum over the tiers of each one's peak of used
  static void raise(std::atomic<std::size_t>& high_mark, std::size_t now) noexcept {
    std::size_t high = high_mark.load(std::memory_order_relaxed);
    while (now > high && !high_mark.compare_exchange_weak(high, now, std::memory_order_relaxed)) {
    }
  }
  void add(std::size_t bytes) noexcept {
    raise(peak, reserved.fetch_add(bytes, std::memory_order_relaxed) + bytes);
  }
  void sub(std::size_t bytes) noexcept { reserved.fetch_sub(bytes, std::memory_order_relaxed); }
  // The budget: reserved may exceed the tiers' peaks (plus `peak_growth`, by how much the
  // request raises its tier's peak) by headroom_1024/1024 of them. Returns by how much
  // taking `grow` more bytes would pass it (0: within).
  std::size_t excess_after_growth(std::size_t grow, std::size_t peak_growth,
                                  std::size_t headroom_1024) const noexcept {
    const std::size_t peaks = tier_peaks.load(std::memory_order_relaxed) + peak_growth;
    // (peaks >> 10) * headroom_1024 fits in 64 bits for peaks below 2^54 with headroom_1024
    // <= kMaxHeadroom1024 (2^20); a pool's used bytes are far below that.
    const std::size_t bound =
        peaks + (peaks >> 10) * headroom_1024 + (((peaks & 1023) * headroom_1024) >> 10);
    const std::size_t after = reserved.load(std::memory_order_relaxed) + grow;
    return after > bound ? after - bound : 0;
  }
  static constexpr std::size_t kMaxHeadroom1024 = std::size_t{1} << 20;  // 1024x
};

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
    // available, run_granule_cap()): a run goes back only whole, so a block left in a freed
    // run keeps at most this much mapped.
    std::size_t max_run_bytes = std::size_t{1} << 30;
    // A map for a block that raises the tier's peak of used bytes (since it last unmapped
    // granules) also covers up to this much of the untagged free range after it
    // (map_ahead_end()).
    std::size_t map_ahead_bytes = 0;
    // Reserved may reach the tiers' peaks of used bytes plus this many 1024ths before growing
    // gives wholly free segments back (64: 1/16).
    std::size_t growth_headroom_1024 = 64;
  };
  struct Counters {
    std::size_t reserved = 0;
    std::size_t peak_reserved = 0;
    std::size_t free_bytes = 0;  // reserved - used
    std::uint64_t upstream_allocations = 0;
    std::uint64_t upstream_frees = 0;
    std::uint64_t failed_upstream_allocations = 0;
    std::uint64_t segments = 0;
    std::uint64_t maps = 0;  // runs mapped (virtual mode; counted in upstream_allocations)
  };

  SegmentTier(Upstream& upstream, StreamFence& fence, ReservedGauge& gauge, Options options);
  ~SegmentTier();
  SegmentTier(const SegmentTier&) = delete;
  SegmentTier& operator=(const SegmentTier&) = delete;

  std::size_t round(std::size_t bytes) const noexcept {
    return (bytes + options_.granularity - 1) & ~(options_.granularity - 1);
  }
  // A range of round(bytes) usable on `stream` (kUntagged: any stream, completed work only).
  // Without may_grow: null when no free range fits. With it, a new segment (after giving
  // back the wholly free ones); throws the upstream's OutOfMemory or CudaError.
  void* allocate(std::size_t bytes, StreamKey stream, bool may_grow);
  // Returns a block from allocate(); `tag` is the freeing stream or kUntagged. False (and
  // nothing changed) when the block is not live here, or when `bytes` (0: not checked) is
  // not what allocate() was asked for, rounded (round(bytes)).
  bool free(void* block, StreamKey tag, std::size_t bytes = 0) noexcept;
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
  // Bytes of the segment a request of `bytes` would grow the tier by.
  std::size_t growth_bytes(std::size_t bytes) const noexcept {
    if (granule_ != 0) return (round(bytes) + granule_ - 1) / granule_ * granule_;  // virtual
    return segment_size_for(round(bytes));
  }
  std::size_t growth_headroom_1024() const noexcept { return options_.growth_headroom_1024; }
  // By how much a request of `bytes` would raise this tier's peak of used bytes.
  std::size_t peak_growth_for(std::size_t bytes) const noexcept;
  // The tier's peak of used bytes restarts from what is used now (DevicePool::trim).
  void restart_peak() noexcept;
  // Bytes of wholly free, untagged segments (virtual mode: 0, granules are not segments).
  std::size_t empty_bytes() const noexcept;
  // False for a virtual-memory tier without unmap_before_map: it maps new granules without
  // checking the growth budget (its free mapped bytes are bounded by max_free_bytes).
  bool enforces_growth_budget() const noexcept {
    return options_.virtual_memory == nullptr || options_.unmap_before_map;
  }
  // Gives back wholly free segments covering at least `bytes` (waiting first for the
  // streams of stream-tagged ones): what a sibling tier calls before it grows.
  void release_empty_for(std::size_t bytes) noexcept;
  bool owns(void* block) const noexcept;
  Counters counters() const noexcept;
  void reset_peak() noexcept;

 private:
  struct Segment;
  struct Range {
    char* addr;
    std::size_t size;
    Segment* segment;
    Range* prev = nullptr;
    Range* next = nullptr;
    enum class State : std::uint8_t { used, free, pending } state = State::free;
    StreamKey tag = kUntagged;
    std::uint64_t epoch = 0;  // epoch_ at its (latest merged) stream-tagged free
    // Filing in a FreeIndex (the one of `tag`) while free; index is null when unfiled.
    Range* bin_prev = nullptr;
    Range* bin_next = nullptr;
    FreeIndex<Range>* index = nullptr;
  };
  struct Segment {
    char* base;
    std::size_t size;
    Range* first;
  };
  using Index = FreeIndex<Range>;
  struct StreamIndex {
    StreamKey key;
    std::unique_ptr<Index> index;
  };
  struct Pending {
    std::uint64_t marker;
    StreamKey stream;  // the stream the marker was recorded on (the ranges' tag)
    std::vector<Range*> ranges;
  };

  // `mapped`: whether the result's granules under `bytes` are all mapped (virtual mode; true
  // in segment mode and for null).
  Range* best_fit(StreamKey key, std::size_t bytes, bool& mapped) noexcept;
  Range* mapped_fit(Index* index, Range* best, std::size_t bytes, bool& mapped) noexcept;
  Index* index_of(StreamKey key) noexcept;      // null: no index for the stream (none free)
  Index* stream_index(StreamKey key) noexcept;  // index_of past its cache
  std::size_t stream_slot(StreamKey key) const noexcept;  // tagged_.size(): none
  // Drops tagged_[slot] (its index empty), keeping the index as a spare.
  void erase_index(std::size_t slot) noexcept;
  // Files a free range under its tag; false (left unfiled: not reused until destruction,
  // accounting unchanged) when a stream's index could not be created.
  bool file(Range* range) noexcept;
  bool file_new_index(Range* range) noexcept;  // file() for a stream without an index
  // Ranges are recycled through spare_ranges_ (linked by `next`): splitting and merging
  // allocate nothing once the tier has run a while.
  Range* take_range() noexcept;  // from the spares; null when there is none
  void recycle(Range* range) noexcept;
  void keep_spares(std::size_t count);  // throws std::bad_alloc, nothing changed
  bool mergeable(const Range* range, const Range* neighbour) const noexcept;
  void insert_free(Range* range) noexcept;  // coalesces, then files it under its tag
  void remove_free(Range* range) noexcept;
  void drop_index(const Index* index) noexcept;  // erase_index of the (emptied) index
  void poll_pending(bool wait) noexcept;
  // Fences every stream but `except` with free ranges (need > 0: only those with a range
  // that could_serve(need)); true when some were fenced.
  bool fence_other_streams(StreamKey except, std::size_t need = 0) noexcept;
  // Records a marker on tagged_[slot]'s stream and moves its ranges to pending_; false
  // (nothing changed) when no marker could be recorded. The caller erases the slot.
  bool fence_stream(std::size_t slot) noexcept;
  // Best fit for `need` bytes on `stream` (its own ranges or untagged ones, fencing other
  // streams before growing); null when nothing fits or the fit is a wholly free segment
  // that would leave more than max_segment_waste idle.
  // `mapped`: as best_fit's, for the result (mapped_under(r, need); no map or unmap happens
  // between fit() and the caller's use of it).
  Range* fit(StreamKey stream, std::size_t need, bool& mapped) noexcept;
  // Bytes the tier grows by when `r` (null: no fit) serves `need` bytes (virtual mode: the
  // granules under it not mapped yet), and whether that passes the growth budget.
  std::size_t growth_for(const Range* r, std::size_t need) const noexcept;
  bool past_budget(const Range* r, std::size_t need) const noexcept;
  // `r` (free or pending) with the free or pending ranges beside it, which it merges with
  // once all are untagged, spans `need` bytes (virtual mode: of memory mapped before).
  bool could_serve(const Range* r, std::size_t need) const noexcept;
  // Virtual mode: the pending ranges of `stream` become its free ranges again (they are
  // safe for it in stream order; their markers are released unawaited); false when none.
  bool take_back_pending(StreamKey stream) noexcept;
  // Virtual mode, growing past the budget: waits for the markers of other streams than
  // `stream` whose pending ranges could serve `need`, then untags what completed; false when
  // there was none.
  bool wait_for_pending(StreamKey stream, std::size_t need) noexcept;
  Range* fresh_tail(std::size_t need) noexcept;
  // Waits for the streams of wholly free stream-tagged (or pending) segments, so that they
  // become untagged; false when there was none. need > 0: only segments that could then
  // serve a request of `need` bytes (0: all, e.g. to give them back).
  bool wait_for_empty_segments(std::size_t need) noexcept;
  void release_empty_segments(std::size_t keep_free) noexcept;
  // The smallest wholly free segment of at least `bytes`, else the largest ones until they
  // cover it; returns the bytes given back.
  std::size_t release_empty_segments_for(std::size_t bytes) noexcept;
  void release_segment(Segment* segment) noexcept;
  std::size_t segment_size_for(std::size_t bytes) const noexcept;
  // Virtual mode.
  void reserve_range();
  void map_range(Range* range);  // every granule under `range`; throws OutOfMemory
  void make_reclaimable() noexcept;
  void unmap_free_granules(std::size_t keep_free, const Range* except) noexcept;
  std::size_t granule_of(const char* address) const noexcept {
    return static_cast<std::size_t>(address - base_) >> granule_shift_;
  }

  Upstream& upstream_;
  StreamFence& fence_;
  ReservedGauge& gauge_;
  const Options options_;
  mutable TierMutex mutex_;  // a holder may block in the driver (map_range)
  Index untagged_;
  // A stream's free ranges, one index per stream (few streams: a flat table). A fenced
  // stream's index is erased; an emptied one only when more than kKeptEmptyIndices streams
  // have one. An erased index is empty and kept in spare_indices_ (up to kSpareIndices)
  // for the next stream: creating one writes its ~8 KB of bins, which made every fence
  // and every new stream index cost microseconds with more than four streams.
  // cached_*: the last stream looked up.
  std::vector<StreamIndex> tagged_;
  std::vector<std::unique_ptr<Index>> spare_indices_;
  static constexpr std::size_t kKeptEmptyIndices = 4;
  static constexpr std::size_t kSpareIndices = 16;
  StreamKey cached_key_ = kUntagged;
  Index* cached_index_ = nullptr;  // null: no cache; reset by every erase from tagged_
  PointerMap<Range> live_;
  Range* spare_ranges_ = nullptr;
  std::size_t spare_count_ = 0;
  std::vector<Range*> scratch_;  // unmap_free_granules()'s ordered walk
  std::vector<Pending> pending_;
  std::vector<Segment*> segments_;
  Counters counters_;
  std::size_t used_ = 0;
  std::size_t used_peak_ = 0;  // its share of gauge_.tier_peaks
  // Virtual mode: the peak of used bytes since the tier last gave granules back (unmapped
  // or restart_peak()); a block that raises it is a growing workload's, which maps ahead.
  std::size_t ahead_peak_ = 0;
  std::size_t peak_growth(std::size_t need) const noexcept {  // under the mutex
    return used_ + need > used_peak_ ? used_ + need - used_peak_ : 0;
  }
  std::uint64_t epoch_ = 0;  // advanced by mark_frees()
  char* base_ = nullptr;     // virtual mode: the reserved range
  std::size_t granule_ = 0;
  unsigned granule_shift_ =
      0;  // granule_ == 1 << granule_shift_ (the warm path shifts, never divides)
  // Virtual mode: granules are mapped in runs (one physical allocation per run, taken back
  // whole). run_of_[g] is the first granule of g's run, kNoRun when g is unmapped; at a
  // run's first granule, run_granules_ holds its length and handles_ its handle.
  static constexpr std::size_t kNoRun = SIZE_MAX;
  bool mapped(std::size_t granule) const noexcept { return run_of_[granule] != kNoRun; }
  // Granules in [first, last] (inclusive) not mapped, a 64-granule word at a time: the large
  // tier's warm path asks this of every block it hands out (a 256 MiB block spans 128).
  std::size_t unmapped_granules(std::size_t first, std::size_t last) const noexcept;
  bool all_mapped(std::size_t first, std::size_t last) const noexcept;  // unmapped_granules == 0
  // Virtual mode: every granule under the first `bytes` of `r` is mapped (no driver call).
  bool mapped_under(const Range* r, std::size_t bytes) const noexcept;
  static std::uint64_t granule_mask(std::size_t word, std::size_t first, std::size_t last) noexcept;
  void set_mapped_bits(std::size_t first, std::size_t end, bool mapped) noexcept;
  std::vector<std::uint64_t> mapped_bits_;  // bit g: granule g is mapped (as run_of_)
  void unmap_run(std::size_t first) noexcept;
  static constexpr std::size_t kRunShareOfAvailable = 16;
  // The longest run to map now, in granules, with `available` physical bytes left
  // (VirtualMemory::available_bytes(), asked once per map_range()).
  std::size_t run_granule_cap(std::size_t available) const noexcept;
  // The last granule to map for `range` (whose granules up to `last` include `new_granules`
  // unmapped ones), extended by map-ahead where its rules allow.
  std::size_t map_ahead_end(const Range* range, std::size_t last, std::size_t new_granules,
                            std::size_t cap, std::size_t available) const noexcept;
  std::vector<std::size_t> run_of_;
  std::vector<std::size_t> run_granules_;
  std::vector<std::uint64_t> handles_;
  std::size_t mapped_high_ = 0;
};

}  // namespace vram::detail
