#include "bench/replay_scenario.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <thread>

#include "replay/replay.hpp"
#include "replay/replay_allocator.hpp"
#include "replay/trace.hpp"
#include "vram/cuda/stream.hpp"

namespace vram::bench {
namespace {

std::vector<replay::AllocatorSpec> replay_specs(const BenchConfig& config) {
  std::vector<replay::AllocatorSpec> specs;
  for (auto& spec : replay::all_replay_allocators()) {
    if (config.gpu || !spec.needs_gpu) specs.push_back(std::move(spec));
  }
  return specs;
}

}  // namespace

// $VRAM_TRACE_DIR, else bench/traces under the working directory, else under the source
// tree the binary was built from.
std::vector<std::string> replay_trace_paths() {
  namespace fs = std::filesystem;
  std::vector<fs::path> dirs;
  if (const char* env = std::getenv("VRAM_TRACE_DIR"); env != nullptr && *env != '\0') {
    dirs.emplace_back(env);
  } else {
    dirs.emplace_back("bench/traces");
#ifdef VRAM_SOURCE_DIR
    dirs.emplace_back(fs::path(VRAM_SOURCE_DIR) / "bench" / "traces");
#endif
  }
  for (const auto& dir : dirs) {
    std::error_code error;
    if (!fs::is_directory(dir, error)) continue;
    std::vector<std::string> paths;
    for (const auto& entry : fs::directory_iterator(dir, error)) {
      const std::string name = entry.path().filename().string();
      if (name.size() > 7 && name.compare(name.size() - 7, 7, ".csv.gz") == 0) {
        paths.push_back(entry.path().string());
      }
    }
    std::sort(paths.begin(), paths.end());
    if (!paths.empty()) return paths;
  }
  return {};
}

std::size_t replay_steps(const BenchConfig& config) {
  return replay_trace_paths().size() * replay_specs(config).size();
}

void run_replay(const BenchConfig& config, Progress& progress, std::vector<Measurement>& results) {
  const auto paths = replay_trace_paths();
  if (paths.empty()) {
    const char* env = std::getenv("VRAM_TRACE_DIR");
    if (env != nullptr && *env != '\0') {
      std::printf(
          "vram bench: scenario 'replay' skipped: VRAM_TRACE_DIR=%s holds no *.csv.gz trace "
          "(or is no directory). Fix: point it at bench/traces of the source tree, or unset "
          "it\n",
          replay::printable(env).c_str());
    } else {
      std::printf(
          "vram bench: scenario 'replay' skipped: no bench/traces/*.csv.gz under the working "
          "directory or the source tree. Fix: run from the repository root, or set "
          "VRAM_TRACE_DIR\n");
    }
    return;
  }
  const auto specs = replay_specs(config);
  if (!config.gpu) {
    std::printf("vram bench: scenario 'replay' host-only: peers that need a GPU skipped\n");
  }
  replay::ReplayOptions options;
  options.device = config.gpu;
  options.device_id = config.device;
  const std::size_t repetitions = config.quick ? 1 : 3;
  for (std::size_t t = 0; t < paths.size(); ++t) {
    replay::Trace trace;
    try {
      trace = replay::read_trace(paths[t]);
    } catch (const replay::TraceError& error) {
      std::printf("vram bench: scenario 'replay' skips a trace: %s\n", error.what());
      continue;
    }
    for (const auto& spec : specs) {
      progress.step("replay " + trace.name + " " + spec.name);
      std::vector<double> samples;
      replay::ReplayResult last;
      for (std::size_t r = 0; r < repetitions; ++r) {
        last = replay::replay_trace(trace, spec, options);
        samples.push_back(last.ns_per_op);
      }
      Measurement m = make_measurement("replay", trace.name, static_cast<double>(t), spec.name,
                                       spec.name.rfind("vram", 0) == 0, "ns/op", true, samples);
      m.extra["operations"] = static_cast<double>(last.operations);
      m.extra["peak_live_mib"] = static_cast<double>(last.peak_live_bytes) / (1 << 20);
      m.extra["peak_reserved_mib"] = static_cast<double>(last.peak_reserved_bytes) / (1 << 20);
      m.extra["reserved_over_live"] = last.reserved_over_live();
      if (last.upstream_allocations) {
        m.extra["upstream_allocations"] = static_cast<double>(*last.upstream_allocations);
      }
      if (last.failed_at) m.extra["failed_at"] = static_cast<double>(*last.failed_at);
      results.push_back(m);
    }
  }
}

std::vector<unsigned> batched_thread_counts() { return {1, 2, 4, 8, 16}; }

namespace {

// The largest block of each range, as a power of two (the smallest is 2^8 = 256 B).
constexpr int kBatchedMaxExponents[] = {20, 22, 24, 26};
constexpr std::size_t kBatchedGpuAllocators = 4;  // make_batched_allocators

}  // namespace

std::size_t batched_steps(const BenchConfig& config, std::size_t host_allocators) {
  return std::size(kBatchedMaxExponents) * batched_thread_counts().size() *
         (config.gpu ? kBatchedGpuAllocators : host_allocators);
}

void run_batched(const BenchConfig& config,
                 std::vector<std::unique_ptr<BenchAllocator>>& allocators, Progress& progress,
                 std::vector<Measurement>& results, bool fresh) {
  const std::string scenario = fresh ? "batched" : "batched-repeated";
  constexpr std::size_t kLive = 32;
  const double seconds = config.quick ? 0.05 : 0.3;
  const std::size_t repetitions = config.quick ? 3 : 5;
  std::vector<std::unique_ptr<BenchAllocator>> own;
  if (config.gpu) own = make_batched_allocators(config.device);
  auto& measured = config.gpu ? own : allocators;
  const unsigned most = batched_thread_counts().back();
  std::vector<std::unique_ptr<cuda::Stream>> streams;
  for (unsigned t = 0; t < most && config.gpu; ++t) {
    streams.push_back(std::make_unique<cuda::Stream>());
  }
  for (const int max_exponent : kBatchedMaxExponents) {
    // Per thread: one plan repeated, or kFreshBatches plans gone through in turn.
    std::vector<std::vector<BatchedPlan>> plans;
    for (unsigned t = 0; t < most; ++t) {
      plans.push_back(fresh ? batched_fresh_plans(t, max_exponent, kLive)
                            : std::vector<BatchedPlan>{batched_plan(t, max_exponent, kLive)});
    }
    const std::string range = "to " + format_bytes(std::size_t{1} << max_exponent);
    std::vector<double> one_thread(measured.size(), 0.0);
    for (unsigned threads : batched_thread_counts()) {
      for (std::size_t k = 0; k < measured.size(); ++k) {
        auto& a = measured[k];
        progress.step(scenario + " " + range + " " + std::to_string(threads) + " " + a->name());
        if (a->ours()) a->reset_peak();  // the cell's own peak
        const double synchronizes_before = a->device_synchronizes();
        const std::map<std::string, double> counters_before = a->counters();
        const auto samples = threaded_pair_rates(
            threads, repetitions, seconds, [&](unsigned t, const std::atomic<bool>& stop) {
              cudaStream_t s = config.gpu ? streams[t]->get() : nullptr;
              const std::vector<BatchedPlan>& mine = plans[t];
              std::size_t next = 0;
              void* blocks[kLive];
              std::uint64_t pairs = 0;
              while (!stop.load(std::memory_order_relaxed)) {
                const BatchedPlan& plan = mine[next];
                next = next + 1 == mine.size() ? 0 : next + 1;
                for (std::size_t i = 0; i < kLive; ++i) blocks[i] = a->allocate(plan.sizes[i], s);
                for (std::size_t i : plan.free_order) a->deallocate(blocks[i], plan.sizes[i], s);
                pairs += kLive;
              }
              a->finish(s);
              return pairs;
            });
        Measurement m =
            make_measurement(scenario, range + ", " + std::to_string(threads) + " threads", threads,
                             a->name(), a->ours(), "M pairs/s", false, samples);
        m.extra["live_blocks_per_thread"] = kLive;
        m.extra["size_sets_per_thread"] = static_cast<double>(plans[0].size());
        // The pool's device-wide synchronizes over the warm-up and every repetition (-1: the
        // allocator does not count them).
        if (synchronizes_before >= 0) {
          m.extra["device_synchronizes"] = a->device_synchronizes() - synchronizes_before;
        }
        for (const auto& [name, value] : a->counters()) {
          m.extra[name] = value - counters_before.at(name);
        }
        if (a->ours()) {  // over the warm-up and every repetition
          m.extra["peak_reserved_mib"] = static_cast<double>(a->peak_reserved_bytes()) / (1 << 20);
        }
        if (threads == 1) one_thread[k] = m.value.median;
        if (one_thread[k] > 0) m.extra["x_1_thread"] = m.value.median / one_thread[k];
        results.push_back(m);
        a->release_cache();
      }
    }
  }
}

}  // namespace vram::bench
