// src/device_pool/pool_core.hpp: DevicePoolCore, the state of one DevicePool behind its handle, and
// the warm paths of allocate and deallocate.
//
// Tiers: 1, per thread (thread_cache.hpp; large blocks apart, large_block_cache.hpp); 2, per
// class a bounded lock-free ring shared by all threads (mpmc_ring.hpp); 3, the small and
// large segment tiers (segment_tier.hpp), in front of which a thread that met others there
// has a heap of its own over each (thread_heap.hpp).
// Where each part lives:
//   pool_core.hpp   the core's layout and its warm paths, inline: a warm allocate or
//                   deallocate is one call into the library, no driver call, no lock;
//                   also the short steps of the slow paths that run on every large call.
//   pool_core.cpp   construction, the slow paths (rings, tiers, growth, out of memory,
//                   validation) and deallocation after destruction.
//   pool_trim.cpp   taking cached blocks back: trim(), the flush of large caches, close().
//   pool_stats.cpp  stats().
//   thread_cache.*  the per-thread cache, the owner's side of its handshake and the
//                   thread's directory.
//   pool_options.*  what the options decide at construction.
//   graph_routing.cpp the core's graph calls: routing under capture scopes into graph pools.
//   pool_sleep.cpp  the core's tagged requests and deallocations.
//   thread_cache_registry.hpp (every cache, the stealer's side of the handshake),
//   slow_path.hpp (the slow path's mutex and counters; the lock order), quiescer.*,
//   deallocation_validation.*, orphaned_pool.hpp, in_use_peak.hpp, graph_routing.hpp
//   (capture routes and the count behind the graph flag of call_checks), graph_pools.*,
//   sleep_tags.*: the core's parts, each with its own private state.
// The core keeps the options (and what they decide), the upstream, the tiers, the rings,
// its own counters (out-of-memory retries, unscoped capture calls) and the flags the warm
// paths test; all of it private.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "deallocation_validation.hpp"
#include "graph_pools.hpp"
#include "graph_routing.hpp"
#include "in_use_peak.hpp"
#include "orphaned_pool.hpp"
#include "quiescer.hpp"
#include "request.hpp"
#include "sleep_tags.hpp"
#include "slow_path.hpp"
#include "thread_cache.hpp"
#include "thread_cache_registry.hpp"
#include "tier/segment_tier.hpp"
#include "vram/detail/asymmetric_barrier.hpp"
#include "vram/detail/mpmc_ring.hpp"
#include "vram/device_pool.hpp"
#include "vram/size_classes.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::detail {

// A class's ring is made whole on its first deallocation (16 bytes a cell): with
// max_cached_blocks_per_class unbounded it would be max_cached_bytes / 256 cells (256 MiB
// of host memory for the smallest class at the default 4 GiB). Beyond this depth blocks
// wait in the segments, as free ranges, instead.
inline constexpr std::size_t kMaxRingBlocks = 4096;
inline constexpr std::size_t kSmallGranularity = 256;  // small blocks: class bytes rounded to 256
// The least chunk of a thread's heap over the small tier: one of its 2 MiB segments.
inline constexpr std::size_t kSmallHeapChunk = std::size_t{2} << 20;
static_assert(SizeClasses::index_for(std::size_t{2} << 20) < 64);  // DevicePoolCore::block_bytes_of

// Structure: small requests (<= small_max) round to a size class; their blocks come from
// `small` (2 MiB segments, best fit), those above small_tier.segment_max_bytes from `large`
// (tier_of), and are cached per thread (ThreadCache) and per class in a bounded lock-free
// ring. Larger requests go to `large` directly (best fit, split, coalesce; a short mutex).
// Accounting (when quiescent):
//   bytes_reserved == sum of segment sizes == bytes_in_use + bytes_cached
//   bytes_in_use   == sum(acquired_bytes) - sum(deallocated_bytes)  (thread caches + slow path)
//
// Lifetime: ThreadCaches are owned by the core and live as long as it does (a cache of an
// exited thread is kept, empty, and adopted by the next thread that registers), so raw
// pointers to them stay valid. The core lives while the DevicePool handle lives, and after
// that while blocks are still leased (orphaned_pool.hpp), see close().
class DevicePoolCore : public std::enable_shared_from_this<DevicePoolCore> {
 public:
  // Throws vram::InvalidArgument for a null upstream, one that aligns below 256 bytes, and
  // options that pool_options.hpp refuses.
  DevicePoolCore(std::shared_ptr<Upstream> upstream_in, const DevicePool::Options& options_in);
  ~DevicePoolCore();

