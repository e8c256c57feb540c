// DevicePoolCore's construction and slow paths: everything a warm call (pool_core.hpp)
// hands on. Rule: a slow path that may block (an upstream call, a wait for a stream marker,
// a trim) runs inside a SlowSection, so that a concurrent trim() asks this thread to flush
// its cache instead of waiting for it.
#include "pool_core.hpp"

#include <cstdio>
#include <string>
#include <utility>

#include "pool_options.hpp"
#include "vram/cuda/error.hpp"

namespace vram::detail {
namespace {

std::atomic<std::uint64_t> next_pool_uid{1};
constexpr const char* kNotLive =
    "the pool has no block leased at that address and size (deallocated already, on this or "
    "another thread; a foreign pointer; or another size)";

}  // namespace

DevicePoolCore::DevicePoolCore(std::shared_ptr<Upstream> upstream_in,
                               const DevicePool::Options& options_in)
    : uid(next_pool_uid.fetch_add(1, std::memory_order_relaxed)),
      dekker(barrier_mode_for_new_pool()),
      upstream(upstream_in ? std::move(upstream_in)
                           : throw InvalidArgument("vram::DevicePool: the upstream is null")),
      options(options_in),
      fence(options.fence ? options.fence : default_fence(*upstream)),
      virtual_memory(make_virtual_memory(options, upstream)),
      small_max(std::clamp<std::size_t>(options.small_tier.max_block_bytes, 256, 2u << 20)),
      small(*upstream, *fence, gauge,
            SegmentTier::Options{
                .granularity = kSmallGranularity,
                .packed_segment = 2u << 20,
                .packed_limit = 0,
                .max_free_bytes = options.max_cached_bytes,
                .growth_headroom_1024 = growth_headroom_1024(options.growth_headroom),
                .wants = &wants}),
      large(*upstream, *fence, gauge,
            SegmentTier::Options{
                .granularity = 512,
                .packed_segment = options.large_tier.segment_bytes,
                .packed_limit = options.large_tier.segment_bytes / 2,
                .max_free_bytes = options.max_cached_bytes,
                .max_segment_waste = options.large_tier.max_segment_waste_bytes,
                .virtual_memory = virtual_memory.get(),
                .reservation = reservation_for(options, *upstream),
                .unmap_before_map = options.large_tier.unmap_before_map,
                .max_run_bytes = options.large_tier.virtual_run_bytes,
                .map_ahead_bytes = options.large_tier.virtual_map_ahead_bytes,
                .growth_headroom_1024 = growth_headroom_1024(options.growth_headroom),
                .wants = &wants}),
      heaps(ThreadHeap::Options{.chunk_bytes = options.thread_cache.large_chunk_bytes,
                                .keep_idle = options.thread_cache.large_bytes,
                                .granularity = 512}),
      small_heaps(ThreadHeap::Options{
          .chunk_bytes = kSmallHeapChunk,
          .keep_idle = std::max(options.thread_cache.max_bytes, 2 * kSmallHeapChunk),
          .granularity = kSmallGranularity}) {
  // Blocks are carved at 256-byte multiples of the upstream's allocations: they are
  // 256-byte aligned only if those are (and never more than that, whatever the upstream
  // promises: alignment above 256 is refused, not silently missed).
  if (const std::size_t promised = upstream->alignment(); promised < kMaxAlignment) {
    throw InvalidArgument("vram::DevicePool: the upstream '" + std::string(upstream->name()) +
                          "' aligns its allocations to " + std::to_string(promised) +
                          " bytes; the pool's blocks need 256. Fix: an upstream for a "
                          "DevicePool returns 256-byte aligned memory (as cudaMalloc does) "
                          "and says so in alignment().");
  }
  options.thread_cache.blocks = std::min(options.thread_cache.blocks, kMaxThreadCacheDepth);
  options.small_tier.max_block_bytes = small_max;
  small_classes = SizeClasses::index_for(small_max) + 1;
  // 0: automatic (kAutoSmallSegmentMax over virtual memory; segments: every small class).
  // By block bytes, so classes that share a block size share a tier (validate_deallocations
  // tells blocks apart by block bytes); at least kMinLargeTierBlock, above which every
  // class is a multiple of the large tier's 512-byte rounding.
  const std::size_t asked = options.small_tier.segment_max_bytes != 0
                                ? options.small_tier.segment_max_bytes
                            : virtual_memory != nullptr ? kAutoSmallSegmentMax
                                                        : small_max;
  const std::size_t segment_max = std::max(kMinLargeTierBlock, asked);
  first_large_class = 0;
  while (first_large_class < small_classes && small_block_bytes(first_large_class) <= segment_max) {
    ++first_large_class;
  }
  const std::size_t cached_classes =
      options.thread_cache.blocks == 0 || options.thread_cache.max_block_bytes == 0
          ? 0
          : SizeClasses::index_for(std::min(options.thread_cache.max_block_bytes, small_max)) + 1;
  registry.set_shape(
      ThreadCacheRegistry::Shape{.classes = small_classes,
                                 .cached_classes = cached_classes,
                                 .depth = options.thread_cache.blocks,
                                 .large_from_start = options.thread_cache.large_from_start,
                                 .max_bytes = options.thread_cache.max_bytes});
  for (std::size_t index = 0; index < small_classes; ++index) {
    block_bytes_of[index] = static_cast<std::uint32_t>(small_block_bytes(index));
  }
  plain_calls = !options.validate_deallocations && !options.track_peak_in_use;
  with_heaps = options.thread_cache.large_chunk_bytes != 0 &&
               options.thread_cache.large_bytes / 4 > small_max;
  if (options.detect_unscoped_capture) call_checks.fetch_or(kWatchCaptures);
}

DevicePoolCore::~DevicePoolCore() {
  // close() has run and every block is back; return what a racing thread exit parked
  // before the tiers give every segment back (they are destroyed after this body).
  for (auto& cache : registry.frozen()) drain_bins(*cache);
  drain_rings();
  for (auto& ring : rings) delete ring.load(std::memory_order_relaxed);
}

[[gnu::noinline, gnu::cold]] void* DevicePoolCore::flush_and_end_claim(ThreadCache& cache,
                                                                       void* result) noexcept {
  cache.flush_requested.store(false, std::memory_order_relaxed);
  const bool had_large = cache.large.cached_count() > 0;
  drain_bins(cache);
  small.trim(0, false);
  // Its large blocks and those of the classes carved from the large tier went back there,
  // maybe after the trimmer's own large.trim(): that tier is trimmed again to what the
  // trim asked.
  if (had_large || first_large_class < small_classes) {
    large.trim(flush_keep_bytes.load(std::memory_order_relaxed), false);
  }
  cache.state.store(ThreadCache::kFree, std::memory_order_release);
  return result;
}

void DevicePoolCore::serve_want(StreamKey key) noexcept {
  if (!wants.take(key)) return;  // another key's bit, or another call on it took the want
  // One marker per tier that holds the stream's ranges, recorded with no tier mutex locked.
  // mark_frees() before the record: a free that reaches a tier after the mark (on another
  // thread) may be used by work queued after the marker, so it keeps its tag.
  for (SegmentTier* tier : {&small, &large}) {
    if (!tier->holds_stream(key)) continue;
    const std::uint64_t mark = tier->mark_frees();
    std::uint64_t marker = 0;
    try {
      marker = fence->record(fence_stream_of(key));
    } catch (...) {  // captured, or a driver error: the ranges keep their tag
      continue;
    }
    if (!tier->adopt_marker(key, marker, mark)) fence->release(marker);
  }
}

void* DevicePoolCore::tier_grow(const Request& request, ThreadCache* claimed, LeaseOwner* owner,
                                StreamKey* served) {
  SegmentTier& tier = *request.tier;
  const std::size_t bytes = request.block_bytes;
  const StreamKey key = request.key;
  SlowSection slow(claimed);
  // Cached large blocks never make a tier grow: they go back first (large_block_cache.hpp),
  // and the request tries the large tier again without growing.
  if (flush_large_caches(claimed, key) && &tier == &large) {
    if (void* block = tier.allocate(bytes, key, false, nullptr, owner, served)) return block;
  }
  // Past the budget, free memory of wanted streams (stream_wants.hpp) could serve the
  // request or go back only after a device-wide quiesce: once per request, never while a
  // capture scope is open or this thread serves a captured request (it would synchronize
  // the device during the capture).
  const bool capturing = graph_routing.any() || tl_in_capture;
  bool may_quiesce = !capturing;
  for (;;) {
    // Read before the tier looks: a quiesce that begins after it covers what it finds.
    const std::uint64_t seen = quiescer.generation();
    // Growing past the budget the tiers share (segment_tier.hpp): when this tier's wholly
    // free segments cannot cover the excess, the other tier's give back the rest (the tier
    // itself gives back its own as it grows).
    // A virtual-memory large tier that does not unmap before mapping gives nothing back to
    // stay within the budget (it only waits for other streams' frees past it), so its
    // growth does not make the other tier give segments back either.
    const SegmentTier::GrowthQuote quote = tier.quote_growth(bytes);
    const std::size_t excess =
        !tier.enforces_growth_budget()
            ? 0
            : gauge.excess_after_growth(quote.growth_bytes, quote.peak_growth,
                                        tier.growth_headroom_1024());
    if (const std::size_t own = excess > 0 ? quote.empty_bytes : 0; own < excess) {
      SegmentTier& other = &tier == &small ? large : small;
      if (may_quiesce && (quote.stranded || other.stranded_segments())) {
        may_quiesce = false;
        (void)quiescer.quiesce_since(seen);
        (void)return_idle_chunks(claimed, nullptr, key);  // chunks whose ranges it untagged
        continue;
      }
      other.release_empty_for(excess - own);
    }
    bool quiesce = false;
    try {
      if (void* block =
              tier.allocate(bytes, key, true, may_quiesce ? &quiesce : nullptr, owner, served)) {
        return block;
      }
    } catch (const OutOfMemory&) {
      // While a capture scope is open, or this thread serves a captured request, the trim
      // below would synchronize the device, which invalidates the capture: the request fails
      // instead (PyTorch's allocator does the same).
      if (capturing) throw;
      oom_retries.fetch_add(1, std::memory_order_relaxed);
      break;
    }
    // Null only with `quiesce` set.
    may_quiesce = false;
    (void)quiescer.quiesce_since(seen);
    (void)return_idle_chunks(claimed, nullptr, key);
  }
  // Everything cached, in every thread, and what graph pools gave up back to the upstream
  // (waiting for the work of stream-ordered frees), then once more.
  if (!capturing) reclaim_graph_returns(claimed);
  trim(0, claimed, /*wait=*/true);
  try {
    return tier.allocate(bytes, key, true, nullptr, owner, served);
  } catch (const OutOfMemory& second) {
    const DevicePoolStats now = stats();
    const std::string source = &tier == &large && virtual_memory != nullptr
                                   ? std::string("virtual memory (cuMemCreate/cuMemMap)")
                                   : "upstream " + std::string(upstream->name());
    // A small request names its class's bytes, a large one the bytes asked for.
    const std::size_t requested =
        request.small ? SizeClasses::bytes_of(request.index) : request.bytes;
    throw OutOfMemory(
        requested, now.bytes_cached, now.bytes_in_use,
        source + " failed after trimming the cache and retrying (" + second.what() + ")");
  }
}

void* DevicePoolCore::small_allocate(ThreadCache* cache, const Request& request) {
  void* block = nullptr;
  if (cache != nullptr && pop_cached(*cache, request.index, request.key, block)) [[likely]] {
    return block;
  }
  if (MpmcRing<void*>* ring = ring_of(request.index); ring != nullptr && ring->try_pop(block)) {
    return block;
  }
  // The thread's heap over the class's tier when it has one.
  if (ThreadHeap* heap =
          cache != nullptr && cache->heaps_on ? heap_of(*cache, *request.tier) : nullptr;
      heap != nullptr && request.block_bytes <= heap->max_block() &&
      heap_serves(*cache, request.key)) {
    return heap_allocate(*cache, request);
  }
  block = tier_allocate(request, cache);
  if (with_heaps && cache != nullptr && !cache->heaps_on && request.tier == &small) {
    note_small_contentions(*cache);
  }
  return block;
}

void* DevicePoolCore::large_allocate(ThreadCache* cache, const Request& request) {
  const std::size_t cap = options.thread_cache.large_bytes;
  const std::size_t bytes = request.block_bytes;
  if (cache == nullptr || bytes > cap) return tier_allocate(request, cache);
  if (cache->heaps_on && cache->heap != nullptr && bytes <= cache->heap->max_block() &&
      heap_serves(*cache, request.key)) {
    // The cache of exact sizes in front of the heap, while sizes repeat (large_block_cache.hpp).
    LargeBlockCache& exact = cache->large;
    const bool keeping = exact.active() && exact.keeps();
    void* block = keeping ? exact.take(bytes, request.key) : nullptr;
    if (exact.note_request(keeping ? block != nullptr : exact.would_hit(bytes))) [[unlikely]] {
      SlowSection slow(cache);
      drain_large(*cache);
    }
    if (block != nullptr) return block;
    block = heap_allocate(*cache, request, &exact);
    if (keeping) exact.note_leased(block, bytes);
    return block;
  }
  if (cache->large.active()) {
    if (void* block = cache->large.take(bytes, request.key)) return block;
  }
  // Filed with its owner even while the cache is inactive: the call may turn it on.
  void* block = tier_allocate(request, cache, &cache->large);
  cache->large.note_contentions(large.contentions());
  if (cache->large.active()) {
    cache->large.note_leased(block, bytes);
    if (with_heaps && !cache->heaps_on) [[unlikely]]
      start_heap(*cache);
  }
  return block;
}

bool DevicePoolCore::large_deallocate(ThreadCache& cache, void* block, const Request& request,
                                      SegmentTier::FreeMarker* marker, bool steady) noexcept {
  const std::size_t cap = options.thread_cache.large_bytes;
  const std::size_t need = request.block_bytes;
  // The heap's blocks are kept by exact size only while sizes come back
  // (large_block_cache.hpp); the tier's as always.
  const bool passes = cache.heap != nullptr && !cache.large.keeps() && cache.heap->contains(block);
  if (passes) cache.large.note_passed(block, need);
  // A young stream's free goes to the tier, pending under the call's marker (stream_ages.hpp).
  if (cache.large.active() && need <= cap && !passes && marker == nullptr && steady) {
    LargeBlockCache::Put put = cache.large.put(block, need, request.key, cap);
    if (put == LargeBlockCache::Put::no_room) {
      SlowSection slow(&cache);
      auto to_tier = [this, &cache](const LargeBlockCache::Cached& oldest) {
        (void)free_block(large, oldest.block, oldest.tag, oldest.bytes, &cache, false);
      };
      while (!cache.large.has_room(need, cap) && cache.large.free_oldest(to_tier)) {
      }
      put = cache.large.put(block, need, request.key, cap);
    }
    if (put == LargeBlockCache::Put::cached) return true;
    if (put == LargeBlockCache::Put::double_deallocate) return false;
  } else if (cache.large.active() && !passes && !cache.large.leaves(block)) {
    return false;  // cached here already: the tier would take it from its owner once more
  }
  const bool known = free_to_tier(block, request, &cache, marker);
  // Only to turn the cache on: once on, the read would only move the tier mutex's cache
  // line to this core on every deallocation.
  if (!cache.large.active()) cache.large.note_contentions(large.contentions());
  return known;
}

bool DevicePoolCore::free_through_heaps(SegmentTier& tier, void* block, StreamKey tag,
                                        std::size_t bytes, ThreadCache* via, bool claimed,
                                        SegmentTier::FreeMarker* marker, bool tag_alive) noexcept {
  ThreadCache* const holder = claimed ? via : nullptr;
  // The deallocating thread's own heap, then the tier, then the other heaps (a block of
  // another thread's heap). The order decides speed only: no heap block starts where a block
  // of the tier does (a chunk's guard), and a chunk's own address is refused by the tier
  // (thread_heap.hpp); a contains() that says yes wrongly costs a look.
  ThreadHeap* own = via != nullptr ? heap_of(*via, tier) : nullptr;
  const LeaseOwner* by = via != nullptr ? &via->large : nullptr;
  const StreamKey alive = tag_alive ? tag : kUntagged;
  if (own != nullptr && own->contains(block) &&
      heap_deallocate(*own, tier, block, tag, bytes, holder, by, alive)) {
    // Chunks a growth asked back (ThreadHeap::asked) whose tagged ranges are this stream's go
    // to the tier, their largest range under a marker recorded on it by this call
    // (return_chunk; a marker that cannot be recorded leaves them waiting for wants).
    if (alive != kUntagged && holder != nullptr && own->asked()) [[unlikely]] {
      (void)return_idle_of(*own, tier, holder, ThreadHeap::Idle::asked, alive, alive);
    }
    return true;
  }
  if (settle_free(tier, tier.free_keeping(block, tag, bytes, by, marker), holder)) return true;
  bool found = false;
  heaps_of(tier).for_each([&](ThreadHeap& heap) {
    if (!found && &heap != own && heap.contains(block)) {
      found = heap_deallocate(heap, tier, block, tag, bytes, holder, by, alive);
    }
  });
  return found;
}

void* DevicePoolCore::heap_allocate(ThreadCache& cache, const Request& request, LeaseOwner* owner) {
  SegmentTier& tier = *request.tier;
  ThreadHeap& heap = *heap_of(cache, tier);
  const std::size_t need = request.block_bytes;
  if (void* block = heap.allocate(need, request.key, owner)) [[likely]] {
    return block;
  }
  // Wholly free chunks this request cannot use (other streams' ranges) go back first: in
  // the tier they wait for their streams' markers instead of holding memory here.
  (void)return_idle_of(heap, tier, &cache, ThreadHeap::Idle::holding_others, request.key);
  // Every slot taken: the tier serves the request (no chunk taken only to be given back).
  if (!heap.has_free_slot()) return tier_allocate(request, &cache, owner);
  const std::size_t chunk_bytes = heap.chunk_bytes_for(need);
  const Request chunk_request{
      .bytes = chunk_bytes, .block_bytes = chunk_bytes, .tier = &tier, .key = request.key};
  void* chunk = nullptr;
  StreamKey served = request.key;
  try {
    chunk = tier_allocate(chunk_request, &cache, &LeaseOwner::heap_chunks(), &served);
  } catch (const OutOfMemory&) {
    return tier_allocate(request, &cache, owner);  // the request alone may still fit
  }
  if (void* block =
          heap.allocate_in_new_chunk(chunk, chunk_bytes, need, request.key, served, owner)) {
    return block;
  }
  // No slot for another chunk (or no host memory for its books): the tier serves it.
  (void)settle_free(tier, tier.free_keeping(chunk, served, chunk_bytes, &LeaseOwner::heap_chunks()),
                    &cache);
  return tier_allocate(request, &cache, owner);
}

bool DevicePoolCore::heap_deallocate(ThreadHeap& heap, SegmentTier& tier, void* block,
                                     StreamKey tag, std::size_t bytes, ThreadCache* claimed,
                                     const LeaseOwner* by, StreamKey alive) noexcept {
  ThreadHeap::Returned chunk;
  if (heap.deallocate(block, bytes, tag, chunk, by) == ThreadHeap::Freed::foreign) return false;
  if (chunk.block != nullptr) return_chunk(chunk, tier, claimed, alive);
  return true;
}

void DevicePoolCore::return_chunk(const ThreadHeap::Returned& chunk, SegmentTier& tier,
                                  ThreadCache* claimed, StreamKey alive) noexcept {
  SegmentTier::FreeMarker marker;
  bool marked = false;
  // Only with the caller's cache as the recorder (stream_tags.hpp: an entry of no recorder
  // is a want's, which take_back() may file free again under its tag).
  if (alive != kUntagged && claimed != nullptr &&
      std::any_of(chunk.pieces.begin(), chunk.pieces.end(),
                  [alive](const SegmentTier::Piece& p) { return p.tag == alive; })) {
    SlowSection slow(claimed);  // a driver call: stealers may skip this holder meanwhile
    try {
      marker.marker = fence->record(fence_stream_of(alive));
      marker.recorder = claimed;
      marked = true;
    } catch (...) {  // captured, or a driver error: the pieces keep their tag (wants, quiesces)
    }
  }
  const SegmentTier::Freed freed =
      tier.free_pieces(chunk.block, chunk.bytes, chunk.pieces.data(), chunk.pieces.size(),
                       marked ? &marker : nullptr, alive);
  if (marked) {
    if (marker.taken) {
      markers_at_frees.fetch_add(1, std::memory_order_relaxed);
    } else {
      fence->release(marker.marker);  // no piece filed under it (foreign, or no host memory)
    }
  }
  // foreign: no host memory for the cuts; the chunk stays a block of the tier, unused, until
  // the tier's end (as a range left unfiled for want of host memory, free_ranges.hpp).
  (void)settle_free(tier, freed, claimed);
}

[[gnu::noinline, gnu::cold]] void DevicePoolCore::give_back_over_cap(
    SegmentTier& tier, ThreadCache* claimed) noexcept {
  SlowSection slow(claimed);
  tier.give_back_over_cap();
}

bool DevicePoolCore::return_idle_of(ThreadHeap& heap, SegmentTier& tier, ThreadCache* claimed,
                                    ThreadHeap::Idle which, StreamKey key,
                                    StreamKey alive) noexcept {
  bool any = false;
  ThreadHeap::Returned chunks[4];
  for (std::size_t n; (n = heap.take_idle(chunks, 4, which, key)) != 0;) {
    for (std::size_t i = 0; i < n; ++i) return_chunk(chunks[i], tier, claimed, alive);
    any = true;
  }
  return any;
}

bool DevicePoolCore::return_idle_chunks(ThreadCache* claimed, ThreadCache* only,
                                        std::optional<StreamKey> usable_by) noexcept {
  bool any = false;
  for (SegmentTier* tier : {&large, &small}) {
    if (only != nullptr) {
      if (ThreadHeap* heap = heap_of(*only, *tier)) {
        any = return_idle_of(*heap, *tier, claimed) || any;
      }
      continue;
    }
    const ThreadHeap* own = claimed != nullptr ? heap_of(*claimed, *tier) : nullptr;
    heaps_of(*tier).for_each([&](ThreadHeap& heap) {
      const bool filtered = usable_by.has_value() && &heap != own;
      any = return_idle_of(heap, *tier, claimed,
                           filtered ? ThreadHeap::Idle::usable : ThreadHeap::Idle::all,
                           usable_by.value_or(kUntagged)) ||
            any;
    });
  }
  return any;
}

void DevicePoolCore::start_heap(ThreadCache& cache) noexcept {
  cache.large.activate();  // threads met: the cache of exact sizes in front of the heap
  // A heap is null when none is left: the caches go on alone.
  if (cache.heap == nullptr) cache.heap = heaps.make();
  if (cache.small_heap == nullptr) cache.small_heap = small_heaps.make();
  cache.heaps_on = true;
  // Its bins may hold more (also when no heap was left for it: it met other threads all the
  // same): sizes that change would otherwise pass through the shared rings.
  cache.max_bytes =
      std::max(options.thread_cache.max_bytes, options.thread_cache.contended_max_bytes);
}

// Returns false when the block is not this pool's (only detectable in the tiers).
bool DevicePoolCore::small_deallocate(ThreadCache* cache, void* block, const Request& request,
                                      SegmentTier::FreeMarker* marker, bool steady) noexcept {
  const std::size_t index = request.index;
  const StreamKey key = request.key;
  const std::uint64_t block_bytes = request.block_bytes;
  const std::uint64_t cached =
      cache != nullptr ? cache->cached_bytes.load(std::memory_order_relaxed) : 0;
  // A young stream's free goes to the tier, pending under the call's marker (stream_ages.hpp;
  // the free that turns it steady too: its marker is recorded).
  if (cache != nullptr && (marker != nullptr || !steady)) {
    return free_to_tier(block, request, cache, marker);
  }
  if (cache != nullptr && has_room(*cache, index, cached, block_bytes)) [[likely]] {
    if (cached == 0) {
      cache->tag = key;  // an empty cache takes the tag of what it holds next
    } else if (key != cache->tag && key != kUntagged) {
      if (cache->tag != kUntagged) {
        SlowSection slow(cache);
        drain_bins(*cache);  // the old stream's blocks keep their tag in the tier
      }
      cache->tag = key;  // completed (untagged) blocks are safe on `key` too
    }
    push_cached(*cache, block, index, block_bytes);
    return true;
  }
  if (key == kUntagged) {
    if (MpmcRing<void*>* ring = ring_for_deallocate(index);
        ring != nullptr && ring->try_push(block)) {
      return true;
    }
  }
  return free_to_tier(block, request, cache);
}

[[gnu::noinline, gnu::cold]] void DevicePoolCore::reject_request(std::size_t bytes,
                                                                 std::size_t alignment) const {
  if (bytes == 0) {
    throw InvalidArgument(
        "vram::DevicePool::allocate: zero bytes requested. Fix: keep zero-sized buffers as "
        "null sentinels and ask for at least one byte.");
  }
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > kMaxAlignment) {
    throw InvalidArgument("vram::DevicePool::allocate: alignment " + std::to_string(alignment) +
                          " is not a power of two up to " + std::to_string(kMaxAlignment) +
                          ". Fix: blocks are 256-byte aligned; ask for 256 or less.");
  }
  const DevicePoolStats now = stats();
  throw OutOfMemory(bytes, now.bytes_cached, now.bytes_in_use,
                    "larger than the largest block (1 TiB)");
}

