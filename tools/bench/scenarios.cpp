#include "bench/scenarios.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <thread>

#include "bench/allocators.hpp"
#include "bench/replay_scenario.hpp"
#include "vram/copy.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/pinned_host_upstream.hpp"
#include "vram/pinned_staging_pool.hpp"
#include "vram/stream_ordered_pool.hpp"
#include "vram/units.hpp"

namespace vram::bench {
namespace {

using namespace vram::literals;
using Allocators = std::vector<std::unique_ptr<BenchAllocator>>;

std::vector<std::size_t> pair_sizes(const BenchConfig& c) {
  if (c.quick) return {256, 64_KiB, 1_MiB, 16_MiB};
  return {256, 4_KiB, 64_KiB, 1_MiB, 16_MiB, 256_MiB};
}
std::vector<unsigned> thread_counts(const BenchConfig&) { return {1, 2, 4, 8, 16}; }

Allocators make_allocators(const BenchConfig& c) {
  return c.gpu ? make_device_allocators(c.device) : make_host_allocators();
}

Measurement make(const std::string& scenario, const std::string& parameter, double value,
                 const std::string& allocator, bool ours, const std::string& unit,
                 bool lower_is_better, const std::vector<double>& samples) {
  return make_measurement(scenario, parameter, value, allocator, ours, unit, lower_is_better,
                          samples);
}

void run_pairs(const BenchConfig& c, Allocators& allocators, Progress& progress,
               std::vector<Measurement>& results) {
  std::unique_ptr<cuda::Stream> stream;
  if (c.gpu) stream = std::make_unique<cuda::Stream>();
  cudaStream_t s = stream ? stream->get() : nullptr;
  const std::size_t repetitions = c.quick ? 7 : 15;
  const double batch_ms = c.quick ? 8 : 20;
  // Warm every allocator on every size first (pool creation, driver first-use costs),
  // so no allocator pays another's start-up inside its timed batches.
  for (auto& a : allocators) {
    for (std::size_t bytes : pair_sizes(c)) {
      for (int i = 0; i < (bytes >= 64_MiB ? 4 : 200); ++i) {
        a->deallocate(a->allocate(bytes, s), bytes, s);
      }
      a->finish(s);
    }
  }
  for (std::size_t bytes : pair_sizes(c)) {
    for (auto& a : allocators) {
      progress.step("pairs " + format_bytes(bytes) + " " + a->name());
      auto samples = time_per_operation(
          [&](std::size_t n) {
            for (std::size_t i = 0; i < n; ++i) {
              void* block = a->allocate(bytes, s);
              a->deallocate(block, bytes, s);
            }
            a->finish(s);
          },
          repetitions, batch_ms);
      results.push_back(make("pairs", format_bytes(bytes), static_cast<double>(bytes), a->name(),
                             a->ours(), "ns/pair", true, samples));
      a->release_cache();
    }
  }
}

void run_threads(const BenchConfig& c, Allocators& allocators, Progress& progress,
                 std::vector<Measurement>& results) {
  const std::size_t bytes = 64_KiB;
  const double seconds = c.quick ? 0.1 : 0.3;
  const std::size_t repetitions = c.quick ? 3 : 5;
  for (unsigned threads : thread_counts(c)) {
    std::vector<std::unique_ptr<cuda::Stream>> streams;
    for (unsigned t = 0; t < threads && c.gpu; ++t) {
      streams.push_back(std::make_unique<cuda::Stream>());
    }
    for (auto& a : allocators) {
      progress.step("threads " + std::to_string(threads) + " " + a->name());
      const auto samples = threaded_pair_rates(
          threads, repetitions, seconds, [&](unsigned t, const std::atomic<bool>& stop) {
            cudaStream_t s = c.gpu ? streams[t]->get() : nullptr;
            std::uint64_t pairs = 0;
            while (!stop.load(std::memory_order_relaxed)) {
              for (int i = 0; i < 64; ++i) {
                void* block = a->allocate(bytes, s);
                a->deallocate(block, bytes, s);
              }
              pairs += 64;
            }
            a->finish(s);
            return pairs;
          });
      results.push_back(make("threads", std::to_string(threads) + " threads", threads, a->name(),
                             a->ours(), "M pairs/s", false, samples));
      a->release_cache();
    }
  }
}

void run_mixed(const BenchConfig& c, Allocators& allocators, Progress& progress,
               std::vector<Measurement>& results) {
  const std::size_t operations = c.quick ? 20000 : 50000;
  const std::size_t max_bytes = c.gpu ? 8_MiB : 4_MiB;
  const std::size_t live_cap = c.gpu ? 4_GiB : 512_MiB;
  struct Operation {
    bool allocate;
    std::size_t bytes;
    std::size_t slot;
  };
  // One seeded sequence for every allocator: 70% allocate / 30% free, uniform sizes,
  // frees of a random live block; an allocation that would pass live_cap frees instead.
  std::vector<Operation> plan;
  std::size_t slots = 0;
  {
    std::mt19937_64 random(42);
    std::uniform_int_distribution<std::size_t> size(1, max_bytes);
    std::uniform_real_distribution<double> coin(0, 1);
    std::vector<std::pair<std::size_t, std::size_t>> live;
    std::size_t live_bytes = 0;
    for (std::size_t i = 0; i < operations; ++i) {
      const std::size_t bytes = size(random);
      if (live.empty() || (coin(random) < 0.7 && live_bytes + bytes <= live_cap)) {
        plan.push_back({true, bytes, slots});
        live.emplace_back(slots++, bytes);
        live_bytes += bytes;
      } else {
        std::uniform_int_distribution<std::size_t> pick(0, live.size() - 1);
        const std::size_t index = pick(random);
        plan.push_back({false, live[index].second, live[index].first});
        live_bytes -= live[index].second;
        live[index] = live.back();
        live.pop_back();
      }
    }
  }
  std::unique_ptr<cuda::Stream> stream;
  if (c.gpu) stream = std::make_unique<cuda::Stream>();
  cudaStream_t s = stream ? stream->get() : nullptr;
  const std::size_t repetitions = c.quick ? 3 : 5;
  const std::string parameter = "up to " + format_bytes(max_bytes);
  for (auto& a : allocators) {
    progress.step("mixed " + a->name());
    a->reset_peak();
    std::vector<void*> blocks(slots, nullptr);
    std::vector<std::size_t> sizes(slots, 0);
    std::vector<double> samples;
    for (std::size_t r = 0; r < repetitions; ++r) {
      const double start = now_seconds();
      for (const auto& op : plan) {
        if (op.allocate) {
          blocks[op.slot] = a->allocate(op.bytes, s);
          sizes[op.slot] = op.bytes;
        } else {
          a->deallocate(blocks[op.slot], op.bytes, s);
          blocks[op.slot] = nullptr;
        }
      }
      a->finish(s);
      samples.push_back((now_seconds() - start) * 1e9 / static_cast<double>(plan.size()));
      for (std::size_t i = 0; i < slots; ++i) {
        if (blocks[i] != nullptr) a->deallocate(blocks[i], sizes[i], s);
        blocks[i] = nullptr;
      }
      a->finish(s);
    }
    auto m = make("mixed", parameter, static_cast<double>(max_bytes), a->name(), a->ours(), "ns/op",
                  true, samples);
    m.extra["peak_reserved_mib"] = static_cast<double>(a->peak_reserved_bytes()) / (1 << 20);
    m.extra["operations"] = static_cast<double>(plan.size());
    results.push_back(m);
    a->release_cache();
  }
}

std::vector<std::size_t> pagein_chunks(const BenchConfig& c) {
  if (c.quick) return {16_MiB};
  return {16_MiB, 1_MiB};
}

void run_pagein(const BenchConfig& c, std::size_t bytes, Progress& progress,
                std::vector<Measurement>& results) {
  const std::size_t page_ins = 64;
  const std::size_t repetitions = c.quick ? 3 : 7;
  const std::string parameter = std::to_string(page_ins) + " x " + format_bytes(bytes);
  cuda::Stream stream;
  void* device = nullptr;
  cuda::check(cudaMalloc(&device, bytes), "cudaMalloc");
  std::vector<char> pageable(bytes, 1);
  auto measure = [&](const std::string& name, bool ours, bool reference,
                     const std::function<void()>& loop) {
    progress.step("pagein " + parameter + " " + name);
    loop();  // warm-up
    std::vector<double> samples;
    for (std::size_t r = 0; r < repetitions; ++r) {
      const double start = now_seconds();
      loop();
      samples.push_back(static_cast<double>(bytes * page_ins) / (now_seconds() - start) / 1e9);
    }
    Measurement m =
        make("pagein", parameter, static_cast<double>(bytes), name, ours, "GB/s", false, samples);
    m.reference = reference;
    results.push_back(m);
    return results.size() - 1;
  };
  void* prepinned = nullptr;
  cuda::check(cudaHostAlloc(&prepinned, bytes, cudaHostAllocPortable), "cudaHostAlloc");
  std::memset(prepinned, 1, bytes);
  const std::size_t ceiling = measure("pre-pinned buffer (H2D ceiling)", false, true, [&] {
    for (std::size_t i = 0; i < page_ins; ++i) {
      cuda::check(cudaMemcpyAsync(device, prepinned, bytes, cudaMemcpyHostToDevice, stream.get()),
                  "cudaMemcpyAsync");
      stream.synchronize();
    }
  });
  cuda::check(cudaFreeHost(prepinned), "cudaFreeHost");

  PinnedStagingPool pool;
  const std::size_t ours = measure("vram PinnedStagingPool", true, false, [&] {
    for (std::size_t i = 0; i < page_ins; ++i) {
      auto staging = pool.acquire(bytes);
      auto done = copy_to_device(device, staging, stream.get());
      staging.retire(std::move(done.completed));
    }
  });
  const auto pool_stats = pool.stats();
  results[ours].extra["pin_calls_total"] = static_cast<double>(pool_stats.pin_calls);
  results[ours].extra["page_ins_total"] =
      static_cast<double>(pool_stats.pin_calls + pool_stats.reuses);
  results[ours].extra["of_ceiling_pct"] =
      100.0 * results[ours].value.median / results[ceiling].value.median;

  const std::size_t filled =
      measure("vram PinnedStagingPool + fill from pageable", true, true, [&] {
        for (std::size_t i = 0; i < page_ins; ++i) {
          auto staging = pool.acquire(bytes);
          std::memcpy(staging.data(), pageable.data(), bytes);
          auto done = copy_to_device(device, staging, stream.get());
          staging.retire(std::move(done.completed));
        }
      });
  results[filled].extra["note_single_thread_fill"] = 1;

  const std::size_t per_pin = measure("cudaHostAlloc per page-in", false, false, [&] {
    for (std::size_t i = 0; i < page_ins; ++i) {
      void* staging = nullptr;
      cuda::check(cudaHostAlloc(&staging, bytes, cudaHostAllocPortable), "cudaHostAlloc");
      std::memcpy(staging, pageable.data(), 4096);
      cuda::check(cudaMemcpyAsync(device, staging, bytes, cudaMemcpyHostToDevice, stream.get()),
                  "cudaMemcpyAsync");
      stream.synchronize();
      cuda::check(cudaFreeHost(staging), "cudaFreeHost");
    }
  });
  results[per_pin].extra["pin_calls_per_loop"] = static_cast<double>(page_ins);

  measure("pageable cudaMemcpy", false, false, [&] {
    for (std::size_t i = 0; i < page_ins; ++i) {
      cuda::check(cudaMemcpy(device, pageable.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    }
  });
  cuda::check(cudaFree(device), "cudaFree");
}

void run_pinning(const BenchConfig& c, Progress& progress, std::vector<Measurement>& results) {
  std::vector<std::size_t> sizes =
      c.quick ? std::vector<std::size_t>{1_MiB, 64_MiB, 1_GiB}
              : std::vector<std::size_t>{64_KiB, 256_KiB, 1_MiB, 16_MiB, 256_MiB, 1_GiB, 8_GiB};
  struct Method {
    std::string name;
    bool ours;
    PinningMethod method;
  };
  const std::vector<Method> methods = {
      {"vram touch+register (parallel)", true, PinningMethod::touch_register},
      {"cudaHostAlloc", false, PinningMethod::host_alloc}};
  for (std::size_t bytes : sizes) {
    const std::size_t repetitions = bytes >= 8_GiB ? 1 : bytes >= 1_GiB ? 3 : 5;
    for (const auto& method : methods) {
      progress.step("pinning " + format_bytes(bytes) + " " + method.name);
      PinnedHostUpstream upstream(PinnedHostUpstream::Options{.method = method.method});
      std::vector<double> rates;
      std::vector<double> unpin_ms;
      for (std::size_t r = 0; r < repetitions; ++r) {
        const double start = now_seconds();
        void* block = upstream.allocate(bytes);
        const double pinned = now_seconds();
        upstream.deallocate(block, bytes);
        const double freed = now_seconds();
        rates.push_back(static_cast<double>(bytes) / (pinned - start) / 1e9);
        unpin_ms.push_back((freed - pinned) * 1e3);
      }
      Measurement m = make("pinning", format_bytes(bytes), static_cast<double>(bytes), method.name,
                           method.ours, "GB/s", false, rates);
      m.extra["unpin_ms"] = summarize(unpin_ms).median;
      results.push_back(m);
    }
  }
}

// StreamOrderedPool against raw cudaMallocAsync/cudaFreeAsync on the same default pool and
// stream, batches interleaved (order alternating per round) so drift hits both alike: the
// cost our wrapper adds per allocate+free pair.
void run_overhead(const BenchConfig& c, Progress& progress, std::vector<Measurement>& results) {
  const std::size_t rounds = c.quick ? 15 : 41;
  const std::size_t pairs = 2000;
  cuda::Stream stream;
  StreamOrderedPool pool(StreamOrderedPoolOptions{.device = c.device, .use_default_pool = true});
  auto ours = [&](std::size_t bytes) {
    for (std::size_t i = 0; i < pairs; ++i) {
      pool.deallocate_async(pool.allocate_async(bytes, stream.get()), bytes, stream.get());
    }
    stream.synchronize();
  };
  auto raw = [&](std::size_t bytes) {
    for (std::size_t i = 0; i < pairs; ++i) {
      void* block = nullptr;
      cuda::check(cudaMallocAsync(&block, bytes, stream.get()), "cudaMallocAsync");
      cuda::check(cudaFreeAsync(block, stream.get()), "cudaFreeAsync");
    }
    stream.synchronize();
  };
  for (std::size_t bytes : {std::size_t{256}, 64_KiB, 16_MiB}) {
    progress.step("overhead " + format_bytes(bytes));
    ours(bytes);
    raw(bytes);
    std::vector<double> ours_ns;
    std::vector<double> raw_ns;
    for (std::size_t r = 0; r < rounds; ++r) {
      for (int turn = 0; turn < 2; ++turn) {
        const bool ours_now = (turn == 0) == (r % 2 == 0);
        const double start = now_seconds();
        ours_now ? ours(bytes) : raw(bytes);
        const double ns = (now_seconds() - start) * 1e9 / static_cast<double>(pairs);
        (ours_now ? ours_ns : raw_ns).push_back(ns);
      }
    }
    Measurement mine = make("overhead", format_bytes(bytes), static_cast<double>(bytes),
                            "vram StreamOrderedPool", true, "ns/pair", true, ours_ns);
    Measurement peer = make("overhead", format_bytes(bytes), static_cast<double>(bytes),
                            "cudaMallocAsync (raw, same pool)", false, "ns/pair", true, raw_ns);
    mine.extra["overhead_pct"] = (mine.value.median / peer.value.median - 1.0) * 100.0;
    results.push_back(mine);
    results.push_back(peer);
  }
}

}  // namespace

const std::vector<std::string>& known_scenarios() {
  static const std::vector<std::string> names = {
      "pairs",   "threads",          "mixed",        "overhead", "pagein", "pinning",
      "batched", "batched-repeated", "stream-churn", "replay",   "driver", "pager",
      "sleep"};
  return names;
}

std::vector<std::string> default_scenarios() {
  std::vector<std::string> names = known_scenarios();
  // Named only: pager (about a minute), driver (GiB-sized cudaMalloc and maps), sleep (16
  // GiB of device memory and 8 GiB pinned), and the forms measured for a question of their
  // own (batched-repeated, stream-churn).
  for (const char* named_only : {"pager", "driver", "sleep", "batched-repeated", "stream-churn"}) {
    names.erase(std::remove(names.begin(), names.end(), named_only), names.end());
  }
  return names;
}

bool scenario_needs_gpu(const std::string& name) {
  return name == "pagein" || name == "pinning" || name == "overhead" || name == "pager" ||
         name == "driver" || name == "sleep" || name == "stream-churn";
}

std::vector<Measurement> run_scenarios(const BenchConfig& config) {
  std::vector<Measurement> results;
  auto wanted = [&](const std::string& name) {
    return std::find(config.scenarios.begin(), config.scenarios.end(), name) !=
           config.scenarios.end();
  };
  Allocators allocators = make_allocators(config);
  const std::size_t per_scenario = allocators.size();
  std::size_t steps = 0;
  if (wanted("pairs")) steps += pair_sizes(config).size() * per_scenario;
  if (wanted("threads")) steps += thread_counts(config).size() * per_scenario;
  if (wanted("mixed")) steps += per_scenario;
  if (wanted("batched")) steps += batched_steps(config, per_scenario);
  if (wanted("batched-repeated")) steps += batched_steps(config, per_scenario);
  if (wanted("stream-churn") && config.gpu) steps += stream_churn_steps(config);
  if (wanted("replay")) steps += replay_steps(config);
  if (wanted("overhead") && config.gpu) steps += 3;
  if (wanted("pagein") && config.gpu) steps += 5 * pagein_chunks(config).size();
  if (wanted("pinning") && config.gpu) steps += (config.quick ? 3 : 7) * 2;
  if (wanted("driver") && config.gpu) steps += driver_steps(config);
  if (wanted("pager") && config.gpu) steps += pager_scenario_steps(config);
  if (wanted("sleep") && config.gpu) steps += sleep_scenario_steps(config);
  Progress progress(steps);
  if (wanted("pairs")) run_pairs(config, allocators, progress, results);
  if (wanted("threads")) run_threads(config, allocators, progress, results);
  if (wanted("mixed")) run_mixed(config, allocators, progress, results);
  if (wanted("batched")) run_batched(config, allocators, progress, results, /*fresh=*/true);
  if (wanted("batched-repeated")) {
    run_batched(config, allocators, progress, results, /*fresh=*/false);
  }
  allocators.clear();
  if (wanted("replay")) run_replay(config, progress, results);
  if (config.gpu && wanted("overhead")) run_overhead(config, progress, results);
  if (config.gpu && wanted("pagein")) {
    for (std::size_t bytes : pagein_chunks(config)) run_pagein(config, bytes, progress, results);
  }
  if (config.gpu && wanted("pinning")) run_pinning(config, progress, results);
  if (config.gpu && wanted("driver")) run_driver(config, progress, results);
  if (config.gpu && wanted("stream-churn")) run_stream_churn(config, progress, results);
  if (config.gpu && wanted("pager")) run_pager_scenario(config, progress, results);
  if (config.gpu && wanted("sleep")) run_sleep_scenario(config, progress, results);
  progress.finish();
  return results;
}

}  // namespace vram::bench