  // The calls of the public handle's own helpers (device_pool.cpp) and of the thread's
  // directory (thread_cache.cpp). Everything else is private; the handle and its capture
  // scope are friends (device_pool.cpp, graph_routing.cpp, pool_sleep.cpp).
  void* allocate(std::size_t bytes, std::size_t alignment, StreamKey key);
  void deallocate(void* block, std::size_t bytes, StreamKey key) noexcept;
  // Graph pools (graph_routing.cpp). The public calls test kGraphsOn and, while it is set,
  // go through these (`key`: kUntagged for the calling thread's calls without a
  // stream): a request under a capture scope gets the graph pool's block; a deallocation of a
  // graph pool's block, or of any block freed under a scope, goes to that pool.
  bool graphs_active() const noexcept {
    return (call_checks.load(std::memory_order_relaxed) & kGraphsOn) != 0;
  }
  [[gnu::noinline]] void* allocate_with_graphs(std::size_t bytes, std::size_t alignment,
                                               StreamKey key, cudaStream_t stream);
  [[gnu::noinline]] void deallocate_with_graphs(void* block, std::size_t bytes, StreamKey key,
                                                cudaStream_t stream) noexcept;
  // A deallocation without a stream (DevicePool::deallocate, Lease::reset, an ended scope's).
  void deallocate_unstreamed(void* block, std::size_t bytes) noexcept {
    if (graphs_active()) [[unlikely]]
      return deallocate_with_graphs(block, bytes, kUntagged, nullptr);
    deallocate(block, bytes, kUntagged);
  }
  // The capture `stream` is in (0: none; the legacy stream is never captured, and with
  // kWatchCaptures off nothing is asked). One driver query (StreamFence::capture_of).
  bool watch_captures() const noexcept {
    return (call_checks.load(std::memory_order_relaxed) & kWatchCaptures) != 0;
  }
  std::uint64_t capture_of(cudaStream_t stream) noexcept {
    if (!watch_captures() || stream == nullptr || stream == cudaStreamLegacy) return 0;
    return fence->capture_of(stream);
  }
  // A request or deallocation on a stream being captured that no scope routes: the block
  // belongs to that capture's own graph pool for the life of the pool (device_pool.hpp).
  // `id`: unscoped_pool_of(the capture).
  // Opens the unscoped pool's own use once (for the life of the pool) and counts the call;
  // throws std::bad_alloc.
  void retain_unscoped(GraphPools::Id id);
  [[gnu::noinline]] void* allocate_captured(std::size_t bytes, std::size_t alignment,
                                            GraphPools::Id id);
  [[gnu::noinline]] void deallocate_captured(void* block, std::size_t bytes,
                                             GraphPools::Id id) noexcept;
  // The graph pool of an unscoped capture: ids with bit 62 set and bit 63 clear, which
  // new_graph_pool() never returns.
  static GraphPools::Id unscoped_pool_of(std::uint64_t capture) noexcept {
    return (GraphPools::Id{1} << 62) | (capture & ((GraphPools::Id{1} << 62) - 1));
  }
  static bool is_unscoped_pool(GraphPools::Id id) noexcept { return (id >> 62) == 1; }
  // A stream-ordered call on `key`'s stream, before its own work: when another stream's
  // request wanted the stream's marker, records it (the call proves the stream alive).
  void serve_want_of(StreamKey key) noexcept {
    if ((call_checks.load(std::memory_order_relaxed) & StreamWants::bit_of(key)) != 0)
        [[unlikely]] {
      serve_want(key);
    }
  }
  // A stream-ordered call has more to do than the plain warm path: some stream is wanted
  // (serve_want_of), graph pools or capture scopes exist (graphs_active), or captures are
  // watched (capture_of). The warm path tests only this (one load of call_checks) and does
  // the checks out of line when it holds: a stale clear wanted bit delays a marker, as in
  // serve_want_of.
  bool stream_checks_needed() const noexcept {
    return call_checks.load(std::memory_order_relaxed) != 0;
  }
  // At thread exit: empties the thread's cache and makes it adoptable.
  void retire(ThreadCache* cache) noexcept;

 private:
  friend class vram::DevicePool;
  friend class vram::DevicePool::CaptureScope;

  static std::size_t small_block_bytes(std::size_t index) noexcept {
    return (SizeClasses::bytes_of(index) + kSmallGranularity - 1) & ~(kSmallGranularity - 1);
  }
  // The tier a small class's blocks are carved from (see small_tier.segment_max_bytes).
  SegmentTier& tier_of(std::size_t index) noexcept {
    return index < first_large_class ? small : large;
  }
  // The record of a request of `bytes` (1 .. SizeClasses::kMaxBytes) on `key`'s stream,
  // built once at the entry of a call (request.hpp); small_request() when the caller has
  // the class already (the warm paths).
  Request request_of(std::size_t bytes, StreamKey key) noexcept {
    if (bytes <= small_max) return small_request(bytes, SizeClasses::index_for(bytes), key);
    return Request{.bytes = bytes,
                   .block_bytes = large.round(bytes),
                   .tier = &large,
                   .key = key,
                   .small = false};
  }
  Request small_request(std::size_t bytes, std::size_t index, StreamKey key) noexcept {
    return Request{.bytes = bytes,
                   .block_bytes = block_bytes_of[index],
                   .index = index,
                   .tier = &tier_of(index),
                   .key = key,
                   .small = true};
  }
  std::size_t block_bytes(std::size_t bytes) noexcept {
    return request_of(bytes, kUntagged).block_bytes;
  }

  MpmcRing<void*>* ring_of(std::size_t index) const noexcept {
    return rings[index].load(std::memory_order_acquire);
  }
  // Creates the class's ring on its first deallocation; null when the class keeps no ring or
  // the host is out of memory.
  MpmcRing<void*>* ring_for_deallocate(std::size_t index) noexcept {
    MpmcRing<void*>* ring = rings[index].load(std::memory_order_acquire);
    if (ring != nullptr) [[likely]]
      return ring;
    // A power of two (the ring's own rounding) that never exceeds either bound.
    const std::size_t capacity =
        std::bit_floor(std::min({options.max_cached_blocks_per_class, kMaxRingBlocks,
                                 options.max_cached_bytes / small_block_bytes(index)}));
    if (capacity < 2) return nullptr;
    MpmcRing<void*>* fresh = nullptr;
    try {
      fresh = new MpmcRing<void*>(capacity);
    } catch (...) {  // std::bad_alloc from the ring or its cells: cache nothing
      return nullptr;
    }
    if (!rings[index].compare_exchange_strong(ring, fresh, std::memory_order_acq_rel)) {
      delete fresh;  // another thread won; `ring` now holds its ring
      return ring;
    }
    return fresh;
  }