void* DevicePoolCore::allocate_slow(std::size_t bytes, std::size_t alignment, StreamKey key) {
  if (bytes - 1 >= SizeClasses::kMaxBytes || alignment - 1 >= kMaxAlignment ||
      (alignment & (alignment - 1)) != 0) [[unlikely]] {
    reject_request(bytes, alignment);
  }
  return serve(request_of(bytes, key), nullptr);
}

void* DevicePoolCore::allocate_miss(std::size_t bytes, std::size_t index, StreamKey key,
                                    ThreadCache* cache) {
  return serve(small_request(bytes, index, key), cache);
}

void* DevicePoolCore::serve(const Request& request, ThreadCache* cache) {
  const std::size_t block_bytes = request.block_bytes;
  void* block = nullptr;
  if (cache == nullptr) cache = claim_own_cache();
  if (cache != nullptr) [[likely]] {
    try {
      block = request.small ? small_allocate(cache, request) : large_allocate(cache, request);
    } catch (...) {
      end_claim(*cache);
      throw;
    }
    bump(cache->acquires, 1);
    bump(cache->acquired_bytes, block_bytes);
    end_claim(*cache);
  } else {
    std::lock_guard lock(slow_path);
    if (orphan.active()) [[unlikely]] {
      throw InvalidArgument(
          "vram::DevicePool::allocate: the pool was destroyed. Fix: keep the DevicePool alive "
          "while it is used.");
    }
    block = request.small ? small_allocate(nullptr, request) : tier_allocate(request, nullptr);
    slow_path.count_acquire(block_bytes);
  }
  if (options.track_peak_in_use) note_in_use(static_cast<std::int64_t>(block_bytes));
  if (options.validate_deallocations) {
    try {
      validation.record(block, block_bytes);
    } catch (...) {  // could not record it: undo the acquire so nothing is lost
      undo_acquire(block, request);
      throw;
    }
  }
  return block;
}

