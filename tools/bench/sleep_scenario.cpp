// `vram bench --scenario sleep`: DevicePool's sleep and wake against the pinned link of the
// same run.
//
// The link: one buffer copied device to host and host to device (cudaMemcpyAsync between a
// cudaMalloc buffer and a cudaHostAlloc one, 1 GiB, timed with events), the ceiling of any
// sleep. Then a pool over CUDA virtual memory with two tags: "weights" (8 GiB in 32 blocks,
// backed up) and "kv" (8 GiB, discardable); one untimed cycle (it pins the backup), then
// three timed ones: sleep and wake of each tag, host wall clock around the call (the copies,
// the proof of their end, the unmaps and maps). Then "many": 10,000 blocks of 64 KiB to
// 4 MiB (log-uniform, fixed seed) in one tag, the same cycles. Sizes shrink to fit the
// device's free memory (and --quick divides them by 8).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "bench/scenarios.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/event.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/device_pool.hpp"
#include "vram/units.hpp"

namespace vram::bench {
namespace {

using namespace vram::literals;

double gb_per_s(std::size_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0;
}

// GB/s of `repetitions` copies of `bytes` each way (device to host, host to device).
std::pair<std::vector<double>, std::vector<double>> pinned_link(std::size_t bytes,
                                                                std::size_t repetitions) {
  void* device = nullptr;
  void* host = nullptr;
  cuda::check(cudaMalloc(&device, bytes), "cudaMalloc");
  const cudaError_t pinned = cudaHostAlloc(&host, bytes, cudaHostAllocPortable);
  if (pinned != cudaSuccess) {
    (void)cudaFree(device);
    cuda::check(pinned, "cudaHostAlloc");
  }
  cuda::Stream stream;
  cuda::Event start(cuda::Event::Timing::enabled);
  cuda::Event stop(cuda::Event::Timing::enabled);
  std::vector<double> to_host;
  std::vector<double> to_device;
  for (std::size_t r = 0; r <= repetitions; ++r) {
    for (int direction = 0; direction < 2; ++direction) {
      start.record(stream.get());
      cuda::check(direction == 0
                      ? cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream.get())
                      : cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream.get()),
                  "cudaMemcpyAsync");
      stop.record(stream.get());
      stop.wait();
      if (r == 0) continue;  // warm-up
      const double rate = gb_per_s(bytes, cuda::Event::elapsed_ms(start, stop) / 1e3);
      (direction == 0 ? to_host : to_device).push_back(rate);
    }
  }
  (void)cudaFreeHost(host);
  (void)cudaFree(device);
  return {to_host, to_device};
}

struct CycleTimes {
  std::vector<double> sleep_s;
  std::vector<double> wake_s;
};

CycleTimes cycles(DevicePool& pool, SleepTag tag, cudaStream_t stream, std::size_t timed) {
  CycleTimes times;
  for (std::size_t cycle = 0; cycle <= timed; ++cycle) {
    cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    const double start = now_seconds();
    pool.sleep(tag, stream);
    const double slept = now_seconds();
    pool.wake(tag, stream);
    const double woke = now_seconds();
    if (cycle == 0) continue;  // pins the backup
    times.sleep_s.push_back(slept - start);
    times.wake_s.push_back(woke - slept);
  }
  return times;
}

void add_rate_rows(std::vector<Measurement>& results, const std::string& parameter,
                   std::size_t bytes, const std::string& what, const CycleTimes& times,
                   double link_to_host, double link_to_device) {
  for (int direction = 0; direction < 2; ++direction) {
    std::vector<double> rates;
    for (double s : direction == 0 ? times.sleep_s : times.wake_s)
      rates.push_back(gb_per_s(bytes, s));
    Measurement m =
        make_measurement("sleep", parameter, static_cast<double>(bytes),
                         std::string("vram ") + (direction == 0 ? "sleep " : "wake ") + what, true,
                         "GB/s", false, rates);
    const double link = direction == 0 ? link_to_host : link_to_device;
    m.extra["fraction_of_link"] = link > 0 ? m.value.median / link : 0;
    results.push_back(m);
  }
}

void add_time_rows(std::vector<Measurement>& results, const std::string& parameter,
                   std::size_t bytes, const std::string& what, const CycleTimes& times) {
  const double gib = static_cast<double>(bytes) / static_cast<double>(1_GiB);
  for (int direction = 0; direction < 2; ++direction) {
    std::vector<double> ms;
    for (double s : direction == 0 ? times.sleep_s : times.wake_s) ms.push_back(s * 1e3);
    Measurement m = make_measurement(
        "sleep", parameter, static_cast<double>(bytes),
        std::string("vram ") + (direction == 0 ? "sleep " : "wake ") + what, true, "ms", true, ms);
    m.extra["ms_per_gib"] = gib > 0 ? m.value.median / gib : 0;
    results.push_back(m);
  }
}

