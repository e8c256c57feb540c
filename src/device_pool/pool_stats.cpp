// DevicePool's counters summed over the thread caches, the slow path, the rings and the
// tiers. Exact when no call runs at the same moment: each counter has one writer (its
// cache's owner, or the holder of the slow path's mutex) and is read here with relaxed loads.
#include <algorithm>

#include "pool_core.hpp"

namespace vram::detail {

DevicePoolStats DevicePoolCore::stats() const {
  DevicePoolStats s;
  const SlowPath::Totals slow = slow_path.totals();
  std::uint64_t acquired_bytes = slow.acquired_bytes;
  std::uint64_t deallocated_bytes = slow.deallocated_bytes;
  s.acquires = slow.acquires;
  s.deallocations = slow.deallocations;
  std::size_t thread_cached = 0;
  registry.for_each([&](const ThreadCache& cache) {
    s.acquires += cache.acquires.load(std::memory_order_relaxed);
    s.deallocations += cache.deallocations.load(std::memory_order_relaxed);
    acquired_bytes += cache.acquired_bytes.load(std::memory_order_relaxed);
    deallocated_bytes += cache.deallocated_bytes.load(std::memory_order_relaxed);
    thread_cached += cache.cached_bytes.load(std::memory_order_relaxed);
    thread_cached += cache.large.cached_bytes();
  });
  for (const ThreadHeaps* set : {&heaps, &small_heaps}) {
    set->for_each(
        [&](const ThreadHeap& heap) { s.bytes_cached_in_thread_heaps += heap.free_bytes(); });
  }
  thread_cached += s.bytes_cached_in_thread_heaps;
  std::size_t ring_bytes = 0;
  for (std::size_t index = 0; index < small_classes; ++index) {
    if (const MpmcRing<void*>* ring = ring_of(index)) {
      ring_bytes += ring->size() * small_block_bytes(index);
    }
  }
  const SegmentTier::Counters a = small.counters();
  const SegmentTier::Counters b = large.counters();
  s.upstream_allocations = a.upstream_allocations + b.upstream_allocations;
  s.upstream_frees = a.upstream_frees + b.upstream_frees;
  s.misses = s.upstream_allocations + a.failed_upstream_allocations + b.failed_upstream_allocations;
  s.hits = s.acquires > s.upstream_allocations ? s.acquires - s.upstream_allocations : 0;
  s.oom_retries = oom_retries.load(std::memory_order_relaxed);
  s.quiesces = quiescer.quiesces();
  s.stream_quiesces = quiescer.quiesces_for_streams();
  s.stream_marker_wants = wants.wanted();
  s.stream_markers = markers_at_frees.load(std::memory_order_relaxed);
  s.invalid_deallocations = validation.rejected();
  s.bytes_in_use = acquired_bytes > deallocated_bytes ? acquired_bytes - deallocated_bytes : 0;
  const SleepTags::Totals tags = sleep_tags.totals();
  s.sleep_tag_bytes_mapped = tags.mapped_bytes;
  s.sleeping_tags = tags.sleeping;
  s.bytes_reserved = gauge.total.load(std::memory_order_relaxed);
  // A high-water mark read beside a count that moved meanwhile: never reported below it.
  s.peak_bytes_reserved =
      std::max(gauge.total_peak.load(std::memory_order_relaxed), s.bytes_reserved);
  s.bytes_cached = s.bytes_reserved > s.bytes_in_use ? s.bytes_reserved - s.bytes_in_use : 0;
  s.bytes_cached_in_threads = thread_cached;
  s.bytes_cached_in_rings = ring_bytes;
  s.segments = a.segments + b.segments;
  s.peak_bytes_in_use = in_use.peak();
  const GraphPools::Stats graphs = graph_pools.stats();
  s.graph_pool_bytes = graphs.held_bytes;
  s.graph_pools = graphs.pools;
  s.unscoped_capture_calls = unscoped_capture_calls.load(std::memory_order_relaxed);
  return s;
}

}  // namespace vram::detail