  // The calling thread's cache of this pool, claimed (see thread_cache.hpp); null when the
  // thread has none (its directory is gone, the host is out of memory) or the pool is closed.
  ThreadCache* claim_own_cache() noexcept;
  void end_claim(ThreadCache& cache) noexcept;
  // Honours a flush request of trim(), then lets the claim go; returns `result`, so that a
  // warm path ends in a tail call (it needs no stack frame).
  [[gnu::cold]] void* flush_and_end_claim(ThreadCache& cache, void* result) noexcept;
  // The calling thread's cache of this pool from its directory, registered (or adopted
  // from an exited thread) on first use; null as for claim_own_cache().
  ThreadCache* find_or_register() noexcept;

  // Every request the warm path does not serve: validated, then served (serve()).
  void* allocate_slow(std::size_t bytes, std::size_t alignment, StreamKey key);
  // A warm request (valid, small, class `index`) its thread's cache could not serve;
  // `cache`: that cache, still claimed, or null when the warm claim failed.
  void* allocate_miss(std::size_t bytes, std::size_t index, StreamKey key, ThreadCache* cache);
  // Serves `request` through `cache` (claimed; null: claimed here, claim_own_cache(), else
  // the slow path under slow_path's lock) and lets the claim go. Inline into allocate_slow
  // and allocate_miss (pool_core.cpp): a request takes one call level to reach its tier or
  // its small path.
  [[gnu::always_inline]] inline void* serve(const Request& request, ThreadCache* cache);
  [[noreturn, gnu::cold]] void reject_request(std::size_t bytes, std::size_t alignment) const;
  void deallocate_checked(void* block, std::size_t bytes, StreamKey key) noexcept;
  // Counts a refused deallocation and says why on stderr; nothing changes
  // (deallocation_validation.hpp).
  [[gnu::cold]] void reject_deallocate(const void* block, std::size_t bytes,
                                       const char* why) noexcept {
    validation.reject(block, bytes, why);
  }
  // deallocate() after validation (inline into deallocate_checked, with deallocate_slow()).
  [[gnu::always_inline]] inline void deallocate_valid(void* block, const Request& request) noexcept;
  // serve()'s undo when the validation table cannot record a block: deallocate_valid() with
  // the slow path outlined.
  void undo_acquire(void* block, const Request& request) noexcept;
  // A small block into the caller's warm cache (true: done, the claim let go). False: `cache`
  // is the cache still claimed, or null when the warm claim failed or was not tried.
  bool deallocate_warm(void* block, const Request& request, ThreadCache*& cache) noexcept {
    if (!request.small || options.track_peak_in_use) return false;
    cache = claim_warm(uid, dekker);
    return cache != nullptr && deallocate_to_cache(*cache, block, request.index, request.key);
  }
  // The warm deallocation into `cache` (claimed): room in the bin of class `index` and nothing
  // to retag; the claim is let go. False: nothing done, the cache still claimed.
  bool deallocate_to_cache(ThreadCache& cache, void* block, std::size_t index,
                           StreamKey key) noexcept;
  // A warm deallocation (small) its thread's cache could not take. deallocate_miss_claimed: the
  // warm path claimed the cache (tl_last.cache), which stays claimed; deallocate_miss: it
  // claimed none. The cache and the class are found again here rather than passed: more
  // arguments would cost the warm deallocation saved registers on its hit path.
  void deallocate_miss_claimed(void* block, std::size_t bytes, StreamKey key) noexcept;
  void deallocate_miss(void* block, std::size_t bytes, StreamKey key) noexcept;
  // Deallocates `block` through `cache` (claimed; null: claimed here, else the slow path) and
  // lets the claim go. Inline into deallocate_checked and deallocate_miss_claimed
  // (pool_core.cpp): a deallocation takes one call level to reach its tier or its small path,
  // as an allocation does. Its other callers take deallocate_outlined.
  [[gnu::always_inline]] inline void deallocate_slow(void* block, const Request& request,
                                                     ThreadCache* cache) noexcept;
  void deallocate_outlined(void* block, const Request& request, ThreadCache* cache) noexcept;
  // The bins of a thread cache, for its holder. pop_cached: a block of class `index`
  // usable on `key` (false: none). has_room: the bin's depth and the cache's byte bound allow one
  // more. push_cached: files a block (the caller checked the room and settled the tag).
  bool pop_cached(ThreadCache& cache, std::size_t index, StreamKey key, void*& block) noexcept {
    auto& bin = cache.bins[index];
    if (bin.count == 0 || (cache.tag != kUntagged && cache.tag != key)) return false;
    block = bin.blocks[--bin.count];
    bump(cache.cached_bytes, 0 - std::uint64_t{block_bytes_of[index]});
    return true;
  }
  // `cached`: the cache's cached_bytes, as the caller loaded it; `block_bytes`:
  // block_bytes_of[index].
  bool has_room(const ThreadCache& cache, std::size_t index, std::uint64_t cached,
                std::uint64_t block_bytes) const noexcept {
    const auto& bin = cache.bins[index];
    return bin.count < bin.limit && cached + block_bytes <= cache.max_bytes;
  }
  void push_cached(ThreadCache& cache, void* block, std::size_t index,
                   std::uint64_t block_bytes) noexcept {
    auto& bin = cache.bins[index];
    bin.blocks[bin.count++] = block;
    bump(cache.cached_bytes, block_bytes);
  }
  void* small_allocate(ThreadCache* cache, const Request& request);
  // A large block from the holder's cache of large blocks, else from the tier (recorded in
  // the cache when it may come back there). (large_allocate and large_deallocate: inline into their
  // one caller, pool_core.cpp, the warm large path: no call level of their own.)
  [[gnu::always_inline]] inline void* large_allocate(ThreadCache* cache, const Request& request);
  // Deallocates a large block into the holder's cache, else to the tier; false when the block
  // is not this pool's leased block of that size.
  // `marker`: a young stream's (record_if_young), for the tier; null or not taken: none.
  // `steady`: the request's stream may tag the cache (FreeAge::steady).
  [[gnu::always_inline]] inline bool large_deallocate(ThreadCache& cache, void* block,
                                                      const Request& request,
                                                      SegmentTier::FreeMarker* marker,
                                                      bool steady) noexcept;
  // Every cached large block of `cache` (its holder's, or stolen) back to the large tier.
  void drain_large(ThreadCache& cache) noexcept;
  // Before a tier grows for a request on `key`: the cached large blocks of every thread
  // (`claimed`: the caller's own, claimed; the others stolen as trim() steals, skipping an
  // owner inside a call that may block) back to the large tier, then the heaps' wholly free
  // chunks: all of the caller's, and of the other threads' those the request can use (free
  // ranges untagged or `key`'s). A chunk holding another stream's ranges would reach the
  // request only through that stream's marker or a device-wide quiesce, and in its heap it
  // serves its own stream at once; after a quiesce in tier_grow the heaps are flushed again
  // (ranges freed before the quiesce began are untagged then). Such a chunk is asked back
  // (ThreadHeap::asked): its thread's next deallocation into its heap on the chunk's stream
  // sends it to the tier under a marker of that stream (free_block). Otherwise it stays in
  // its heap at most until its thread grows a tier or takes a new chunk, trim(), an
  // out-of-memory retry or its thread's exit, and the heap keeps at most keep_idle bytes of
  // wholly free chunks. True when any went back.
  bool flush_large_caches(ThreadCache* claimed, StreamKey key) noexcept;
  bool flush_cached_large_blocks(ThreadCache* claimed) noexcept;  // its first part
  bool small_deallocate(ThreadCache* cache, void* block, const Request& request,
                        SegmentTier::FreeMarker* marker, bool steady) noexcept;
  // What a slow-path free found of its stream: `marked`, a marker was recorded into `young`;
  // `steady`, the stream may tag the thread's cache (StreamAges::steady after this free).
  struct FreeAge {
    bool marked;
    bool steady;
  };
  // A slow-path free on `key` through `cache` (claimed): counts it (stream_ages.hpp) and, when
  // the stream is young, records a marker on it into `young`. No tier mutex is held; the
  // block has not reached a tier yet.
  FreeAge record_if_young(ThreadCache& cache, StreamKey key,
                          SegmentTier::FreeMarker& young) noexcept {
    // Most slow-path frees: no caller stream, or a steady one's between its namings.
    if (!StreamAges::caller_stream(key) || cache.stream_ages.steady_free(key)) return {false, true};
    return record_young_marker(cache, key, young);
  }
  // The rest of record_if_young(): StreamAges::note_free() and, when the stream is young, its
  // marker (the key's cached blocks drained to their tiers, the heap's home let go first).
  FreeAge record_young_marker(ThreadCache& cache, StreamKey key,
                              SegmentTier::FreeMarker& young) noexcept;
  // SegmentTier::free() of the request's tier for a thread that claimed `claimed` (or null;
  // deallocated through its large cache, lease_owner.hpp): only its give-back, which makes
  // upstream calls, runs in a SlowSection (a tier's mutex guards book-keeping only:
  // segment_tier.hpp).
  bool free_to_tier(void* block, const Request& request, ThreadCache* claimed,
                    SegmentTier::FreeMarker* marker = nullptr) noexcept {
    return free_block(*request.tier, block, request.key, request.block_bytes, claimed, true, marker,
                      /*tag_alive=*/true);
  }
  // The one way a block of `bytes` (rounded) goes back to `tier` on `tag`: a thread heap's
  // block to its heap (the deallocating thread's own first, then any other: thread_heap.hpp),
  // any other to the tier. `via`: the thread cache the block comes back through (its large
  // cache is the tier's `by`, lease_owner.hpp; its heap is asked first), or null; `claimed`:
  // the caller holds `via` (a give-back's upstream calls then run in its SlowSection).
  // False when no heap and not the tier hold the block at that size (nothing changed).
  // `marker`: as SegmentTier::free_keeping's (a heap's block leaves it not taken).
  // `tag_alive`: `tag` names the stream of the call in progress (a deallocate_async on it,
  // which proves it alive): a heap chunk this free leaves wholly free goes back to the tier
  // under a marker recorded on that stream (return_chunk), and a free into the caller's own
  // heap (`claimed`) sends its chunks a growth asked back whose tagged ranges are that
  // stream's the same way (ThreadHeap::asked).
  bool free_block(SegmentTier& tier, void* block, StreamKey tag, std::size_t bytes,
                  ThreadCache* via, bool claimed, SegmentTier::FreeMarker* marker = nullptr,
                  bool tag_alive = false) noexcept {
    // No heap over the tier (none made yet, heaps off, or every make() failed for want of host
    // memory): the tier alone, no call level. Heaps are never removed (ThreadHeaps only grows), so
    // once one exists every free takes free_through_heaps.
    if (!heaps_of(tier).any()) {
      return settle_free(
          tier,
          tier.free_keeping(block, tag, bytes, via != nullptr ? &via->large : nullptr, marker),
          claimed ? via : nullptr);
    }
    return free_through_heaps(tier, block, tag, bytes, via, claimed, marker, tag_alive);
  }
  // free_block() once a heap exists over the tier.
  bool free_through_heaps(SegmentTier& tier, void* block, StreamKey tag, std::size_t bytes,
                          ThreadCache* via, bool claimed, SegmentTier::FreeMarker* marker,
                          bool tag_alive) noexcept;
  // Thread heaps (thread_heap.hpp). heap_allocate: `request` (at most the heap's
  // max_block()) from the holder's heap over the request's tier, which takes a chunk of that
  // tier when nothing free fits; `owner`: as SegmentTier::allocate's. heap_deallocate: false
  // when `heap` does not hold the block. return_chunk: a chunk a heap let go, back to its tier.
  // return_idle_chunks: every heap's wholly free chunks back (trim(), a thread's exit:
  // `only`, that cache's heaps; a flush before a growth for a request on `usable_by`: of
  // the other threads' heaps only those that request could use, see flush_large_caches);
  // return_idle_of: one heap's, those `which` names (ThreadHeap::take_idle), each through
  // return_chunk with `alive`; true when any went back.
  void* heap_allocate(ThreadCache& cache, const Request& request, LeaseOwner* owner = nullptr);
  // The holder's heap over `tier` (null: none), and every heap over it.
  ThreadHeap* heap_of(const ThreadCache& cache, const SegmentTier& tier) const noexcept {
    return &tier == &large ? cache.heap : cache.small_heap;
  }
  ThreadHeaps& heaps_of(const SegmentTier& tier) noexcept {
    return &tier == &large ? heaps : small_heaps;
  }
  // Whether the holder's heap serves a request on `key`: one without a stream, or on the
  // thread's steady stream, the one it asked on kHeapStreak times in a row. A thread that
  // makes a stream for a few requests and destroys it (stream churn) never has one: its
  // requests go to the tier as without a heap, where its streams' frees reach other streams
  // by the tier's markers and quiesces, and no chunk holds them. A destroyed stream's handle
  // may name the next stream (the driver reuses handles): the stream behind the handle is
  // named (StreamFence::stream_id) when the handle becomes a candidate, when it becomes the
  // home and every kIdentityCheck requests on it after; a change means the thread's streams
  // come and go, and its heaps serve only requests without a stream from then on.
  static constexpr std::uint32_t kHeapStreak = 16;
  static constexpr std::uint32_t kIdentityCheck = 64;
  bool heap_serves(ThreadCache& cache, StreamKey key) noexcept {
    if (key == kUntagged) return true;
    if (key == cache.heap_home) [[likely]] {
      if (++cache.heap_checks % kIdentityCheck != 0) [[likely]]
        return true;
      return same_stream(cache, key);
    }
    if (cache.heap_streams_churn) return false;
    // A young stream's blocks stay out of chunks: its frees go pending to the tier
    // (stream_ages.hpp), which a heap's block cannot.
    if (!cache.stream_ages.steady(key)) return false;
    if (key != cache.heap_candidate) {
      cache.heap_candidate = key;
      cache.heap_streak = 0;
      cache.heap_stream_id = fence->stream_id(fence_stream_of(key));
    }
    if (++cache.heap_streak < kHeapStreak) return false;
    if (!same_stream(cache, key)) return false;
    cache.heap_home = key;
    cache.heap_checks = 0;
    return true;
  }
  // Whether `key` names the stream it named when heap_stream_id was read; false marks the
  // thread's streams as churning (no home from now on).
  [[gnu::cold]] bool same_stream(ThreadCache& cache, StreamKey key) noexcept {
    if (fence->stream_id(fence_stream_of(key)) == cache.heap_stream_id) return true;
    cache.heap_streams_churn = true;
    cache.heap_home = kUntagged;
    cache.heap_candidate = kUntagged;
    return false;
  }
  // `by`: as SegmentTier::free's.
  // `alive`: as free_block's `tag_alive`, the stream of the call in progress (else kUntagged).
  bool heap_deallocate(ThreadHeap& heap, SegmentTier& tier, void* block, StreamKey tag,
                       std::size_t bytes, ThreadCache* claimed, const LeaseOwner* by,
                       StreamKey alive = kUntagged) noexcept;
  // `alive` (or kUntagged): the stream of the call in progress, proven alive by it. When a
  // piece of the chunk is that stream's and the caller holds its cache (`claimed`, the
  // marker's recorder), a marker recorded on it now (after every use of the chunk's blocks on
  // it) goes with the chunk: the tier files the largest such piece pending under it, so
  // another stream's request finds it free once the marker completed, with no want on the
  // stream (stream_tags.hpp). A chunk returned outside such a call (a flush, trim(), a
  // thread's exit, the other streams' chunks a heap lets go before taking a new one) keeps
  // its tags as before.
  void return_chunk(const ThreadHeap::Returned& chunk, SegmentTier& tier, ThreadCache* claimed,
                    StreamKey alive = kUntagged) noexcept;
  // What a tier's free_keeping() said, settled: over its cap, the give-back (its upstream
  // calls in `claimed`'s SlowSection); true unless the tier did not know the block.
  bool settle_free(SegmentTier& tier, SegmentTier::Freed freed, ThreadCache* claimed) noexcept {
    if (freed == SegmentTier::Freed::over_cap) [[unlikely]]
      give_back_over_cap(tier, claimed);
    return freed != SegmentTier::Freed::foreign;
  }
  [[gnu::cold]] void give_back_over_cap(SegmentTier& tier, ThreadCache* claimed) noexcept;
  bool return_idle_chunks(ThreadCache* claimed, ThreadCache* only = nullptr,
                          std::optional<StreamKey> usable_by = std::nullopt) noexcept;
  bool return_idle_of(ThreadHeap& heap, SegmentTier& tier, ThreadCache* claimed,
                      ThreadHeap::Idle which = ThreadHeap::Idle::all, StreamKey key = kUntagged,
                      StreamKey alive = kUntagged) noexcept;
  // A small-tier request of a thread without heaps: whether the small tier's mutex was found
  // locked since its last one (the heaps then start, as when its large-block cache turns on).
  void note_small_contentions(ThreadCache& cache) noexcept {
    if (cache.small_contentions.moved(small.contentions())) start_heap(cache);
  }
  // A cache whose large-block cache turned on gets its heap (when heaps are on): from now on
  // its large requests up to the heap's max_block() that heap_serves() are the heap's; the
  // others, and the tier's blocks it holds, keep the cache of exact sizes.
  void start_heap(ThreadCache& cache) noexcept;
  // A block from the request's tier. `owner`: the large cache the block is handed to
  // (lease_owner.hpp), or null.
  // `served`: as SegmentTier::allocate's.
  void* tier_allocate(const Request& request, ThreadCache* claimed, LeaseOwner* owner = nullptr,
                      StreamKey* served = nullptr);
  // tier_allocate() when no free range fits: grows the tier (trimming and retrying on OOM).
  void* tier_grow(const Request& request, ThreadCache* claimed, LeaseOwner* owner,
                  StreamKey* served);
  // Moves a cache's blocks (its holder calls this) to their tiers under the cache's tag.
  void drain_bins(ThreadCache& cache) noexcept;
  void drain_rings() noexcept;
  // Takes every thread cache (idle, exited, or `claimed`: the caller's own, claimed)
  // and the rings back to the segment tiers, then gives wholly free segments back.
  void trim(std::size_t keep_bytes, ThreadCache* claimed, bool wait) noexcept;
  bool close(std::uint64_t& blocks, std::uint64_t& bytes) noexcept;
  // The pool a capture scope or an unscoped capture sends `stream`'s calls to.
  std::optional<GraphPools::Id> graph_route(StreamKey key, cudaStream_t stream) noexcept;
  // Into graph pool `id`: a free block of it, else a new one from the shared tiers (in
  // relaxed capture mode); an ordinary block when the pool has no use open.
  void* graph_allocate_into(GraphPools::Id id, std::size_t bytes, std::size_t alignment);
  // A graph pool's block back to its pool, or any other block made `id`'s (freed during a
  // capture); false when neither took it (the pool has no use open).
  bool graph_deallocate_into(std::optional<GraphPools::Id> id, void* block,
                             std::size_t bytes) noexcept;
  // Its two halves: a graph pool's block back to its pool (false: no graph pool's), and a
  // block that is no graph pool's made a free block of `id` (false: `id` has no use open).
  bool graph_deallocate_owned(void* block) noexcept;
  // `held_bytes`: what the pool records (block_bytes() of the request; a tag's round()).
  bool graph_adopt_freed(GraphPools::Id id, void* block, std::size_t held_bytes) noexcept;
  // Blocks graph pools gave up go back to the shared tiers after a device synchronize;
  // nothing while a capture scope is open (graph_routing.cpp).
  void drain_graph_returns() noexcept;
  // The blocks graph pools gave up, once a device synchronize proved their graphs idle;
  // none while a scope is open or this thread serves a captured request.
  std::vector<GraphPools::Block> take_graph_returns() noexcept;
  // drain_graph_returns() from inside a request that claimed `claimed` (its cache; null:
  // the caller holds slow_path's lock): the blocks go straight to their tiers, counted as
  // deallocations of `claimed` (or of the slow path). The out-of-memory retry's, before its trim.
  void reclaim_graph_returns(ThreadCache* claimed) noexcept;
  // The size a graph pool's block is deallocated with: the one that finds its class and tier.
  std::size_t deallocate_size_of(const GraphPools::Block& block) noexcept;
  // When `key`'s want is still set: a marker on its stream (the caller's call passes it: it
  // exists) for its ranges in each tier that holds some, freed before the record. No tier
  // mutex may be held.
  [[gnu::cold]] void serve_want(StreamKey key) noexcept;
  // Set while this thread serves a request of a stream being captured (graph_allocate_into):
  // growth then neither quiesces nor trims (a device synchronize during the thread's own
  // capture would invalidate it).
  static inline thread_local bool tl_in_capture = false;
  void note_in_use(std::int64_t delta) noexcept { in_use.note(delta); }
  DevicePoolStats stats() const;

