// Replays a Trace through one allocator and measures it (`vram replay`, `vram bench
// --scenario replay`).
//
// One thread replays the events in trace order (the Thread column is not used). Every
// trace stream gets a CUDA stream of its own on a device replay; host-only, streams are
// tags. Frees to a stream-unaware allocator on a multi-stream trace are held back until the
// stream's work at the free has completed (replay_allocator.hpp): device: an event recorded
// on the stream at the free has fired; host-only: `stream_lag` further trace events have
// passed (the emulated completion). When an allocation fails while frees are held back, the
// driver waits for all of them (as a stream-ordered pool would) and retries once.
//
// ns_per_op is the wall time of the replay loop (held-back frees included) over the events
// it ran. A failing allocation ends the replay: failed_at is the data row of that event.
//
// Passes (ReplayOptions::passes, `vram replay --passes N`)
//   passes == 1 (the default): the trace once; allocations the trace leaves live are freed
//   after the timed region and not counted (what the replay always did).
//   passes >= 2: the trace N times back to back on the same allocator instance and the same
//   streams. Each pass ends by freeing every block the trace left live, in slot order on
//   the stream it was allocated on, through the same path as the trace's frees (held back
//   for a stream-unaware allocator on a multi-stream trace), then waiting for every
//   held-back free; those frees are operations of the pass. So pass k+1 starts with no
//   live block and whatever the allocator cached after pass k. Each pass is timed on its
//   own (ending with allocator.synchronize(), as one pass does); ns_per_op stays pass 1
//   (cold), warm_ns_per_op is the median of passes 2..N. peak_reserved_bytes is the peak
//   over all passes. A failing allocation in any pass ends the replay (failed_pass says
//   which).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "replay/replay_allocator.hpp"
#include "replay/trace.hpp"

namespace vram::replay {

struct ReplayOptions {
  bool device = false;  // false: host-only (emulated device)
  int device_id = 0;
  std::size_t capacity_bytes = SIZE_MAX;  // emulated device size (host-only)
  std::size_t stream_lag = 8;             // host-only: events until a free's stream work completes
  std::size_t passes = 1;                 // replays of the trace on one allocator instance
  // > 0: pass 1 records about this many samples of live and reserved bytes, evenly spaced
  // over the trace's events (the memory picture; off in timed runs).
  std::size_t samples = 0;
};

// Live bytes (the trace's) and the allocator's reserved bytes after event `event`.
struct MemorySample {
  std::size_t event = 0;
  std::size_t live_bytes = 0;
  std::size_t reserved_bytes = 0;
};

struct ReplayResult {
  std::string trace;
  std::string allocator;
  std::size_t operations = 0;           // operations of all passes (one pass: the events replayed)
  double ns_per_op = 0;                 // pass 1 (cold)
  std::size_t peak_live_bytes = 0;      // from the trace
  std::size_t peak_reserved_bytes = 0;  // over all passes
  std::optional<std::uint64_t> upstream_allocations;  // over all passes
  std::optional<std::uint64_t> device_synchronizes;   // over all passes
  // One entry per pass run (the failing pass included, with what it ran before failing).
  std::vector<double> pass_ns_per_op;
  std::vector<std::size_t> pass_operations;  // events replayed + leftovers freed (passes >= 2)
  std::vector<std::optional<std::uint64_t>> pass_upstream_allocations;  // made during the pass
  // passes >= 2 and pass 2 reached: the median of passes 2..N's ns/op, and the upstream
  // allocations of passes 2..N together (empty when the allocator cannot say).
  std::optional<double> warm_ns_per_op;
  std::optional<std::uint64_t> warm_upstream_allocations;
  std::optional<std::size_t> failed_at;    // data row of the failing event
  std::optional<std::size_t> failed_pass;  // 1-based pass of the failing event
  std::size_t failed_line = 0;
  std::string failure;                // what the allocator said
  std::vector<MemorySample> samples;  // ReplayOptions::samples > 0: pass 1's, in event order
  std::size_t held_back_frees = 0;    // frees the driver delayed for stream order
  std::size_t held_back_peak = 0;     // most frees held back at once
  double reserved_over_live() const {
    return peak_live_bytes == 0
               ? 0.0
               : static_cast<double>(peak_reserved_bytes) / static_cast<double>(peak_live_bytes);
  }
};

ReplayResult replay_trace(const Trace& trace, const AllocatorSpec& spec,
                          const ReplayOptions& options);

// The smallest emulated capacity (host-only) the allocator survives the trace with, by
// binary search between the trace's peak live bytes and the allocator's unbounded peak
// reserved, to within max(4 KiB, 0.1%). Survival need not be monotone in capacity; the
// answer is the search's. Empty when the allocator fails even with unbounded capacity.
// Always one pass per probe (options.passes is ignored): the capacity a cold replay needs.
std::optional<std::size_t> min_capacity(const Trace& trace, const AllocatorSpec& spec,
                                        const ReplayOptions& options,
                                        std::size_t unbounded_peak_reserved);

}  // namespace vram::replay
