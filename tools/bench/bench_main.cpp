// `vram bench`: argument handling, environment capture and output files.
//
// Exit codes: 0 measured and wrote everything; 1 a run-time failure (a CUDA error, an
// output file that could not be written at the end); 2 bad usage (unknown option or
// scenario, bad or missing value, a --device that does not exist, an output path that
// cannot be created); 3 nothing was measured (every scenario asked for needs a GPU and
// none is in use). Output files are written to a temporary file beside the target and
// renamed over it only after the whole run succeeded, so a failed run leaves an existing
// file untouched. `--json -` writes the JSON to stdout; the human-readable tables then go
// to stderr.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

#include "bench/replay_scenario.hpp"
#include "bench/report.hpp"
#include "bench/scenarios.hpp"
#include "commands.hpp"
#include "vram/cuda/device.hpp"
#include "vram_git_commit.hpp"

namespace vram::cli {

// Option handling shared with `vram replay` (declared in commands.hpp).

bool next_argument(const char* command, const std::vector<std::string>& args, std::size_t& i,
                   std::initializer_list<std::string_view> valued,
                   std::initializer_list<std::string_view> flags, CommandArgument& out) {
  out = CommandArgument{};
  const std::string& arg = args[i];
  if (arg.rfind("--", 0) != 0) {
    out.name = arg;
    out.positional = true;
    return true;
  }
  const std::size_t equals = arg.find('=');
  const std::string name = arg.substr(0, equals);
  const auto named = [&](std::initializer_list<std::string_view> names) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  if (named(valued)) {
    out.name = name;
    out.known = true;
    if (equals != std::string::npos) {
      out.value = arg.substr(equals + 1);
    } else if (i + 1 < args.size()) {
      out.value = args[++i];
    } else {
      std::fprintf(stderr, "%s: %s needs a value (%s --help)\n", command, name.c_str(), command);
      return false;
    }
    return true;
  }
  if (named(flags)) {
    if (equals != std::string::npos) {
      std::fprintf(stderr, "%s: %s takes no value\n", command, name.c_str());
      return false;
    }
    out.name = name;
    out.known = true;
    return true;
  }
  out.name = arg;  // unknown: the caller names it
  return true;
}

bool parse_device_ordinal(const char* command, const std::string& text, int& device) {
  bool ok = !text.empty() &&
            std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  int parsed = 0;
  if (ok) {
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), parsed);
    ok = error == std::errc() && end == text.data() + text.size();  // errc: beyond an int
  }
  if (!ok) {
    std::fprintf(stderr,
                 "%s: --device needs a device ordinal (0, 1, ...; see `vram info`), got '%s'\n",
                 command, text.c_str());
    return false;
  }
  device = parsed;
  return true;
}

bool device_is_visible(const char* command, int device, int visible) {
  if (device >= 0 && device < visible) return true;
  if (visible == 0) {
    std::fprintf(stderr,
                 "%s: --device %d does not exist: 0 devices visible; no CUDA device is usable "
                 "(%s)\n",
                 command, device, no_device_explanation().c_str());
  } else {
    std::fprintf(stderr,
                 "%s: --device %d does not exist: %d device(s) visible, ordinals 0..%d (see "
                 "`vram info`)\n",
                 command, device, visible, visible - 1);
  }
  return false;
}

namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
constexpr int kExitNothingMeasured = 3;

