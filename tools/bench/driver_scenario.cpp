// The `driver` scenario: what the driver calls a pool makes when it grows or gives memory
// back cost on this GPU, by size. It is the floor under any allocator's cold start: a
// replay that starts from an empty pool must obtain at least the trace's peak live bytes
// from the driver, so no allocator can be cheaper over a cold trace than those calls.
//
// Per size: cudaMalloc and cudaFree timed separately (a steady clock around each call; a
// device synchronize before each pair, so no queued work is timed), and the virtual-memory
// path DevicePool's virtual-memory large tier takes (CudaVirtualMemory::map: cuMemCreate +
// cuMemMap + cuMemSetAccess; unmap: cuMemUnmap + cuMemRelease) inside one reserved range.
// Also the map and unmap of a physical allocation created once and kept (a remap).
// One untimed pair first per size and method; the median of the repetitions is reported.
// Also cudaMemGetInfo, which the tier asks before each map (the run cap).
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/scenarios.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/stream_fence.hpp"
#include "vram/units.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::bench {
namespace {

using namespace vram::literals;

std::vector<std::size_t> driver_sizes(const BenchConfig& config) {
  if (config.quick) return {2_MiB, 64_MiB, 1_GiB};
  return {2_MiB, 20_MiB, 64_MiB, 256_MiB, 1_GiB, 4_GiB};
}

std::size_t driver_repetitions(std::size_t bytes) {
  return bytes >= 4_GiB ? 3 : bytes >= 1_GiB ? 5 : 9;
}

// Times `get()` and `put(handle)` for `repetitions` pairs after one untimed pair; appends
// microseconds per call to the two vectors.
template <typename Get, typename Put>
void time_pairs(std::size_t repetitions, Get get, Put put, std::vector<double>& get_us,
                std::vector<double>& put_us) {
  for (std::size_t r = 0; r <= repetitions; ++r) {
    cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const double start = now_seconds();
    auto handle = get();
    const double got = now_seconds();
    put(handle);
    const double done = now_seconds();
    if (r == 0) continue;  // warm-up
    get_us.push_back((got - start) * 1e6);
    put_us.push_back((done - got) * 1e6);
  }
}

void add_rows(std::vector<Measurement>& results, std::size_t bytes, const std::string& get_name,
              const std::vector<double>& get_us, const std::string& put_name,
              const std::vector<double>& put_us) {
  const std::string parameter = format_bytes(bytes);
  for (const auto& [name, samples] : {std::pair{get_name, get_us}, std::pair{put_name, put_us}}) {
    Measurement m = make_measurement("driver", parameter, static_cast<double>(bytes), name, false,
                                     "us/call", true, samples);
    m.reference = true;  // the cost under every allocator, not a peer: no verdict
    m.extra["us_per_gib"] =
        m.value.median / (static_cast<double>(bytes) / static_cast<double>(1_GiB));
    results.push_back(m);
  }
}

// What one fence of a stream costs (DevicePool's CudaEventFence, used when a request would
// grow while other streams hold free memory): record + completed + release on an idle
// stream, and its CUDA calls one by one. Mean per call over batches of about 20 ms; the
// median of the batches is reported.
void run_fence_calls(const BenchConfig& config, std::vector<Measurement>& results) {
  cuda::Stream stream;
  cudaStream_t s = stream.get();
  CudaEventFence fence(config.device);
  cudaEvent_t event = nullptr;
  cuda::check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  const std::size_t repetitions = config.quick ? 5 : 9;
  auto row = [&](const std::string& name, const std::function<void()>& call) {
    auto samples = time_per_operation(
        [&](std::size_t n) {
          for (std::size_t i = 0; i < n; ++i) call();
        },
        repetitions, config.quick ? 5 : 20);
    for (double& ns : samples) ns /= 1000.0;  // us
    Measurement m = make_measurement("driver", "fence", 0, name, false, "us/call", true, samples);
    m.reference = true;
    results.push_back(m);
  };
  row("CudaEventFence record+completed+release", [&] {
    const std::uint64_t marker = fence.record(s);
    (void)fence.completed(marker);
    fence.release(marker);
  });
  row("cudaEventRecord", [&] { (void)cudaEventRecord(event, s); });
  row("cudaEventQuery", [&] { (void)cudaEventQuery(event); });
  row("cudaStreamIsCapturing", [&] {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    (void)cudaStreamIsCapturing(s, &status);
  });
  row("cudaThreadExchangeStreamCaptureMode", [&] {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    (void)cudaThreadExchangeStreamCaptureMode(&mode);
  });
  (void)cudaEventDestroy(event);
}

// Times mapping and unmapping one physical allocation created once (see run_driver).
void remap_existing(CudaVirtualMemory& virtual_memory, char* address, std::size_t bytes,
                    std::size_t repetitions, std::vector<double>& map_us,
                    std::vector<double>& unmap_us) {
  const std::uint64_t handle = virtual_memory.create(bytes);
  try {
    time_pairs(
        repetitions,
        [&] {
          virtual_memory.map_created(address, bytes, handle);
          return 0;
        },
        [&](int) { virtual_memory.unmap_only(address, bytes); }, map_us, unmap_us);
  } catch (...) {
    virtual_memory.unmap_only(address, bytes);  // fails harmlessly when not mapped
    virtual_memory.release(handle);
    throw;
  }
  virtual_memory.release(handle);
}

}  // namespace