  const std::uint64_t uid;  // unique per core, never 0: names its caches in tl_last
  // The memory barriers of the thread caches' handshake; fixed for the life of the core.
  const AsymmetricBarrier dekker;
  std::shared_ptr<Upstream> upstream;
  DevicePool::Options options;
  // Stream markers for stream-ordered frees (Options::fence, else default_fence()).
  std::shared_ptr<StreamFence> fence;
  std::shared_ptr<VirtualMemory> virtual_memory;  // the large tier's, or null
  std::size_t small_max;
  std::size_t small_classes = 0;
  std::size_t first_large_class = 0;  // small classes from here on are carved from `large`
  // The keep_bytes of the latest trim(), for a thread that flushes its cache after it.
  std::atomic<std::size_t> flush_keep_bytes{SIZE_MAX};
  static constexpr std::size_t kMaxAlignment =
      DevicePool::kDefaultAlignment;  // see the constructor
  // Neither validate_deallocations nor track_peak_in_use: the warm paths below may serve a call.
  bool plain_calls = false;
  // What a public call checks beyond its warm path, in one word in the cache line of
  // plain_calls (the stream-ordered calls test it whole, stream_checks_needed):
  // - kGraphsOn: set while a graph pool or sleep tag exists or a capture scope is open
  //   (graph_routing.hpp); every public call tests it before it asks the graph pools;
  // - kWatchCaptures: Options::detect_unscoped_capture (set once, by the constructor);
  // - the low StreamWants::kBits: StreamWants::bit_of every caller stream whose marker
  //   another stream's request wants (stream_wants.hpp); the call on such a stream records
  //   the marker (serve_want) before its own work.
  // Each part changes only its own bits (read-modify-writes).
  static constexpr std::uint64_t kGraphsOn = std::uint64_t{1} << 63;
  static constexpr std::uint64_t kWatchCaptures = std::uint64_t{1} << 62;
  static_assert(((kGraphsOn | kWatchCaptures) & StreamWants::kMask) == 0);
  std::atomic<std::uint64_t> call_checks{0};
  // Young streams' markers the tiers took (stats().stream_markers).
  std::atomic<std::uint64_t> markers_at_frees{0};
  // small_block_bytes() of every small class (small_max <= 2 MiB: at most 53 classes).
  std::array<std::uint32_t, 64> block_bytes_of{};
  ReservedGauge gauge;
  StreamWants wants{call_checks};  // before the tiers: they refer to it
  SegmentTier small;
  SegmentTier large;
  // Small blocks shared between threads: one lazily created ring per class.
  std::array<std::atomic<MpmcRing<void*>*>, SizeClasses::kCount> rings{};