void print_bench_usage(std::FILE* out) {
  std::fprintf(
      out,
      "usage: vram bench [options]\n"
      "Measures vram's pools against the allocators you would use instead and prints a\n"
      "table and a verdict per scenario. Without a GPU, runs the host-memory scenarios.\n"
      "\n"
      "options (a value may follow as the next argument or after '=': --json=F):\n"
      "  --quick              a short run (under 30 s on an H200)\n"
      "  --scenario LIST      comma-separated, repeatable; default: all but pager, driver, sleep:\n"
      "                         pairs     warm allocate+free pair by size\n"
      "                         threads   1..16 threads, a stream each\n"
      "                         batched   batches of 32 live blocks per thread, sizes drawn\n"
      "                                   afresh per batch (256 B to 1, 4, 16, 64 MiB), freed\n"
      "                                   out of order, at 1 to 16 threads, plain and\n"
      "                                   stream-ordered\n"
      "                         mixed     random 70/30 allocate/free workload, peak reserved\n"
      "                         overhead  StreamOrderedPool vs raw cudaMallocAsync (GPU)\n"
      "                         pagein    staging pool vs pinning per page-in (GPU)\n"
      "                         pinning   fast pin path vs cudaHostAlloc (GPU)\n"
      "                         replay    bench/traces/*.csv.gz (or $VRAM_TRACE_DIR) through\n"
      "                                   every allocator, as `vram replay`\n"
      "                       and, only when named (about a minute on an H200):\n"
      "                         batched-repeated  batched with one set of sizes per\n"
      "                                   thread, repeated every batch\n"
      "                         stream-churn  a stream created, used (kernels tag and\n"
      "                                   check the blocks) and destroyed per request, 1 to\n"
      "                                   16 threads; device synchronizes, reserved (GPU)\n"
      "                         pager     WeightPager vs all-resident, copy bound, two-slot,\n"
      "                                   synchronous and pin-per-page-in baselines (GPU)\n"
      "                         driver    cudaMalloc/cudaFree and virtual-memory map/unmap\n"
      "                                   by size, 2 MiB to 4 GiB (GPU)\n"
      "                         sleep     DevicePool sleep/wake: 8 GiB of weights in 32\n"
      "                                   blocks, 8 GiB of discardable KV, 10,000 blocks of\n"
      "                                   64 KiB-4 MiB, against the pinned link and, when\n"
      "                                   $VRAM_BENCH_PYTHON (else python3) imports it,\n"
      "                                   torch_memory_saver through its Python package in\n"
      "                                   a child process (GPU)\n"
      "  --device N           the CUDA device ordinal to measure (default 0); a device\n"
      "                       that does not exist is an error\n"
      "  --host-only          run the host-memory scenarios even when a GPU is visible\n"
      "  --json FILE          results as JSON ('-': to stdout, tables then go to stderr)\n"
      "  --svg FILE           bar chart of the pairs scenario\n"
      "  --markdown FILE      the tables in Markdown, as in bench/RESULTS.md\n"
      "  -h, --help           this text\n"
      "Output files are replaced only after the whole run succeeded; each must be a file\n"
      "of its own, new or regular (no directory, device or FIFO), and not a trace the\n"
      "replay scenario reads.\n"
      "exit codes: 0 done; 1 run-time failure; 2 bad usage or unknown device;\n"
      "            3 nothing measured (every scenario asked for was skipped)\n");
}

std::string utc_now() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buffer[32];
  std::strftime(buffer, sizeof buffer, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buffer;
}

}  // namespace

