// `vram replay`: argument handling, the tables (stdout; stderr with --json -) and the --json
// output.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "commands.hpp"
#include "replay/memory_svg.hpp"
#include "replay/replay_cli.hpp"
#include "vram/cuda/device.hpp"

namespace vram::replay {
namespace {

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buffer[8];
      std::snprintf(buffer, sizeof buffer, "\\u%04x", c);
      out += buffer;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  char buffer[40];
  std::snprintf(buffer, sizeof buffer, "%.6g", value);
  return buffer;
}

template <typename T>
std::string json_optional(const std::optional<T>& value) {
  return value ? std::to_string(*value) : "null";
}

std::string json_optional(const std::optional<double>& value) {
  return value ? json_number(*value) : "null";
}

template <typename T, typename Format>
std::string json_list(const std::vector<T>& values, Format format) {
  std::string list;
  for (const T& v : values) list += (list.empty() ? "" : ", ") + format(v);
  return "[" + list + "]";
}

}  // namespace

TraceSummary TraceSummary::of(const Trace& trace) {
  TraceSummary s;
  s.name = trace.name;
  s.path = trace.path;
  s.events = trace.events.size();
  s.allocations = trace.slots;
  s.streams = trace.streams.size();
  s.peak_live_bytes = trace.peak_live_bytes;
  s.allocate_failures = trace.allocate_failures;
  s.unknown_frees = trace.unknown_frees;
  s.reused_live_pointers = trace.reused_live_pointers;
  s.free_size_mismatches = trace.free_size_mismatches;
  s.live_at_end = trace.live_at_end;
  return s;
}

std::string human_bytes(std::size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char buffer[32];
  if (unit == 0) {
    std::snprintf(buffer, sizeof buffer, "%zu B", bytes);
  } else {
    std::snprintf(buffer, sizeof buffer, "%.2f %s", value, units[unit]);
  }
  return buffer;
}