  // Device-wide quiesces after which stream frees are free for all (quiescer.hpp).
  Quiescer quiescer{*fence, small, large, wants, heaps, small_heaps};
  std::atomic<std::uint64_t> oom_retries{0};
  std::atomic<std::uint64_t> unscoped_capture_calls{0};  // blocks kept by unscoped captures
  // Only with options.track_peak_in_use (in_use_peak.hpp).
  alignas(kCacheLine) InUsePeak in_use;

  // Lock order: the slow path's mutex, then the registry's steal mutex, then the registry's
  // own lock / a tier's growth mutex, then that tier's mutex (segment_tier.hpp; a grower
  // takes none of the others); slow_path.hpp has the whole order. Only a holder of the steal
  // mutex waits for a cache's state word (trim(), which never waits for an owner inside a
  // call that may block), and close() (holding none of them).
  ThreadCacheRegistry registry;
  // The thread heaps (thread_heap.hpp); with_heaps: options.thread_cache.large_chunk_bytes.
  ThreadHeaps heaps;        // over the large tier
  ThreadHeaps small_heaps;  // over the small tier
  bool with_heaps = false;

  // Calls on threads without a usable cache and every call once the pool is closed, under
  // one mutex, and their counters (slow_path.hpp).
  SlowPath slow_path;
  OrphanedPool orphan;  // under slow_path's lock (orphaned_pool.hpp)

