// What `vram bench` measured, and how it is shown: tables, verdicts, JSON and SVG.
#pragma once

#include <cstddef>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "bench/harness.hpp"

namespace vram::bench {

struct Measurement {
  std::string scenario;   // pairs, threads, mixed, pagein, pinning
  std::string parameter;  // "64 KiB", "16 threads", ...
  double parameter_value = 0;
  std::string allocator;
  bool ours = false;
  bool reference = false;  // a ceiling (not a peer): shown, left out of verdicts
  std::string unit;        // "ns/pair", "M pairs/s", "GB/s", ...
  bool lower_is_better = true;
  Summary value;
  std::map<std::string, double> extra;  // peak_reserved_mib, pin_calls, ...
};

// The one way the scenarios build a result row: summary of the samples plus its labels.
Measurement make_measurement(const std::string& scenario, const std::string& parameter,
                             double parameter_value, const std::string& allocator, bool ours,
                             const std::string& unit, bool lower_is_better,
                             const std::vector<double>& samples);

struct Environment {
  bool gpu = false;
  std::string device_name = "none";
  std::string driver = "none";
  std::string runtime;
  std::string date;
  std::string git_commit;
  std::string no_gpu_reason;
  bool quick = false;
};

struct Verdict {
  std::string scenario;
  std::string parameter;
  std::string ours;
  double ours_value = 0;
  std::string best_peer;
  double peer_value = 0;
  std::string unit;
  double advantage = 0;  // > 1: ours better by this factor
  // Whether the p10..p90 ranges of the two overlap: then neither is better ("on par").
  bool ranges_overlap = false;
  std::size_t ours_samples = 0;
  std::size_t peer_samples = 0;
};

// "better", "WORSE" or "on par": on par when the p10..p90 ranges overlap or the medians
// are within 0.5% of each other.
const char* verdict_word(const Verdict& v);

std::vector<Verdict> verdicts(const std::vector<Measurement>& results);
// The human-readable tables and verdicts, to `out` (stdout, or stderr when JSON goes to stdout).
void print_tables(std::FILE* out, const std::vector<Measurement>& results,
                  const std::vector<Verdict>& verdicts);
std::string to_json(const Environment& env, const std::vector<Measurement>& results,
                    const std::vector<Verdict>& verdicts);
// Bar chart of the "pairs" scenario: time per pair by allocator and size, log scale.
std::string to_svg(const Environment& env, const std::vector<Measurement>& results);
// The same tables in Markdown, headed by the environment, for bench/RESULTS.md.
std::string to_markdown(const Environment& env, const std::vector<Measurement>& results,
                        const std::vector<Verdict>& verdicts, const std::string& command);
std::string format_bytes(std::size_t bytes);
// A JSON number: integral values (sizes, counts) in full (1048576, never 1.04858e+06),
// others with 6 significant digits; null for NaN and infinities.
std::string json_number(double value);

}  // namespace vram::bench
