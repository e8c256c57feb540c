// The scenarios of `vram bench`. Each appends its measurements to `results`.
#pragma once

#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "bench/report.hpp"

namespace vram::bench {

struct BenchConfig {
  bool quick = false;
  bool gpu = false;
  int device = 0;
  std::vector<std::string> scenarios;
};

const std::vector<std::string>& known_scenarios();
// What `vram bench` runs without --scenario: all known but the long `pager` scenario.
std::vector<std::string> default_scenarios();
bool scenario_needs_gpu(const std::string& name);
std::vector<Measurement> run_scenarios(const BenchConfig& config);

// The `driver` scenario (bench/driver_scenario.cpp): cudaMalloc/cudaFree and the
// virtual-memory map/unmap by size, the floor under any allocator's cold start.
std::size_t driver_steps(const BenchConfig& config);
void run_driver(const BenchConfig& config, Progress& progress, std::vector<Measurement>& results);

// The `pager` scenario (bench/pager_scenario.cpp): WeightPager against its baselines.
std::size_t pager_scenario_steps(const BenchConfig& config);
void run_pager_scenario(const BenchConfig& config, Progress& progress,
                        std::vector<Measurement>& results);

// The `sleep` scenario (bench/sleep_scenario.cpp): DevicePool's sleep and wake of tagged
// memory against the pinned link of the same run.
std::size_t sleep_scenario_steps(const BenchConfig& config);
void run_sleep_scenario(const BenchConfig& config, Progress& progress,
                        std::vector<Measurement>& results);

// The `stream-churn` scenario (bench/stream_churn_scenario.cpp): threads whose every request
// runs on a stream created, used by kernels that tag and check its blocks, synchronized and
// destroyed; pairs/s, device synchronizes, peak reserved, blocks overwritten.
std::size_t stream_churn_steps(const BenchConfig& config);
void run_stream_churn(const BenchConfig& config, Progress& progress,
                      std::vector<Measurement>& results);

}  // namespace vram::bench