  // Refused deallocations, and the leased blocks with validate_deallocations
  // (deallocation_validation.hpp).
  DeallocationValidation validation;

  // Last: the graph pools' state (its address filter is 64 KiB) stays out of the lines the
  // warm paths and the tiers use.
  // The capture routes and the count behind kGraphsOn (graph_routing.hpp), then the graph
  // pools, which count themselves there.
  GraphRouting graph_routing{&call_checks, kGraphsOn};
  GraphPools graph_pools{&graph_routing};
  // Sleep tags (sleep_tags.hpp); while any exists kGraphsOn stays raised, so that every call
  // reaches allocate_with_graphs / deallocate_with_graphs, which ask the tags first.
  SleepTags sleep_tags{uid, graph_routing, gauge};
  // A request into `tag` and a deallocation of its block (pool_sleep.cpp): counted as slow-path
  // calls (so that destruction counts tagged blocks as leased).
  void* tag_allocate(Tag& tag, std::size_t bytes, std::size_t alignment, StreamKey key);
  void tag_deallocate(Tag& tag, void* block, std::size_t bytes, StreamKey key) noexcept;
  void count_tag_deallocation(std::size_t block_bytes) noexcept;
  // Tagged blocks of CUDA graphs (pool_sleep.cpp). A request inside a tag scope that a graph
  // pool serves (a capture, or a capture scope) gets a block of the tag that is the graph
  // pool's too, under the graph pools' rules (graph_pools.hpp): freed, whoever frees it, it
  // goes back to its pool, where only requests of the same tag into the pool reuse it; it
  // rejoins its tag when the pool gives it up (drain_graph_returns: while the tag sleeps it
  // waits, pending, for a drain after the wake). Its contents sleep and wake with the tag.
  void* graph_tag_allocate(Tag& tag, std::size_t bytes, std::size_t alignment, StreamKey key,
                           GraphPools::Id graph);
  // A tagged block deallocated with graphs about (`route`: the graph pool a capture on the
  // deallocating stream goes to): back to its graph pool, a free block of the capture's pool,
  // or deallocated into its tag.
  void deallocate_tagged(Tag& tag, void* block, std::size_t bytes, StreamKey key,
                         std::optional<GraphPools::Id> route) noexcept;
  // A block a graph pool gave up, back to its tag; false (nothing changed) while it sleeps.
  bool return_to_tag(Tag& tag, const GraphPools::Block& block) noexcept;
  static void keep_pending(std::vector<GraphPools::Block>& blocks,
                           const GraphPools::Block& block) noexcept;
};

