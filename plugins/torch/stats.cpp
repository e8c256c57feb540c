#include "stats.hpp"

#include <algorithm>

#include "device_registry.hpp"

namespace vram_torch {

vram_torch_stats_t stats_of(DeviceState& state) {
  const Counters& c = state.counters;
  vram_torch_stats_t s{};
  s.allocated_bytes_current = c.class_bytes.all.current();
  s.allocated_bytes_peak = c.class_bytes.all.peak();
  s.allocated_bytes_allocated = c.class_bytes.all.added();
  s.allocated_bytes_freed = c.class_bytes.all.removed();
  s.requested_bytes_current = c.requested_bytes.all.current();
  s.requested_bytes_peak = c.requested_bytes.all.peak();
  s.allocation_current = c.allocations.all.current();
  s.allocation_peak = c.allocations.all.peak();
  s.allocation_allocated = c.allocations.all.added();
  s.allocation_freed = c.allocations.all.removed();
  const vram::DevicePoolStats pool = state.pool.stats();
  // MemPools' own allocators' segments count too; torch.cuda's reserved bytes and device
  // allocations are read from here (native_allocator.cpp), so both views agree.
  s.reserved_bytes_current = pool.bytes_reserved + state.graphs.foreign_totals().bytes;
  s.reserved_bytes_peak =
      std::max<std::uint64_t>(pool.peak_bytes_reserved, s.reserved_bytes_current);
  s.cached_bytes = pool.bytes_cached;
  s.num_device_alloc =
      pool.upstream_allocations + c.foreign_segments_made.load(std::memory_order_relaxed);
  s.num_device_free =
      pool.upstream_frees + c.foreign_segments_freed.load(std::memory_order_relaxed);
  s.num_alloc_retries = pool.oom_retries + c.retries.load(std::memory_order_relaxed);
  s.num_ooms = c.ooms.load(std::memory_order_relaxed);
  s.record_stream_calls = c.record_calls.load(std::memory_order_relaxed);
  s.held_back_blocks = state.streams.held_blocks();
  s.held_back_bytes = state.streams.held_bytes();
  s.graph_pool_bytes = pool.graph_pool_bytes;
  s.graph_pools = pool.graph_pools;
  s.unscoped_capture_calls = pool.unscoped_capture_calls;
  s.graph_invalid_releases = state.graphs.invalid_releases();
  return s;
}

}  // namespace vram_torch
