// weight_pager_example: run a layer stack larger than the VRAM budget with vram::WeightPager.
//
//   weight_pager_example [--layers N] [--layer-mib M] [--budget-mib B] [--intensity I]
//                        [--depth D] [--pageable] [--steps S]
//
// Each layer is M MiB of fp16 weights in host memory; its compute is a GEMM-shaped kernel
// doing 2*I FMAs per weight (I = 0: a pure read, the stack is copy-bound; raise I until the
// step time stops dropping to see the compute-bound regime). The pager keeps what fits in
// B MiB resident, streams the rest through depth+1 slots, and prints its plan and counters.
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "vram/cuda/device.hpp"
#include "vram/cuda/event.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/weight_pager.hpp"

namespace {

// One float per thread: the kernel's result, so the compiler keeps the work.
__global__ void layer_kernel(const uint4* __restrict__ weights, std::size_t vectors,
                             unsigned intensity, float* __restrict__ out) {
  const std::size_t thread = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  float acc0 = 0, acc1 = 0;
  for (std::size_t i = thread; i < vectors; i += stride) {
    const uint4 v = weights[i];
    const __half2* halves = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 w = __half22float2(halves[k]);
      acc0 += w.x;
      acc1 += w.y;
      for (unsigned j = 0; j < intensity; ++j) {  // a GEMM with `intensity` columns
        acc0 = fmaf(w.x, acc0, 1.0f);
        acc1 = fmaf(w.y, acc1, 1.0f);
      }
    }
  }
  out[thread] = acc0 + acc1;
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t layers = 24;
  std::size_t layer_mib = 64;
  std::size_t budget_mib = 512;
  unsigned intensity = 0;
  std::size_t depth = 1;
  std::size_t steps = 5;
  bool pageable = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&] { return i + 1 < argc ? std::strtoull(argv[++i], nullptr, 10) : 0ULL; };
    if (arg == "--layers")
      layers = next();
    else if (arg == "--layer-mib")
      layer_mib = next();
    else if (arg == "--budget-mib")
      budget_mib = next();
    else if (arg == "--intensity")
      intensity = static_cast<unsigned>(next());
    else if (arg == "--depth")
      depth = next();
    else if (arg == "--steps")
      steps = next();
    else if (arg == "--pageable")
      pageable = true;
    else {
      std::printf(
          "usage: %s [--layers N] [--layer-mib M] [--budget-mib B] [--intensity I] "
          "[--depth D] [--pageable] [--steps S]\n",
          argv[0]);
      return arg == "--help" ? 0 : 2;
    }
  }
  if (const auto devices = vram::cuda::Device::availability(); devices.count == 0) {
    std::printf("weight_pager example: no CUDA device (%s); nothing to run.\n",
                devices.reason.c_str());
    return 0;
  }
  const std::size_t bytes = layer_mib << 20;

  // The weights, in ordinary (pageable) host memory, fp16 0.5 everywhere.
  std::vector<std::vector<std::uint16_t>> host(layers,
                                               std::vector<std::uint16_t>(bytes / 2, 0x3800));
  std::vector<vram::WeightLayer> stack;
  for (std::size_t i = 0; i < layers; ++i) {
    stack.push_back({"layer." + std::to_string(i), host[i].data(), bytes});
  }

  try {
    const auto load_start = std::chrono::steady_clock::now();
    vram::WeightPager pager(
        stack, {.plan = {.budget_bytes = budget_mib << 20, .prefetch_depth = depth},
                .host = pageable ? vram::HostWeights::pageable : vram::HostWeights::automatic});
    const double load_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
    const auto& plan = pager.plan();
    const auto& load = pager.load();
    std::printf(
        "%zu layers x %zu MiB under a %zu MiB budget: %zu resident, %zu streamed through "
        "%zu slots (depth %zu), %.1f MiB per step\n",
        layers, layer_mib, budget_mib, layers - plan.streamed_layers(), plan.streamed_layers(),
        plan.slot_count, plan.prefetch_depth,
        static_cast<double>(plan.streamed_bytes_per_step) / (1 << 20));
    std::printf("load %.2f s: host weights %s (%.1f MiB registered in %zu call(s), %.3f s)\n",
                load_s, load.pinned ? "pinned" : "staged (pageable)",
                static_cast<double>(load.pinned_bytes) / (1 << 20), load.register_calls,
                load.pin_seconds);

    vram::cuda::Stream stream;
    int device = 0;
    int sms = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
    const int blocks = 4 * sms;
    float* out = nullptr;
    check(cudaMalloc(&out, std::size_t(blocks) * 256 * sizeof(float)), "cudaMalloc");

    vram::cuda::Event start(vram::cuda::Event::Timing::enabled);
    vram::cuda::Event end(vram::cuda::Event::Timing::enabled);
    for (std::size_t step = 0; step < steps; ++step) {
      start.record(stream.get());
      // [readme:weight_pager]
      for (std::size_t i = 0; i < layers; ++i) {
        const void* weights = pager.acquire(i, stream.get());  // ordered before the kernel
        layer_kernel<<<blocks, 256, 0, stream.get()>>>(static_cast<const uint4*>(weights),
                                                       bytes / 16, intensity, out);
        check(cudaGetLastError(), "layer_kernel");
        pager.release(i, stream.get());  // evictable once the kernel ran
      }
      // [/readme:weight_pager]
      end.record(stream.get());
      end.wait();
      const float ms = vram::cuda::Event::elapsed_ms(start, end);
      std::printf("step %zu: %.2f ms (%.1f GB/s of streamed weights)\n", step, ms,
                  static_cast<double>(plan.streamed_bytes_per_step) / ms / 1e6);
    }
    const auto stats = pager.stats();
    std::printf("acquires %llu, hits %llu, page-ins %llu (%llu prefetched), %.1f GiB paged in\n",
                static_cast<unsigned long long>(stats.acquires),
                static_cast<unsigned long long>(stats.hits),
                static_cast<unsigned long long>(stats.page_ins),
                static_cast<unsigned long long>(stats.prefetches),
                static_cast<double>(stats.bytes_paged_in) / (1 << 30));
    std::printf(
        "sampled: %llu copies at %.1f GB/s; compute waited in %llu of %llu sampled "
        "acquires, %.2f ms in all\n",
        static_cast<unsigned long long>(stats.timed_page_ins), stats.effective_gbps,
        static_cast<unsigned long long>(stats.stalled),
        static_cast<unsigned long long>(stats.stall_samples), stats.stall_ms_sampled);
    check(cudaFree(out), "cudaFree");
  } catch (const std::exception& error) {
    std::fprintf(stderr, "weight_pager_example: %s\n", error.what());
    return 1;
  }
  return 0;
}