inline ThreadCache* DevicePoolCore::claim_own_cache() noexcept {
  ThreadCache* cache = tl_last.uid == uid ? tl_last.cache : find_or_register();
  if (cache == nullptr) return nullptr;
  return claim(*cache, dekker);
}

inline void DevicePoolCore::end_claim(ThreadCache& cache) noexcept {
  // The request is honoured before the state word is let go: once kFree is stored,
  // close() may take the cache and destroy the pool, so nothing after it may touch them.
  if (cache.flush_requested.load(std::memory_order_seq_cst)) [[unlikely]] {
    (void)flush_and_end_claim(cache, nullptr);
    return;
  }
  cache.state.store(ThreadCache::kFree, std::memory_order_release);
}

// Inline: every large request takes this path (the growing part is out of line).
inline void* DevicePoolCore::tier_allocate(const Request& request, ThreadCache* claimed,
                                           LeaseOwner* owner, StreamKey* served) {
  if (void* block = request.tier->allocate(request.block_bytes, request.key, /*may_grow=*/false,
                                           nullptr, owner, served)) [[likely]] {
    return block;
  }
  return tier_grow(request, claimed, owner, served);
}

inline void* DevicePoolCore::allocate(std::size_t bytes, std::size_t alignment, StreamKey key) {
  // Warm path: a block of this class in this thread's cache. `bytes - 1 < small_max` also
  // sends zero bytes to the slow path, which rejects it with the other bad requests.
  if (bytes - 1 < small_max && plain_calls && alignment - 1 < kMaxAlignment &&
      (alignment & (alignment - 1)) == 0) [[likely]] {
    const std::size_t index = SizeClasses::index_for(bytes);
    ThreadCache* cache = claim_warm(uid, dekker);
    if (void* block = nullptr; cache != nullptr && pop_cached(*cache, index, key, block))
        [[likely]] {
      const std::uint64_t block_bytes = block_bytes_of[index];
      bump(cache->acquires, 1);
      bump(cache->acquired_bytes, block_bytes);
      if (cache->flush_requested.load(std::memory_order_seq_cst)) [[unlikely]] {
        return flush_and_end_claim(*cache, block);  // see end_claim
      }
      cache->state.store(ThreadCache::kFree, std::memory_order_release);
      return block;
    }
    // Missed: the cache stays claimed (null: not claimed) and the class computed; the slow
    // path serves the request through it and honours a flush request.
    return allocate_miss(bytes, index, key, cache);
  }
  return allocate_slow(bytes, alignment, key);
}

