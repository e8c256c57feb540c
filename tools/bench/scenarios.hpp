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
bool scenario_needs_gpu(const std::string& name);
std::vector<Measurement> run_scenarios(const BenchConfig& config);

}  // namespace vram::bench