std::size_t free_device_bytes() {
  std::size_t free_bytes = 0;
  std::size_t total = 0;
  cuda::check(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
  return free_bytes;
}

}  // namespace

std::size_t sleep_scenario_steps(const BenchConfig&) { return 4; }

void run_sleep_scenario(const BenchConfig& config, Progress& progress,
                        std::vector<Measurement>& results) {
  cuda::check(cudaSetDevice(config.device), "cudaSetDevice");
  const std::size_t timed = 3;
  progress.step("sleep: pinned link");
  const auto [link_to_host, link_to_device] = pinned_link(1_GiB, config.quick ? 3 : 5);
  for (int direction = 0; direction < 2; ++direction) {
    Measurement m = make_measurement(
        "sleep", "1 GiB", static_cast<double>(1_GiB),
        direction == 0 ? "pinned link device to host" : "pinned link host to device", false, "GB/s",
        false, direction == 0 ? link_to_host : link_to_device);
    m.reference = true;
    results.push_back(m);
  }
  const double to_host =
      make_measurement("", "", 0, "", false, "", false, link_to_host).value.median;
  const double to_device =
      make_measurement("", "", 0, "", false, "", false, link_to_device).value.median;

  // Weights and KV cache: 8 GiB each, less when the device has less free (a quarter each of
  // what is free, leaving room for the maps).
  std::size_t each = config.quick ? 1_GiB : 8_GiB;
  each = std::min(each, free_device_bytes() / 4 / 32_MiB * 32_MiB);
  cuda::Stream stream;
  {
    DevicePool::Options options;
    options.large_tier.memory = LargeTierMemory::virtual_memory;
    DevicePool pool(config.device, options);
    const SleepTag weights = pool.create_tag("weights");
    const SleepTag kv = pool.create_tag("kv", {.discardable = true});
    std::vector<void*> blocks;
    const std::size_t block = each / 32;
    for (int i = 0; i < 32; ++i) {
      blocks.push_back(pool.allocate_tagged(block, weights));
      cuda::check(cudaMemsetAsync(blocks.back(), i, block, stream.get()), "cudaMemsetAsync");
    }
    void* cache = pool.allocate_tagged(each, kv);
    progress.step("sleep: weights");
    const CycleTimes w = cycles(pool, weights, stream.get(), timed);
    const std::string parameter = format_bytes(each) + " in 32 blocks";
    add_rate_rows(results, parameter, each, "weights", w, to_host, to_device);
    progress.step("sleep: kv (discardable)");
    const CycleTimes k = cycles(pool, kv, stream.get(), timed);
    add_time_rows(results, format_bytes(each) + " discardable", each, "kv", k);
    for (void* b : blocks) pool.deallocate(b, block);
    pool.deallocate(cache, each);
  }

  // Many blocks: 10,000 of 64 KiB to 4 MiB, log-uniform.
  progress.step("sleep: 10,000 blocks");
  {
    const std::size_t count = config.quick ? 1000 : 10000;
    std::mt19937_64 random(42);
    std::uniform_real_distribution<double> exponent(std::log(64.0 * 1024), std::log(4.0 * 1048576));
    std::vector<std::size_t> sizes;
    std::size_t total = 0;
    const std::size_t cap = free_device_bytes() / 3;
    for (std::size_t i = 0; i < count; ++i) {
      const auto bytes = static_cast<std::size_t>(std::exp(exponent(random))) / 256 * 256;
      if (total + bytes > cap) break;
      sizes.push_back(bytes);
      total += bytes;
    }
    DevicePool::Options options;
    options.large_tier.memory = LargeTierMemory::virtual_memory;
    DevicePool pool(config.device, options);
    const SleepTag many = pool.create_tag("many");
    std::vector<void*> blocks;
    {
      auto scope = pool.tag_scope(many);
      for (std::size_t bytes : sizes) blocks.push_back(pool.allocate_async(bytes, stream.get()));
    }
    const CycleTimes m = cycles(pool, many, stream.get(), timed);
    const std::string parameter = std::to_string(sizes.size()) + " blocks, " + format_bytes(total);
    add_rate_rows(results, parameter, total, "blocks", m, to_host, to_device);
    results.back().extra["copies"] = static_cast<double>(pool.tag_stats(many).copies);
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      pool.deallocate_async(blocks[i], sizes[i], stream.get());
    }
  }
}

}  // namespace vram::bench