int run_bench(const std::vector<std::string>& args) {
  bench::BenchConfig config;
  OutputFile json{"--json", {}, {}};
  OutputFile svg{"--svg", {}, {}};
  OutputFile markdown{"--markdown", {}, {}};
  std::string command = "vram bench";
  for (const auto& arg : args) command += " " + arg;
  bool host_only = false;
  bool device_given = false;
  constexpr const char* kCommand = "vram bench";
  for (std::size_t i = 0; i < args.size(); ++i) {
    CommandArgument arg;
    if (!next_argument(kCommand, args, i,
                       {"--json", "--svg", "--scenario", "--device", "--markdown"},
                       {"--quick", "--host-only", "--help"}, arg)) {
      return kExitUsage;
    }
    const std::string& option = arg.name;
    const std::string& value = arg.value;
    if (option == "--help" || option == "-h") {
      print_bench_usage(stdout);
      return kExitOk;
    } else if (option == "--quick") {
      config.quick = true;
    } else if (option == "--host-only") {
      host_only = true;
    } else if (option == "--json" || option == "--svg" || option == "--markdown") {
      OutputFile& output = option == "--json" ? json : option == "--svg" ? svg : markdown;
      if (!set_output_path(kCommand, output, value)) return kExitUsage;
    } else if (option == "--device") {
      if (!parse_device_ordinal(kCommand, value, config.device)) return kExitUsage;
      device_given = true;
    } else if (option == "--scenario") {
      std::size_t start = 0;
      for (;;) {
        const std::size_t comma = value.find(',', start);
        const std::string name =
            value.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        const auto& known = bench::known_scenarios();
        if (std::find(known.begin(), known.end(), name) == known.end()) {
          std::string names;
          for (const auto& k : known) names += (names.empty() ? "" : ", ") + k;
          std::fprintf(stderr, "vram bench: unknown scenario '%s' (known: %s)\n", name.c_str(),
                       names.c_str());
          return kExitUsage;
        }
        if (std::find(config.scenarios.begin(), config.scenarios.end(), name) ==
            config.scenarios.end()) {
          config.scenarios.push_back(name);
        }
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    } else {
      std::fprintf(stderr, "vram bench: unknown option '%s'\n", option.c_str());
      print_bench_usage(stderr);
      return kExitUsage;
    }
  }
  if (config.scenarios.empty()) config.scenarios = bench::default_scenarios();
  if (svg.path == "-" || markdown.path == "-") {
    std::fprintf(stderr, "vram bench: only --json can write to stdout ('-')\n");
    return kExitUsage;
  }
  if (device_given && host_only) {
    std::fprintf(stderr, "vram bench: --device and --host-only exclude each other\n");
    return kExitUsage;
  }
  for (const OutputFile* output : {&json, &svg, &markdown}) {
    if (!can_create(kCommand, *output)) return kExitUsage;
  }
  if (!distinct_outputs(kCommand, {&json, &svg, &markdown})) return kExitUsage;
  // The replay scenario reads its traces after the outputs' paths are fixed: none of them
  // may be an output.
  if (std::find(config.scenarios.begin(), config.scenarios.end(), "replay") !=
          config.scenarios.end() &&
      !outputs_spare_traces(kCommand, {&json, &svg, &markdown}, bench::replay_trace_paths(),
                            " that the replay scenario reads")) {
    return kExitUsage;
  }
  // With the JSON on stdout, everything meant for a person goes to stderr.
  std::FILE* human = json.path == "-" ? stderr : stdout;

  bench::Environment env;
  env.quick = config.quick;
  env.date = utc_now();
  env.git_commit = VRAM_GIT_COMMIT;
  int runtime_version = 0;
  (void)cudaRuntimeGetVersion(&runtime_version);
  env.runtime = cuda::Device::version_string(runtime_version);
  const auto availability = cuda::Device::availability();
  // An explicit device that is not there is an error, GPU machine or not.
  if (!host_only && device_given &&
      !device_is_visible(kCommand, config.device, availability.count)) {
    return kExitUsage;
  }
  config.gpu = !host_only && availability.count > 0;
  if (config.gpu) {
    const auto props = cuda::Device::properties(config.device);
    env.gpu = true;
    env.device_name = props.name;
    env.driver = cuda::Device::version_string(props.driver_version);
    std::fprintf(human,
                 "vram bench on device %d, %s (driver supports CUDA %s, runtime %s), commit %s%s\n",
                 config.device, props.name.c_str(), env.driver.c_str(), env.runtime.c_str(),
                 env.git_commit.c_str(), config.quick ? ", quick" : "");
  } else {
    env.no_gpu_reason = host_only ? "--host-only" : no_device_explanation();
    std::fprintf(human,
                 "vram bench: no GPU in use (%s); running host-only scenarios: the pools' own "
                 "hot-path cost over host memory, not device numbers.\n",
                 env.no_gpu_reason.c_str());
    for (const auto& name : config.scenarios) {
      if (bench::scenario_needs_gpu(name)) {
        std::fprintf(human, "vram bench: scenario '%s' skipped: it needs a GPU\n", name.c_str());
      }
    }
  }
  const auto results = bench::run_scenarios(config);
  if (results.empty()) {
    std::fprintf(stderr,
                 "vram bench: nothing was measured: every scenario asked for was skipped (the "
                 "lines above say why: a GPU needed and none in use, or no traces found); no "
                 "output file written (exit %d)\n",
                 kExitNothingMeasured);
    return kExitNothingMeasured;
  }
  const auto verdicts = bench::verdicts(results);
  bench::print_tables(human, results, verdicts);
  if (!json.path.empty()) json.content = bench::to_json(env, results, verdicts);
  if (!markdown.path.empty()) {
    markdown.content = bench::to_markdown(env, results, verdicts, command);
  }
  if (!svg.path.empty()) svg.content = bench::to_svg(env, results);
  std::vector<OutputFile> outputs{std::move(json), std::move(svg), std::move(markdown)};
  return write_outputs(kCommand, outputs, human) ? kExitOk : kExitFailure;
}

}  // namespace vram::cli
