// The `replay` and `batched` scenarios of `vram bench`.
//   replay:  every trace under bench/traces/*.csv.gz (or $VRAM_TRACE_DIR) through vram
//            DevicePool and the replay peers (host-only: DevicePool over host memory).
//   batched: per thread, batches of 32 live blocks of mixed sizes (log-uniform from 256 B
//            to 1, 4, 16 and 64 MiB, fixed seed), each batch's sizes and free order drawn
//            afresh (kFreshBatches sets per thread, gone through in turn), allocated, then
//            freed in shuffled order; 1, 2, 4, 8 and 16 threads, a stream each; on a GPU
//            DevicePool in both forms (plain and stream-ordered), cudaMallocAsync on a
//            private pool and CUB in the same run. Each row notes its rate over the same
//            allocator's at 1 thread (x_1_thread).
//   batched-repeated: the same with one set of 32 sizes per thread, repeated every batch
//            (what per-thread caches of exact sizes serve).
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
// Progress steps of run_batched (`host_allocators`: how many the host-only run measures).
std::size_t batched_steps(const BenchConfig& config, std::size_t host_allocators);
void run_batched(const BenchConfig& config,
                 std::vector<std::unique_ptr<BenchAllocator>>& allocators, Progress& progress,
                 std::vector<Measurement>& results, bool fresh);  // false: batched-repeated

}  // namespace vram::bench