[[gnu::noinline]] void DevicePoolCore::deallocate_checked(void* block, std::size_t bytes,
                                                          StreamKey key) noexcept {
  if (block == nullptr) return;
  if (bytes == 0) return reject_deallocate(block, bytes, "zero bytes (no block has zero bytes)");
  if (bytes > SizeClasses::kMaxBytes) {
    return reject_deallocate(block, bytes, "more bytes than the largest block (1 TiB)");
  }
  const Request request = request_of(bytes, key);
  if (options.validate_deallocations && !validation.check(block, request.block_bytes)) return;
  deallocate_valid(block, request);
}

void DevicePoolCore::deallocate_valid(void* block, const Request& request) noexcept {
  ThreadCache* cache = nullptr;
  if (deallocate_warm(block, request, cache)) return;
  deallocate_slow(block, request, cache);
}

void DevicePoolCore::undo_acquire(void* block, const Request& request) noexcept {
  ThreadCache* cache = nullptr;
  if (deallocate_warm(block, request, cache)) return;
  deallocate_outlined(block, request, cache);
}

void DevicePoolCore::deallocate_miss_claimed(void* block, std::size_t bytes,
                                             StreamKey key) noexcept {
  deallocate_slow(block, small_request(bytes, SizeClasses::index_for(bytes), key), tl_last.cache);
}

