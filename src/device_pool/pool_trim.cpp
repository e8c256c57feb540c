// Taking cached blocks back: trim() and close() are the stealer's side of the thread
// caches' handshake (thread_cache.hpp); then the rings, then the tiers.
#include "pool_core.hpp"

namespace vram::detail {

void DevicePoolCore::drain_bins(ThreadCache& cache) noexcept {
  for (std::size_t index = 0; index < cache.bins.size(); ++index) {
    auto& bin = cache.bins[index];
    SegmentTier& tier = tier_of(index);
    const std::size_t bytes = block_bytes_of[index];
    for (std::uint32_t i = 0; i < bin.count; ++i) {
      (void)free_block(tier, bin.blocks[i], cache.tag, bytes, &cache, false);
    }
    bin.count = 0;
  }
  cache.tag = kUntagged;
  cache.cached_bytes.store(0, std::memory_order_relaxed);
  drain_large(cache);
}

void DevicePoolCore::drain_large(ThreadCache& cache) noexcept {
  cache.large.drain([this, &cache](const LargeBlockCache::Cached& c) {
    (void)free_block(large, c.block, c.tag, c.bytes, &cache, false);
  });
}

bool DevicePoolCore::flush_large_caches(ThreadCache* claimed, StreamKey key) noexcept {
  if (options.thread_cache.large_bytes == 0) return false;
  const bool cached = flush_cached_large_blocks(claimed);
  // Then the heaps' wholly free chunks (the cached blocks of theirs went back first): their
  // mutexes are taken one at a time, no cache is stolen for them.
  const bool idle = (heaps.any() || small_heaps.any()) && return_idle_chunks(claimed, nullptr, key);
  return cached || idle;
}

bool DevicePoolCore::flush_cached_large_blocks(ThreadCache* claimed) noexcept {
  bool any = false;
  if (claimed != nullptr && claimed->large.cached_count() > 0) {
    drain_large(*claimed);
    any = true;
  }
  std::vector<ThreadCache*> snapshot;
  try {
    snapshot = registry.snapshot([claimed](const ThreadCache& cache) {
      return &cache != claimed && cache.large.cached_bytes() > 0;
    });
  } catch (...) {  // no host memory for the list: only the caller's own went back
    return any;
  }
  if (snapshot.empty()) return any;
  // As trim() steals (see there), but an owner inside a call that may block keeps its
  // blocks: asking it to flush would also trim the tiers on its way out.
  std::lock_guard steal_lock(registry.steal_mutex());
  std::erase_if(snapshot, [](ThreadCache* cache) {
    return cache->steal.load(std::memory_order_relaxed) == ThreadCache::kClosed;
  });
  registry.steal(
      snapshot, dekker,
      [this, &any](ThreadCache& cache) {
        any = any || cache.large.cached_count() > 0;
        drain_large(cache);
      },
      [](ThreadCache&) { return true; });
  return any;
}

void DevicePoolCore::drain_rings() noexcept {
  for (std::size_t index = 0; index < small_classes; ++index) {
    MpmcRing<void*>* ring = ring_of(index);
    void* block = nullptr;
    while (ring != nullptr && ring->try_pop(block)) {
      (void)free_block(tier_of(index), block, kUntagged, block_bytes_of[index], nullptr, false);
    }
  }
}

void DevicePoolCore::trim(std::size_t keep_bytes, ThreadCache* claimed, bool wait) noexcept {
  flush_keep_bytes.store(keep_bytes, std::memory_order_relaxed);
  std::vector<ThreadCache*> snapshot;
  try {
    snapshot = registry.snapshot([](const ThreadCache&) { return true; });
  } catch (...) {  // no host memory for the list: only the shared tiers are trimmed
  }
  {
    // Flag every cache, then one heavy barrier for all of them (see ThreadCache): after it,
    // an owner that has not yet claimed its cache sees the flag and stays out.
    std::lock_guard steal_lock(registry.steal_mutex());
    std::size_t kept = 0;
    for (ThreadCache* cache : snapshot) {
      if (cache == claimed) {
        drain_bins(*cache);  // the caller's own, claimed by the caller
      } else if (cache->steal.load(std::memory_order_relaxed) != ThreadCache::kClosed) {
        snapshot[kept++] = cache;  // (a closed one: close() takes its blocks)
      }
    }
    snapshot.resize(kept);
    // Waits for an owner inside a short call; an owner inside a call that may block (an
    // upstream call, its own trim) is asked to flush before it returns instead: left once it
    // is seen inside that call after the request (it will see the request), looked at again
    // otherwise (it may have returned before the request).
    registry.steal(
        snapshot, dekker,
        [this](ThreadCache& cache) {
          drain_bins(cache);
          cache.flush_requested.store(false, std::memory_order_relaxed);
        },
        [](ThreadCache& cache) {
          cache.flush_requested.store(true, std::memory_order_seq_cst);
          return cache.in_slow_call.load(std::memory_order_seq_cst);
        });
  }
  drain_rings();
  (void)return_idle_chunks(claimed);  // after the caches and rings gave theirs back
  // Wait for every stream's work instead of recording a marker on each stream that freed
  // blocks: that stream may have been destroyed since (a marker on it would be undefined
  // behaviour), and trim gives memory back with cudaFree, which synchronizes anyway. Only
  // frees made before the synchronize began are known complete after it: a free racing it
  // on another thread keeps its stream (mark_frees).
  quiescer.quiesce();
  // The quiesce freed the heaps' stream ranges for every stream: chunks that were kept for
  // their streams' sake, or whose ranges merge only now, go back too.
  (void)return_idle_chunks(claimed);
  small.trim(0, wait);
  large.trim(keep_bytes, wait);
}

bool DevicePoolCore::close(std::uint64_t& blocks, std::uint64_t& bytes) noexcept {
  registry.close();  // no cache registers from now on: frozen() may be walked
  // Close every cache for good (after any trim in progress: it holds steal_mutex from its
  // first flag to its last clear), then wait for the calls in progress on them. The wait
  // holds no mutex: an owner inside a blocking call may still trim (it skips closed caches).
  {
    std::lock_guard steal_lock(registry.steal_mutex());
    for (auto& cache : registry.frozen()) cache->steal.store(ThreadCache::kClosed, kDekkerStore);
  }
  dekker.heavy();
  for (auto& cache : registry.frozen()) {
    Backoff backoff;
    while (cache->state.load(kDekkerLoad) != ThreadCache::kFree) backoff.pause();
    drain_bins(*cache);
  }
  // Every call from now on takes the slow path, serialised by its mutex: the count of
  // leased blocks is exact.
  std::lock_guard slow(slow_path);
  const SlowPath::Totals slow_totals = slow_path.totals();
  std::uint64_t acquires = slow_totals.acquires;
  std::uint64_t deallocations = slow_totals.deallocations;
  std::uint64_t acquired = slow_totals.acquired_bytes;
  std::uint64_t deallocated = slow_totals.deallocated_bytes;
  for (auto& cache : registry.frozen()) {
    acquires += cache->acquires.load(std::memory_order_relaxed);
    deallocations += cache->deallocations.load(std::memory_order_relaxed);
    acquired += cache->acquired_bytes.load(std::memory_order_relaxed);
    deallocated += cache->deallocated_bytes.load(std::memory_order_relaxed);
  }
  trim(0, nullptr, false);
  blocks = acquires - deallocations;
  bytes = acquired - deallocated;
  if (blocks == 0) return false;
  orphan.begin(blocks, shared_from_this());
  return true;
}

}  // namespace vram::detail