std::size_t driver_steps(const BenchConfig& config) { return driver_sizes(config).size() * 2 + 1; }

void run_driver(const BenchConfig& config, Progress& progress, std::vector<Measurement>& results) {
  cuda::check(cudaSetDevice(config.device), "cudaSetDevice");
  const auto sizes = driver_sizes(config);
  const std::size_t range_bytes = *std::max_element(sizes.begin(), sizes.end());
  std::unique_ptr<CudaVirtualMemory> virtual_memory;
  // The reserved range goes back however the scenario ends (a failed call throws).
  auto unreserve = [&](char* base) {
    if (base != nullptr) virtual_memory->unreserve(base, range_bytes);
  };
  std::unique_ptr<char, decltype(unreserve)> range(nullptr, unreserve);
  if (CudaVirtualMemory::supported(config.device)) {
    virtual_memory = std::make_unique<CudaVirtualMemory>(config.device);
    range.reset(virtual_memory->reserve(range_bytes));
  }
  progress.step("driver fence calls");
  run_fence_calls(config, results);
  for (std::size_t bytes : sizes) {
    const std::size_t repetitions = driver_repetitions(bytes);
    progress.step("driver " + format_bytes(bytes) + " cudaMalloc");
    std::vector<double> malloc_us;
    std::vector<double> free_us;
    time_pairs(
        repetitions,
        [&] {
          void* block = nullptr;
          cuda::check(cudaMalloc(&block, bytes), "cudaMalloc");
          return block;
        },
        [&](void* block) { cuda::check(cudaFree(block), "cudaFree"); }, malloc_us, free_us);
    add_rows(results, bytes, "cudaMalloc", malloc_us, "cudaFree", free_us);

    progress.step("driver " + format_bytes(bytes) + " virtual memory");
    if (virtual_memory == nullptr) continue;
    std::vector<double> map_us;
    std::vector<double> unmap_us;
    time_pairs(
        repetitions, [&] { return virtual_memory->map(range.get(), bytes); },
        [&](std::uint64_t handle) { virtual_memory->unmap(range.get(), bytes, handle); }, map_us,
        unmap_us);
    add_rows(results, bytes, "cuMemCreate+cuMemMap+cuMemSetAccess", map_us,
             "cuMemUnmap+cuMemRelease", unmap_us);
    // Remapping memory already created (what a pool that moves physical memory between
    // addresses would pay instead of a create and a release): one cuMemCreate kept for the
    // whole loop; each pair maps it (cuMemMap + cuMemSetAccess) and unmaps it (cuMemUnmap).
    std::vector<double> remap_us;
    std::vector<double> keep_us;
    remap_existing(*virtual_memory, range.get(), bytes, repetitions, remap_us, keep_us);
    add_rows(results, bytes, "cuMemMap+cuMemSetAccess (created before)", remap_us,
             "cuMemUnmap (kept)", keep_us);
    // What the tier asks before each map (VirtualMemory::available_bytes(): cudaMemGetInfo
    // under a device guard), with this size mapped, as during a replay.
    const std::uint64_t held = virtual_memory->map(range.get(), bytes);
    std::vector<double> info_us;
    std::vector<double> none_us;
    time_pairs(
        repetitions, [&] { return virtual_memory->available_bytes(); }, [](std::size_t) {}, info_us,
        none_us);
    virtual_memory->unmap(range.get(), bytes, held);
    Measurement m =
        make_measurement("driver", format_bytes(bytes), static_cast<double>(bytes),
                         "cudaMemGetInfo (available_bytes)", false, "us/call", true, info_us);
    m.reference = true;
    results.push_back(m);
  }
}

}  // namespace vram::bench