void DevicePoolCore::deallocate_miss(void* block, std::size_t bytes, StreamKey key) noexcept {
  deallocate_outlined(block, small_request(bytes, SizeClasses::index_for(bytes), key), nullptr);
}

[[gnu::noinline]] void DevicePoolCore::deallocate_outlined(void* block, const Request& request,
                                                           ThreadCache* cache) noexcept {
  deallocate_slow(block, request, cache);
}

void DevicePoolCore::deallocate_slow(void* block, const Request& request,
                                     ThreadCache* cache) noexcept {
  const std::size_t block_bytes = request.block_bytes;
  const bool track = options.track_peak_in_use;
  if (cache == nullptr) cache = claim_own_cache();
  if (cache != nullptr) [[likely]] {
    // A young stream's marker, recorded before its block reaches the tier (stream_ages.hpp).
    SegmentTier::FreeMarker young;
    const FreeAge age = record_if_young(*cache, request.key, young);
    SegmentTier::FreeMarker* const marker = age.marked ? &young : nullptr;
    const bool known = request.small ? small_deallocate(cache, block, request, marker, age.steady)
                                     : large_deallocate(*cache, block, request, marker, age.steady);
    if (known) [[likely]] {
      bump(cache->deallocations, 1);
      bump(cache->deallocated_bytes, block_bytes);
    }
    // Before end_claim: past it, close() may destroy the core (and its fence) at any time.
    if (marker != nullptr) {
      if (!young.taken) {
        fence->release(young.marker);  // a heap's block, a foreign one, or no entry
      } else {
        markers_at_frees.fetch_add(1, std::memory_order_relaxed);
      }
    }
    if (!known) {
      SlowSection slow(cache);  // the message may block: trim and flushes skip this holder
      reject_deallocate(block, request.bytes, kNotLive);
    } else if (track) {
      note_in_use(-static_cast<std::int64_t>(block_bytes));
    }
    end_claim(*cache);
    return;
  }
  // Slow path. When orphaned, the last deallocation drops the self-reference after the lock
  // is unlocked (declared first, destroyed last): that may destroy *this.
  std::shared_ptr<DevicePoolCore> last;
  std::lock_guard lock(slow_path);
  bool known = true;
  if (!orphan.active()) {
    // No cache: small_deallocate reads no stream age (`steady` is unused).
    known = request.small ? small_deallocate(nullptr, block, request, nullptr, true)
                          : free_block(large, block, request.key, block_bytes, nullptr, false);
  } else {
    known = free_block(*request.tier, block, request.key, block_bytes, nullptr, false);
    (void)return_idle_chunks(nullptr);
    small.trim(0, false);  // give wholly free segments straight back
    large.trim(0, false);
  }
  if (!known) return reject_deallocate(block, request.bytes, kNotLive);
  slow_path.count_deallocation(block_bytes);
  if (track) note_in_use(-static_cast<std::int64_t>(block_bytes));
  if (orphan.active()) last = orphan.block_returned();
}

DevicePoolCore::FreeAge DevicePoolCore::record_young_marker(
    ThreadCache& cache, StreamKey key, SegmentTier::FreeMarker& young) noexcept {
  const cudaStream_t stream = fence_stream_of(key);
  const StreamAges::Free free =
      cache.stream_ages.note_free(key, [&] { return fence->stream_id(stream); });
  if (!free.young) return {false, free.steady};
  // The call proves the stream alive; the work its caller queued on the block came before.
  // A driver call: stealers may skip this holder meanwhile.
  SlowSection slow(&cache);
  // A key young again (a new stream behind a steady one's handle, or its entry replaced) may
  // still tag the cache or be the heap's home: its cached blocks go to their tiers under the
  // key, and the heap stops serving it, so its frees from now on are young ones.
  if (cache.tag == key) drain_bins(cache);
  if (cache.heap_home == key) cache.heap_home = kUntagged;
  try {
    young.marker = fence->record(stream);
    young.recorder = &cache;
  } catch (...) {  // captured, or a driver error: the block keeps its tag (wants, quiesces)
    return {false, free.steady};
  }
  return {true, free.steady};
}

}  // namespace vram::detail
