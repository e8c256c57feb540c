// `vram replay TRACE... [--json F] [--host-only] [--capacity-search] [--runs N] [--passes N]`: the
// report model and its JSON form (one record per trace and allocator), shared with the tests.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "replay/replay.hpp"
#include "replay/trace.hpp"

namespace vram::replay {

struct TraceSummary {
  std::string name;
  std::string path;
  std::size_t events = 0;
  std::size_t allocations = 0;
  std::size_t streams = 0;
  std::size_t peak_live_bytes = 0;
  std::size_t allocate_failures = 0;
  std::size_t unknown_frees = 0;
  std::size_t reused_live_pointers = 0;
  std::size_t free_size_mismatches = 0;
  std::size_t live_at_end = 0;
  static TraceSummary of(const Trace& trace);
};

struct AllocatorRun {
  ReplayResult result;                 // the run with the median ns/op (see runs_ns_per_op)
  std::vector<double> runs_ns_per_op;  // every run of this allocator on this trace, in order
  // passes >= 2: every run's warm_ns_per_op (median of its passes 2..N), in order; the
  // result's warm_ns_per_op is their median. Other pass figures are the result run's.
  std::vector<double> runs_warm_ns_per_op;
  std::optional<std::size_t> min_capacity_bytes;
  std::string capacity_method;  // how min_capacity_bytes was found; empty: not asked
};

struct SkippedAllocator {
  std::string allocator;
  std::string reason;
};

struct ReplayReport {
  bool device = false;
  std::string device_name;  // "host-only (emulated device)" without a GPU
  std::size_t stream_lag = 0;
  std::size_t runs_per_allocator = 1;  // replays of each trace per allocator (--runs)
  std::size_t passes_per_run = 1;      // passes over the trace per run (--passes)
  std::vector<TraceSummary> traces;
  std::vector<AllocatorRun> runs;
  std::vector<SkippedAllocator> skipped;
};

std::string to_json(const ReplayReport& report);
// "1.50 GiB", "256 B"
std::string human_bytes(std::size_t bytes);

}  // namespace vram::replay
