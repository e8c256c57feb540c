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
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "replay/replay_allocator.hpp"
#include "replay/trace.hpp"

namespace vram::replay {

struct ReplayOptions {
  bool device = false;  // false: host-only (emulated device)
  int device_id = 0;
  std::size_t capacity_bytes = SIZE_MAX;  // emulated device size (host-only)
  std::size_t stream_lag = 8;             // host-only: events until a free's stream work completes
};

struct ReplayResult {
  std::string trace;
  std::string allocator;
  std::size_t operations = 0;  // events replayed (all of them unless one failed)
  double ns_per_op = 0;
  std::size_t peak_live_bytes = 0;  // from the trace
  std::size_t peak_reserved_bytes = 0;
  std::optional<std::uint64_t> upstream_allocations;
  std::optional<std::size_t> failed_at;  // data row of the failing event
  std::size_t failed_line = 0;
  std::string failure;              // what the allocator said
  std::size_t held_back_frees = 0;  // frees the driver delayed for stream order
  std::size_t held_back_peak = 0;   // most frees held back at once
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
std::optional<std::size_t> min_capacity(const Trace& trace, const AllocatorSpec& spec,
                                        const ReplayOptions& options,
                                        std::size_t unbounded_peak_reserved);

}  // namespace vram::replay
