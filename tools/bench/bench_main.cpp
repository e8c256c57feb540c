// `vram bench`: argument handling, environment capture and output files.
#include <cuda_runtime_api.h>
#include <algorithm>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

#include "bench/report.hpp"
#include "bench/scenarios.hpp"
#include "commands.hpp"
#include "vram/cuda/device.hpp"
#include "vram_git_commit.hpp"

namespace vram::cli {
namespace {

void print_bench_usage(std::FILE* out) {
  std::fprintf(out,
               "usage: vram bench [--quick] [--scenario NAME[,NAME...]]... [--json FILE] "
               "[--svg FILE] [--markdown FILE] [--host-only] [--device N]\n"
               "  scenarios: pairs (warm alloc+free by size), threads (1..16 threads, a stream "
               "each),\n"
               "             mixed (random 70/30 workload, peak reserved), overhead "
               "(StreamOrderedPool\n"
               "             vs raw cudaMallocAsync, interleaved), pagein (staging pool vs "
               "pinning per\n"
               "             page-in vs pageable), pinning (fast pin path vs cudaHostAlloc)\n"
               "  --quick      a short run (under 30 s on an H200)\n"
               "  --host-only  run the host-memory scenarios even when a GPU is visible\n");
}

bool can_write(const std::string& path, const char* flag) {
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) {
    std::fprintf(stderr, "vram bench: cannot write %s file '%s': %s\n", flag, path.c_str(),
                 std::strerror(errno));
    return false;
  }
  std::fclose(file);
  return true;
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
  std::string json_path;
  std::string svg_path;
  std::string markdown_path;
  std::string command = "vram bench";
  for (const auto& arg : args) command += " " + arg;
  bool host_only = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    auto value = [&](const char* flag) -> const std::string* {
      if (i + 1 >= args.size()) {
        std::fprintf(stderr, "vram bench: %s needs a value\n", flag);
        return nullptr;
      }
      return &args[++i];
    };
    if (arg == "--help" || arg == "-h") {
      print_bench_usage(stdout);
      return 0;
    } else if (arg == "--quick") {
      config.quick = true;
    } else if (arg == "--host-only") {
      host_only = true;
    } else if (arg == "--json" || arg == "--svg" || arg == "--scenario" || arg == "--device" ||
               arg == "--markdown") {
      const std::string* v = value(arg.c_str());
      if (v == nullptr) return 2;
      if (arg == "--json") json_path = *v;
      if (arg == "--svg") svg_path = *v;
      if (arg == "--markdown") markdown_path = *v;
      if (arg == "--device") config.device = std::atoi(v->c_str());
      if (arg == "--scenario") {
        std::size_t start = 0;
        while (start <= v->size()) {
          const std::size_t comma = v->find(',', start);
          const std::string name =
              v->substr(start, comma == std::string::npos ? std::string::npos : comma - start);
          const auto& known = bench::known_scenarios();
          if (std::find(known.begin(), known.end(), name) == known.end()) {
            std::fprintf(stderr,
                         "vram bench: unknown scenario '%s' (known: pairs, threads, mixed, "
                         "overhead, pagein, pinning)\n",
                         name.c_str());
            return 2;
          }
          config.scenarios.push_back(name);
          if (comma == std::string::npos) break;
          start = comma + 1;
        }
      }
    } else {
      std::fprintf(stderr, "vram bench: unknown option '%s'\n", arg.c_str());
      print_bench_usage(stderr);
      return 2;
    }
  }
  if (config.scenarios.empty()) config.scenarios = bench::default_scenarios();
  if (!json_path.empty() && !can_write(json_path, "--json")) return 2;
  if (!svg_path.empty() && !can_write(svg_path, "--svg")) return 2;
  if (!markdown_path.empty() && !can_write(markdown_path, "--markdown")) return 2;

  bench::Environment env;
  env.quick = config.quick;
  env.date = utc_now();
  env.git_commit = VRAM_GIT_COMMIT;
  int runtime_version = 0;
  (void)cudaRuntimeGetVersion(&runtime_version);
  env.runtime = cuda::Device::version_string(runtime_version);
  const auto availability = cuda::Device::availability();
  config.gpu = !host_only && availability.count > config.device && config.device >= 0;
  if (config.gpu) {
    const auto props = cuda::Device::properties(config.device);
    env.gpu = true;
    env.device_name = props.name;
    env.driver = cuda::Device::version_string(props.driver_version);
    std::printf("vram bench on %s (driver supports CUDA %s, runtime %s), commit %s%s\n",
                props.name.c_str(), env.driver.c_str(), env.runtime.c_str(), env.git_commit.c_str(),
                config.quick ? ", quick" : "");
  } else {
    env.no_gpu_reason = host_only ? "--host-only" : availability.reason;
    if (availability.count > 0 && !host_only) {
      env.no_gpu_reason = "device " + std::to_string(config.device) + " does not exist";
    }
    std::printf(
        "vram bench: no GPU in use (%s); running host-only scenarios: the pools' own "
        "hot-path cost over host memory, not device numbers.\n",
        env.no_gpu_reason.c_str());
    for (const auto& name : config.scenarios) {
      if (bench::scenario_needs_gpu(name)) {
        std::printf("vram bench: scenario '%s' skipped: it needs a GPU\n", name.c_str());
      }
    }
  }
  const auto results = bench::run_scenarios(config);
  const auto verdicts = bench::verdicts(results);
  bench::print_tables(results, verdicts);
  if (!json_path.empty()) {
    std::ofstream(json_path) << bench::to_json(env, results, verdicts);
    std::printf("wrote %s\n", json_path.c_str());
  }
  if (!markdown_path.empty()) {
    std::ofstream(markdown_path) << bench::to_markdown(env, results, verdicts, command);
    std::printf("wrote %s\n", markdown_path.c_str());
  }
  if (!svg_path.empty()) {
    std::ofstream(svg_path) << bench::to_svg(env, results);
    std::printf("wrote %s\n", svg_path.c_str());
  }
  return 0;
}

}  // namespace vram::cli
