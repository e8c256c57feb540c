// The `replay` and `batched` scenarios of `vram bench`.
//   replay:  every trace under bench/traces/*.csv.gz (or $VRAM_TRACE_DIR) through vram
//            DevicePool and the replay peers (host-only: DevicePool over host memory).
//   batched: per thread, 32 live blocks of mixed sizes (256 B - 1 MiB, log-uniform, fixed
//            seed) allocated, then freed in a fixed shuffled order; 1, 4 and 16 threads.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "bench/allocators.hpp"
#include "bench/harness.hpp"
#include "bench/report.hpp"
#include "bench/scenarios.hpp"

namespace vram::bench {

std::vector<std::string> replay_trace_paths();
std::size_t replay_steps(const BenchConfig& config);
void run_replay(const BenchConfig& config, Progress& progress, std::vector<Measurement>& results);

std::vector<unsigned> batched_thread_counts();
void run_batched(const BenchConfig& config,
                 std::vector<std::unique_ptr<BenchAllocator>>& allocators, Progress& progress,
                 std::vector<Measurement>& results);

}  // namespace vram::bench
