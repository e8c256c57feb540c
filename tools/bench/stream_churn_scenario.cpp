// The `stream-churn` scenario: streams that come and go, as a server that makes a stream per
// request. Each thread loops over requests: a stream created, kRequestBlocks blocks (sizes
// log-uniform from 256 B to 1 or 64 MiB) allocated on it, each filled with a tag of its own
// by a kernel and checked by another that first spins (so the check is still queued when
// the block is freed), each freed on the stream; then the stream is synchronized and
// destroyed. 1, 4 and 16 threads; the stream-ordered allocators of the batched scenario
// (DevicePool's allocate_async, cudaMallocAsync on a private pool, CUB) in one run.
// Reported per row: k pairs/s (p10..p90 over the repetitions), the device synchronizes the
// allocator made over the row (DevicePool: its quiesces), streams made, peak reserved
// bytes, and the words the checks found overwritten (any is a failure of the allocator).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/allocators.hpp"
#include "bench/scenarios.hpp"
#include "vram/cuda/error.hpp"
#if defined(VRAM_HAVE_BENCH_KERNELS)
#include "bench/churn_kernels.hpp"
#endif

namespace vram::bench {
namespace {

constexpr int kChurnMaxExponents[] = {20, 26};  // 1 MiB, 64 MiB
constexpr std::size_t kChurnAllocators = 3;     // the stream-ordered ones of the batched run

std::vector<unsigned> churn_thread_counts(const BenchConfig& config) {
  if (config.quick) return {1, 16};
  return {1, 4, 16};
}

}  // namespace

std::size_t stream_churn_steps(const BenchConfig& config) {
  return std::size(kChurnMaxExponents) * churn_thread_counts(config).size() * kChurnAllocators;
}

#if !defined(VRAM_HAVE_BENCH_KERNELS)

void run_stream_churn(const BenchConfig&, Progress&, std::vector<Measurement>&) {
  std::printf(
      "vram bench: scenario 'stream-churn' skipped: built without the bench kernels "
      "(VRAM_BENCH_KERNELS=OFF)\n");
}

#else

namespace {

constexpr std::size_t kRequestBlocks = 4;
constexpr std::size_t kCheckedBytes = std::size_t{1} << 20;  // of each block, from its start
constexpr std::uint64_t kSpinCycles = 2000;

}  // namespace

void run_stream_churn(const BenchConfig& config, Progress& progress,
                      std::vector<Measurement>& results) {
  const double seconds = config.quick ? 0.1 : 0.5;
  const std::size_t repetitions = config.quick ? 3 : 5;
  std::vector<std::unique_ptr<BenchAllocator> > measured = make_batched_allocators(config.device);
  // The plain DevicePool form frees without a stream: not what a stream per request does.
  std::erase_if(measured, [](const std::unique_ptr<BenchAllocator>& a) {
    return a->name() == "vram DevicePool";
  });
  const std::vector<unsigned> thread_counts = churn_thread_counts(config);
  const unsigned most = thread_counts.back();
  std::vector<unsigned long long*> counters(most, nullptr);
  for (auto& counter : counters) {
    cuda::check(cudaMalloc(reinterpret_cast<void**>(&counter), sizeof *counter), "cudaMalloc");
  }
  for (const int max_exponent : kChurnMaxExponents) {
    const std::string range = "to " + format_bytes(std::size_t{1} << max_exponent);
    for (const unsigned threads : thread_counts) {
      for (auto& a : measured) {
        progress.step("stream-churn " + range + " " + std::to_string(threads) + " " + a->name());
        a->reset_peak();
        for (auto* counter : counters) {
          cuda::check(cudaMemset(counter, 0, sizeof *counter), "cudaMemset");
        }
        const double synchronizes_before = a->device_synchronizes();
        std::atomic<std::uint64_t> streams{0};
        std::atomic<std::uint64_t> request_counter{0};
        const auto samples = threaded_pair_rates(
            threads, repetitions, seconds, [&](unsigned t, const std::atomic<bool>& stop) {
              std::mt19937_64 random(0xc4a2 + t + 977 * request_counter.fetch_add(1));
              std::uniform_real_distribution<double> exponent(8.0, max_exponent);
              std::uint32_t tag = (t + 1) << 24;
              std::uint64_t pairs = 0;
              while (!stop.load(std::memory_order_relaxed)) {
                cudaStream_t s = nullptr;
                cuda::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                            "cudaStreamCreateWithFlags");
                for (std::size_t i = 0; i < kRequestBlocks; ++i) {
                  const auto bytes = static_cast<std::size_t>(std::exp2(exponent(random)));
                  void* block = a->allocate(bytes, s);
                  const std::size_t words = std::min(bytes, kCheckedBytes) / 4;
                  ++tag;
                  cuda::check(launch_churn_fill(block, words, tag, s), "churn fill");
                  cuda::check(launch_churn_check(block, words, tag, kSpinCycles, counters[t], s),
                              "churn check");
                  a->deallocate(block, bytes, s);  // the check is still queued
                }
                cuda::check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
                cuda::check(cudaStreamDestroy(s), "cudaStreamDestroy");
                streams.fetch_add(1, std::memory_order_relaxed);
                pairs += kRequestBlocks;
              }
              return pairs;
            });
        cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
        unsigned long long mismatches = 0;
        for (unsigned t = 0; t < threads; ++t) {
          unsigned long long seen = 0;
          cuda::check(cudaMemcpy(&seen, counters[t], sizeof seen, cudaMemcpyDeviceToHost),
                      "cudaMemcpy");
          mismatches += seen;
        }
        std::vector<double> k_pairs;
        for (double rate : samples) k_pairs.push_back(rate * 1e3);
        Measurement m =
            make_measurement("stream-churn", range + ", " + std::to_string(threads) + " threads",
                             threads, a->name(), a->ours(), "k pairs/s", false, k_pairs);
        m.extra["streams"] = static_cast<double>(streams.load());
        m.extra["blocks_per_stream"] = kRequestBlocks;
        m.extra["overwritten_words"] = static_cast<double>(mismatches);
        m.extra["peak_reserved_mib"] =
            static_cast<double>(a->peak_reserved_bytes()) / double(std::size_t{1} << 20);
        if (synchronizes_before >= 0) {
          m.extra["device_synchronizes"] = a->device_synchronizes() - synchronizes_before;
        }
        if (mismatches != 0) {
          std::fprintf(stderr,
                       "vram bench: stream-churn: %s handed out a block whose owner's work was "
                       "still queued (%llu words overwritten)\n",
                       a->name().c_str(), mismatches);
        }
        results.push_back(m);
        a->release_cache();
      }
    }
  }
  for (auto* counter : counters) cudaFree(counter);
}

#endif  // VRAM_HAVE_BENCH_KERNELS

}  // namespace vram::bench