std::string to_json(const ReplayReport& report) {
  std::string out = "{\n  \"tool\": \"vram replay\",\n";
  out += "  \"mode\": " + json_string(report.device ? "device" : "host-only") + ",\n";
  out += "  \"device\": " + json_string(report.device_name) + ",\n";
  out += "  \"stream_lag_events\": " + std::to_string(report.stream_lag) + ",\n";
  out += "  \"runs_per_allocator\": " + std::to_string(report.runs_per_allocator) + ",\n";
  out += "  \"passes_per_run\": " + std::to_string(report.passes_per_run) + ",\n";
  out += "  \"traces\": [";
  for (std::size_t i = 0; i < report.traces.size(); ++i) {
    const TraceSummary& t = report.traces[i];
    out += i == 0 ? "\n" : ",\n";
    out += "    {\"trace\": " + json_string(t.name) + ", \"path\": " + json_string(t.path) +
           ", \"events\": " + std::to_string(t.events) +
           ", \"allocations\": " + std::to_string(t.allocations) +
           ", \"streams\": " + std::to_string(t.streams) +
           ", \"peak_live_bytes\": " + std::to_string(t.peak_live_bytes) +
           ", \"allocate_failures_in_trace\": " + std::to_string(t.allocate_failures) +
           ", \"unknown_frees\": " + std::to_string(t.unknown_frees) +
           ", \"reused_live_pointers\": " + std::to_string(t.reused_live_pointers) +
           ", \"free_size_mismatches\": " + std::to_string(t.free_size_mismatches) +
           ", \"live_at_end\": " + std::to_string(t.live_at_end) + "}";
  }
  out += report.traces.empty() ? "],\n" : "\n  ],\n";
  out += "  \"records\": [";
  for (std::size_t i = 0; i < report.runs.size(); ++i) {
    const AllocatorRun& run = report.runs[i];
    const ReplayResult& r = run.result;
    out += i == 0 ? "\n" : ",\n";
    out += "    {\"trace\": " + json_string(r.trace) +
           ", \"allocator\": " + json_string(r.allocator) +
           ", \"operations\": " + std::to_string(r.operations) +
           ", \"ns_per_op\": " + json_number(r.ns_per_op) + ", \"ns_per_op_runs\": [" +
           [&] {
             std::string list;
             for (double v : run.runs_ns_per_op)
               list += (list.empty() ? "" : ", ") + json_number(v);
             return list;
           }() +
           "]" + ", \"peak_live_bytes\": " + std::to_string(r.peak_live_bytes) +
           ", \"peak_reserved_bytes\": " + std::to_string(r.peak_reserved_bytes) +
           ", \"reserved_over_live\": " + json_number(r.reserved_over_live()) +
           ", \"upstream_allocations\": " + json_optional(r.upstream_allocations) +
           ", \"failed_at\": " + json_optional(r.failed_at) +
           ", \"failed_line\": " + (r.failed_at ? std::to_string(r.failed_line) : "null") +
           ", \"failure\": " + (r.failed_at ? json_string(r.failure) : "null") +
           ", \"held_back_frees\": " + std::to_string(r.held_back_frees) +
           ", \"device_synchronizes\": " + json_optional(r.device_synchronizes) +
           ", \"min_capacity_bytes\": " + json_optional(run.min_capacity_bytes) +
           ", \"min_capacity_method\": " +
           (run.capacity_method.empty() ? "null" : json_string(run.capacity_method));
    // Added with --passes (after the older fields, in every record).
    out += ", \"failed_pass\": " + json_optional(r.failed_pass) +
           ", \"warm_ns_per_op\": " + json_optional(r.warm_ns_per_op) +
           ", \"warm_ns_per_op_runs\": " +
           json_list(run.runs_warm_ns_per_op, [](double v) { return json_number(v); }) +
           ", \"warm_upstream_allocations\": " + json_optional(r.warm_upstream_allocations) +
           ", \"pass_ns_per_op\": " +
           json_list(r.pass_ns_per_op, [](double v) { return json_number(v); }) +
           ", \"pass_operations\": " +
           json_list(r.pass_operations, [](std::size_t v) { return std::to_string(v); }) +
           ", \"pass_upstream_allocations\": " +
           json_list(r.pass_upstream_allocations,
                     [](const std::optional<std::uint64_t>& v) { return json_optional(v); }) +
           "}";
  }
  out += report.runs.empty() ? "],\n" : "\n  ],\n";
  out += "  \"skipped\": [";
  for (std::size_t i = 0; i < report.skipped.size(); ++i) {
    out += i == 0 ? "\n" : ",\n";
    out += "    {\"allocator\": " + json_string(report.skipped[i].allocator) +
           ", \"reason\": " + json_string(report.skipped[i].reason) + "}";
  }
  out += report.skipped.empty() ? "]\n}\n" : "\n  ]\n}\n";
  return out;
}

}  // namespace vram::replay