inline bool DevicePoolCore::deallocate_to_cache(ThreadCache& cache, void* block, std::size_t index,
                                                StreamKey key) noexcept {
  const std::uint64_t block_bytes = block_bytes_of[index];
  const std::uint64_t cached = cache.cached_bytes.load(std::memory_order_relaxed);
  // Another stream's block, even into an empty cache, takes the slow path: its free is counted
  // there and the stream's age read (record_if_young), and small_deallocate retags the cache
  // when the stream is steady. No call here, so the warm path saves no registers.
  if (has_room(cache, index, cached, block_bytes) && (key == cache.tag || key == kUntagged))
      [[likely]] {
    if (cached == 0) cache.tag = key;  // an empty cache takes the tag of what it holds
    push_cached(cache, block, index, block_bytes);
    bump(cache.deallocations, 1);
    bump(cache.deallocated_bytes, block_bytes);
    end_claim(cache);
    return true;
  }
  return false;
}

inline void DevicePoolCore::deallocate(void* block, std::size_t bytes, StreamKey key) noexcept {
  if (bytes - 1 < small_max && plain_calls && block != nullptr) [[likely]] {
    const std::size_t index = SizeClasses::index_for(bytes);
    ThreadCache* cache = claim_warm(uid, dekker);
    if (cache != nullptr && deallocate_to_cache(*cache, block, index, key)) [[likely]]
      return;
    // The cache stays claimed (null: not claimed), as in allocate().
    if (cache != nullptr) return deallocate_miss_claimed(block, bytes, key);
    return deallocate_miss(block, bytes, key);
  }
  deallocate_checked(block, bytes, key);
}

}  // namespace vram::detail