namespace vram::cli {
namespace {

using namespace vram::replay;

void print_replay_usage(std::FILE* out) {
  std::fprintf(
      out,
      "usage: vram replay TRACE... [--json FILE] [--svg FILE] [--host-only] [--capacity-search]\n"
      "                   [--device N] [--stream-lag N] [--runs N] [--passes N]\n"
      "  (a value may follow as the next argument or after '=': --runs=3; TRACE '-' reads\n"
      "  standard input)\n"
      "  Replays allocation traces (RMM logging_resource_adaptor CSV, or .csv.gz) through\n"
      "  vram DevicePool and the peers (cudaMallocAsync on a private pool, CUB, cudaMalloc,\n"
      "  PyTorch's caching allocator when built with VRAM_WITH_TORCH) and reports per trace\n"
      "  and allocator: operations, ns/op, peak live and peak reserved bytes, their ratio,\n"
      "  upstream (driver) allocations and the row of a failing event.\n"
      "  --host-only        replay over host memory (an emulated device); peers that need\n"
      "                     a GPU are listed as skipped\n"
      "  --capacity-search  the smallest device capacity each allocator survives the trace\n"
      "                     with (host-only: binary search over the emulated capacity;\n"
      "                     device: the peak reserved bytes, no search)\n"
      "  --runs N           replay each trace N times per allocator (1 to 100, default 1),\n"
      "                     rotating which allocator goes first; ns/op is the median run\n"
      "  --passes N         replay the trace N times back to back on one allocator instance\n"
      "                     (1 to 1000, default 1); each pass frees what the trace left\n"
      "                     live (operations of the pass; ops counts every pass). ns/op\n"
      "                     stays pass 1 (cold); N >= 2 adds 'warm ns/op' (median of\n"
      "                     passes 2..N) and 'warm upstream' (upstream allocations of\n"
      "                     passes 2..N) and a by-pass line (of the first run, or the\n"
      "                     failing one). Peak reserved and upstream are over all passes;\n"
      "                     --capacity-search replays one pass per probe\n"
      "  --device N         the CUDA device ordinal to replay on (default 0); one that is\n"
      "                     not visible is an error (with no usable device, 0 replays\n"
      "                     host-only)\n"
      "  --stream-lag N     host-only: a free's stream work completes N events later\n"
      "                     (0 to 1000000000, default 8); matters only for stream-unaware\n"
      "                     allocators on multi-stream traces\n"
      "  --json FILE        one record per trace and allocator, written after the whole\n"
      "                     run succeeded ('-': to stdout, the tables then go to stderr);\n"
      "                     FILE may not be one of the traces (with TRACE '-', the file\n"
      "                     on standard input), the --svg file, a directory, a device\n"
      "                     or a FIFO\n"
      "  --svg FILE         the memory picture: reserved bytes of each allocator and the\n"
      "                     trace's live bytes over its events, one panel per trace (from\n"
      "                     one more untimed pass each); same rules as --json\n"
      "  Exit status: 0 replayed (an allocator failing is a result), 2 bad input or usage.\n");
}

constexpr const char* kCommand = "vram replay";
// At or past a trace's event count a held-back free completes only when the pass ends (or
// an allocation fails), so 10^9 events loses nothing and keeps index + lag from wrapping.
constexpr std::size_t kMaxStreamLag = 1000000000;

// A count option's value (decimal or 0x-hex) within [low, high]; false (printed) otherwise.
bool parse_count(const std::string& flag, const std::string& text, std::size_t low,
                 std::size_t high, std::size_t& value) {
  std::uint64_t parsed = 0;
  if (!parse_number(text, parsed) || parsed < low || parsed > high) {
    std::fprintf(stderr, "%s: %s needs a whole number from %zu to %zu, got '%s'\n", kCommand,
                 flag.c_str(), low, high, printable(text).c_str());
    return false;
  }
  value = static_cast<std::size_t>(parsed);
  return true;
}

void print_trace_header(std::FILE* out, const Trace& trace, std::size_t passes) {
  std::fprintf(out, "\ntrace %s (%s): %zu events, %zu allocations, %zu stream%s, peak live %s\n",
               trace.name.c_str(), trace.path.c_str(), trace.events.size(), trace.slots,
               trace.streams.size(), trace.streams.size() == 1 ? "" : "s",
               human_bytes(trace.peak_live_bytes).c_str());
  if (trace.allocate_failures > 0) {
    std::fprintf(out, "  %zu 'allocate failure' rows in the trace (not replayed)\n",
                 trace.allocate_failures);
  }
  if (trace.unknown_frees > 0) {
    std::fprintf(out, "  %zu frees of unknown pointers skipped; first:\n", trace.unknown_frees);
    for (const auto& example : trace.unknown_free_examples) {
      std::fprintf(out, "    %s\n", example.c_str());
    }
  }
  if (trace.reused_live_pointers > 0) {
    std::fprintf(out, "  %zu pointers allocated again while live; first:\n",
                 trace.reused_live_pointers);
    for (const auto& example : trace.reused_live_examples) {
      std::fprintf(out, "    %s\n", example.c_str());
    }
  }
  if (trace.free_size_mismatches > 0) {
    std::fprintf(out,
                 "  %zu frees with a size other than the allocation's (replayed with the "
                 "allocation's size)\n",
                 trace.free_size_mismatches);
  }
  std::fprintf(out, "  %-38s %10s %9s %13s %8s %10s %10s %13s", "allocator", "ops", "ns/op",
               "peak reserved", "res/live", "upstream", "failed_at", "min capacity");
  if (passes >= 2) std::fprintf(out, " %10s %13s", "warm ns/op", "warm upstream");
  std::fprintf(out, "\n");
}

void print_run(std::FILE* out, const AllocatorRun& run, std::size_t passes) {
  const ReplayResult& r = run.result;
  const std::string upstream =
      r.upstream_allocations ? std::to_string(*r.upstream_allocations) : "n/a";
  const std::string failed = r.failed_at ? std::to_string(*r.failed_at) : "-";
  const std::string capacity = run.min_capacity_bytes
                                   ? human_bytes(*run.min_capacity_bytes)
                                   : (run.capacity_method.empty() ? "-" : "none found");
  std::fprintf(out, "  %-38s %10zu %9.1f %13s %7.2fx %10s %10s %13s", r.allocator.c_str(),
               r.operations, r.ns_per_op, human_bytes(r.peak_reserved_bytes).c_str(),
               r.reserved_over_live(), upstream.c_str(), failed.c_str(), capacity.c_str());
  if (passes >= 2) {
    char warm[32] = "-";
    if (r.warm_ns_per_op) std::snprintf(warm, sizeof warm, "%.1f", *r.warm_ns_per_op);
    const std::string warm_upstream = r.warm_upstream_allocations
                                          ? std::to_string(*r.warm_upstream_allocations)
                                          : (r.warm_ns_per_op ? "n/a" : "-");
    std::fprintf(out, " %10s %13s", warm, warm_upstream.c_str());
  }
  std::fprintf(out, "\n");
  if (run.runs_ns_per_op.size() > 1) {
    const auto [low, high] =
        std::minmax_element(run.runs_ns_per_op.begin(), run.runs_ns_per_op.end());
    std::fprintf(out, "    ns/op median of %zu runs; range %.1f .. %.1f\n",
                 run.runs_ns_per_op.size(), *low, *high);
  }
  if (run.runs_warm_ns_per_op.size() > 1) {
    const auto [low, high] =
        std::minmax_element(run.runs_warm_ns_per_op.begin(), run.runs_warm_ns_per_op.end());
    std::fprintf(out, "    warm ns/op median of %zu runs; range %.1f .. %.1f\n",
                 run.runs_warm_ns_per_op.size(), *low, *high);
  }
  if (passes >= 2) {
    std::string ns;
    std::string up;
    std::string ops;
    // Past 12 passes the first 6 and the last 5 (the JSON has every pass).
    const std::size_t count = r.pass_ns_per_op.size();
    for (std::size_t p = 0; p < count; ++p) {
      if (count > 12 && p >= 6 && p + 5 < count) {
        if (p == 6) {
          ns += ", ...";
          up += ", ...";
          ops += ", ...";
        }
        continue;
      }
      char buffer[32];
      std::snprintf(buffer, sizeof buffer, "%.1f", r.pass_ns_per_op[p]);
      if (p > 0) {
        ns += ", ";
        up += ", ";
        ops += ", ";
      }
      ns += buffer;
      const auto& delta = r.pass_upstream_allocations[p];
      up += delta ? std::to_string(*delta) : std::string("n/a");
      ops += std::to_string(r.pass_operations[p]);
    }
    std::fprintf(out, "    by pass (%zu): ns/op %s; upstream %s; ops %s\n", count, ns.c_str(),
                 up.c_str(), ops.c_str());
  }
  if (r.failed_at) {
    if (passes >= 2) {
      std::fprintf(out, "    failed at row %zu (line %zu) in pass %zu: %s\n", *r.failed_at,
                   r.failed_line, r.failed_pass.value_or(1), r.failure.c_str());
    } else {
      std::fprintf(out, "    failed at row %zu (line %zu): %s\n", *r.failed_at, r.failed_line,
                   r.failure.c_str());
    }
  }
  if (r.device_synchronizes.value_or(0) > 0) {
    std::fprintf(out, "    %llu device synchronizes (the pool's quiesces)\n",
                 static_cast<unsigned long long>(*r.device_synchronizes));
  }
  if (r.held_back_frees > 0) {
    std::fprintf(out,
                 "    %zu frees held back until their stream's work completed (the replay "
                 "does it for an allocator that does not order frees by stream itself)\n",
                 r.held_back_frees);
  }
}

}  // namespace

int run_replay(const std::vector<std::string>& args) {
  std::vector<std::string> paths;
  OutputFile json{"--json", {}, {}};
  OutputFile svg{"--svg", {}, {}};
  bool host_only = false;
  bool capacity_search = false;
  bool device_given = false;
  std::size_t runs = 1;
  std::size_t passes = 1;
  ReplayOptions options;
  for (std::size_t i = 0; i < args.size(); ++i) {
    CommandArgument arg;
    if (!next_argument(kCommand, args, i,
                       {"--json", "--svg", "--device", "--stream-lag", "--runs", "--passes"},
                       {"--help", "--host-only", "--capacity-search"}, arg)) {
      return 2;
    }
    if (arg.name == "--help" || arg.name == "-h") {
      print_replay_usage(stdout);
      return 0;
    } else if (arg.positional) {
      paths.push_back(arg.name);
    } else if (!arg.known) {
      std::fprintf(stderr, "vram replay: unknown option '%s'\n", printable(arg.name).c_str());
      print_replay_usage(stderr);
      return 2;
    } else if (arg.name == "--host-only") {
      host_only = true;
    } else if (arg.name == "--capacity-search") {
      capacity_search = true;
    } else if (arg.name == "--json") {
      if (!set_output_path(kCommand, json, arg.value)) return 2;
    } else if (arg.name == "--svg") {
      if (!set_output_path(kCommand, svg, arg.value)) return 2;
    } else if (arg.name == "--device") {
      if (!parse_device_ordinal(kCommand, arg.value, options.device_id)) return 2;
      device_given = true;
    } else if (arg.name == "--stream-lag") {
      if (!parse_count(arg.name, arg.value, 0, kMaxStreamLag, options.stream_lag)) return 2;
    } else if (arg.name == "--runs") {
      if (!parse_count(arg.name, arg.value, 1, 100, runs)) return 2;
    } else if (arg.name == "--passes") {
      if (!parse_count(arg.name, arg.value, 1, 1000, passes)) return 2;
    }
  }
  if (paths.empty()) {
    std::fprintf(stderr, "vram replay: no trace given\n");
    print_replay_usage(stderr);
    return 2;
  }
  // Everything that can refuse the run is checked before a trace is read.
  if (json.path == "-" && svg.path == "-") {
    std::fprintf(stderr, "vram replay: --json - and --svg - both want stdout; name a file\n");
    return 2;
  }
  if (!outputs_spare_traces(kCommand, {&json, &svg}, paths, "")) return 2;
  for (const OutputFile* output : {&json, &svg}) {
    if (!can_create(kCommand, *output)) return 2;
  }
  if (!distinct_outputs(kCommand, {&json, &svg})) return 2;
  // A --device ordinal must be visible (as `vram bench --device` wants it; --host-only with
  // device 0, the default, names no device); without --device, no usable device means a
  // host-only replay.
  const auto availability = cuda::Device::availability();
  if (device_given && !(host_only && options.device_id == 0) &&
      !device_is_visible(kCommand, options.device_id, availability.count)) {
    if (availability.count == 0) {
      std::fprintf(stderr, "%s: Fix: drop --device to replay host-only (or add --host-only)\n",
                   kCommand);
    }
    return 2;
  }
  // With the JSON or the picture on stdout, everything meant for a person goes to stderr.
  std::FILE* const human = json.path == "-" || svg.path == "-" ? stderr : stdout;

  std::vector<Trace> traces;
  try {
    for (const auto& path : paths) traces.push_back(read_trace(path));
  } catch (const TraceError& error) {
    std::fprintf(stderr, "vram replay: %s\n", error.what());
    return 2;
  }

  ReplayReport report;
  report.stream_lag = options.stream_lag;
  report.runs_per_allocator = runs;
  report.passes_per_run = passes;
  options.passes = passes;
  options.device = !host_only && availability.count > 0;
  report.device = options.device;
  if (options.device) {
    report.device_name = cuda::Device::properties(options.device_id).name;
    std::fprintf(human, "vram replay on %s (device %d)\n", report.device_name.c_str(),
                 options.device_id);
  } else {
    report.device_name = "host-only (emulated device)";
    std::fprintf(human,
                 "vram replay: host-only (%s): pool logic over host memory, emulated device; "
                 "ns/op are host figures, not device ones\n",
                 host_only ? "--host-only" : availability.reason.c_str());
  }
  std::vector<AllocatorSpec> specs;
  for (auto& spec : all_replay_allocators()) {
    if (!options.device && spec.needs_gpu) {
      report.skipped.push_back({spec.name, "needs a GPU (host-only replay)"});
      continue;
    }
    specs.push_back(std::move(spec));
  }
  for (const auto& skipped : report.skipped) {
    std::fprintf(human, "  skipped: %s (%s)\n", skipped.allocator.c_str(), skipped.reason.c_str());
  }

  for (const Trace& trace : traces) {
    report.traces.push_back(TraceSummary::of(trace));
    print_trace_header(human, trace, passes);
    // Every allocator replays the trace `runs` times, a fresh instance each time; round k
    // starts with allocator k (mod their count), so none always runs first (cold driver)
    // or last. The memory figures are the same in every run; ns/op is the median run's.
    std::vector<AllocatorRun> of_trace(specs.size());
    std::vector<bool> broken(specs.size(), false);
    for (std::size_t round = 0; round < runs; ++round) {
      for (std::size_t k = 0; k < specs.size(); ++k) {
        const std::size_t which = (round + k) % specs.size();
        if (broken[which]) continue;
        try {
          ReplayResult result = replay_trace(trace, specs[which], options);
          of_trace[which].runs_ns_per_op.push_back(result.ns_per_op);
          if (result.warm_ns_per_op) {
            of_trace[which].runs_warm_ns_per_op.push_back(*result.warm_ns_per_op);
          }
          if (round == 0 || result.failed_at) of_trace[which].result = std::move(result);
        } catch (const std::exception& error) {
          // Setting up the allocator failed (not an allocation of the trace): no record.
          std::fprintf(human, "  %-38s error: %s\n", specs[which].name.c_str(), error.what());
          report.skipped.push_back(
              {specs[which].name, "trace " + trace.name + ": " + error.what()});
          broken[which] = true;
        }
      }
    }
    for (std::size_t which = 0; which < specs.size(); ++which) {
      if (broken[which]) continue;
      AllocatorRun& run = of_trace[which];
      std::vector<double> sorted = run.runs_ns_per_op;
      std::sort(sorted.begin(), sorted.end());
      run.result.ns_per_op = sorted[sorted.size() / 2];
      // The median of the runs' warm figures, only onto a kept result that has one of its
      // own (a run that failed before pass 2 keeps none).
      if (!run.runs_warm_ns_per_op.empty() && run.result.warm_ns_per_op) {
        std::vector<double> warm = run.runs_warm_ns_per_op;
        std::sort(warm.begin(), warm.end());
        run.result.warm_ns_per_op = warm[warm.size() / 2];
      }
      if (capacity_search) {
        if (options.device) {
          run.capacity_method = "device: peak reserved bytes (no search on a real device)";
          run.min_capacity_bytes = run.result.peak_reserved_bytes;
        } else {
          run.capacity_method = "binary search over the emulated capacity (host-only)";
          run.min_capacity_bytes =
              min_capacity(trace, specs[which], options, run.result.peak_reserved_bytes);
        }
      }
      print_run(human, run, passes);
      report.runs.push_back(std::move(run));
    }
  }

  if (!svg.path.empty()) {
    // The picture comes from one more pass of each allocator that replayed the trace, with
    // samples and untimed (the figures above stay those of the timed runs).
    std::vector<TracePicture> pictures;
    ReplayOptions sampled = options;
    sampled.passes = 1;
    sampled.samples = 400;
    for (const Trace& trace : traces) {
      TracePicture& picture = pictures.emplace_back();
      picture.trace = trace.name;
      picture.events = trace.events.size();
      for (const auto& spec : specs) {
        const bool skipped = std::any_of(report.skipped.begin(), report.skipped.end(),
                                         [&](const auto& s) { return s.allocator == spec.name; });
        if (skipped) continue;
        try {
          picture.series.push_back({spec.name, replay_trace(trace, spec, sampled).samples});
        } catch (const std::exception& error) {
          std::fprintf(human, "  picture: %s left out: %s\n", spec.name.c_str(), error.what());
        }
      }
    }
    svg.content = memory_svg(pictures);
  }
  std::vector<OutputFile> outputs;
  if (!json.path.empty()) {
    json.content = to_json(report);
    outputs.push_back(json);
  }
  if (!svg.path.empty()) outputs.push_back(svg);
  if (!outputs.empty() && !write_outputs(kCommand, outputs, human)) return 1;
  return 0;
}

}  // namespace vram::cli
