// bench/builds/batched_pairs.cpp: the batched pattern of `vram bench` (scenario batched) as
// a program of its own, built against any build's libvram.a through the public API only,
// so that two builds of the library run the same measurement in one call.
//
// Differs from the scenario in one way, on purpose: every cell (range, threads, form) gets
// a fresh DevicePool, so no cell starts with the threads' caches or rings of another.
//
// Build (per library build, here; the binary runs on the GPU machine):
//   g++ -O2 -std=c++20 -I <src>/include -I <build>/include -I tools -I /usr/local/cuda/include \
//     -isystem /usr/local/cuda/include/cccl bench/builds/batched_pairs.cpp \
//     tools/bench/harness.cpp <build>/libvram.a -L/usr/local/cuda/lib64 -lcudart_static \
//     -ldl -lrt -lpthread -o OUT
// (harness.cpp from this tree: `vram bench`'s plans, batched_plan, and timing loop,
// threaded_pair_rates.)
// Run: OUT LABEL [THREADS...]   (default threads: 1 16). One line per cell:
//   LABEL form range threads median min max   (M pairs/s; reps of 0.1 s after a warm-up)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "bench/harness.hpp"
#include "vram/device_pool.hpp"
#include "vram/upstream.hpp"

namespace {

// Deallocations unchecked, as release builds ship: the option is validate_releases in
// libraries built before it was renamed validate_deallocations (this file builds against both).
template <class Options>
void without_validation(Options& options) {
  if constexpr (requires { options.validate_deallocations; }) {
    options.validate_deallocations = false;
  } else {
    options.validate_releases = false;
  }
}

constexpr std::size_t kLive = 32;
constexpr int kReps = 7;
constexpr double kSeconds = 0.1;

}  // namespace

int main(int argc, char** argv) {
  const char* label = argc > 1 ? argv[1] : "build";
  std::vector<unsigned> thread_counts;
  for (int i = 2; i < argc; ++i) thread_counts.push_back(static_cast<unsigned>(std::atoi(argv[i])));
  if (thread_counts.empty()) thread_counts = {1, 16};
  const unsigned most = *std::max_element(thread_counts.begin(), thread_counts.end());
  std::vector<cudaStream_t> streams(most);
  for (auto& s : streams) {
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
      std::fprintf(stderr, "batched_pairs: no CUDA stream (no GPU?)\n");
      return 1;
    }
  }
  for (const int max_exponent : {20, 22, 24, 26}) {
    std::vector<vram::bench::BatchedPlan> plans;
    for (unsigned t = 0; t < most; ++t)
      plans.push_back(vram::bench::batched_plan(t, max_exponent, kLive));
    for (const bool ordered : {false, true}) {
      for (const unsigned threads : thread_counts) {
        vram::DevicePool::Options options;
        options.max_cached_bytes = std::size_t{16} << 30;
        without_validation(options);
        vram::DevicePool pool(std::make_shared<vram::DeviceMemoryUpstream>(0), options);
        std::vector<double> rates = vram::bench::threaded_pair_rates(
            threads, kReps, kSeconds, [&](unsigned t, const std::atomic<bool>& stop) {
              const vram::bench::BatchedPlan& plan = plans[t];
              cudaStream_t s = streams[t];
              void* blocks[kLive];
              std::uint64_t pairs = 0;
              while (!stop.load(std::memory_order_relaxed)) {
                for (std::size_t i = 0; i < kLive; ++i) {
                  blocks[i] = ordered ? pool.allocate_async(plan.sizes[i], s)
                                      : pool.allocate(plan.sizes[i]);
                }
                for (std::size_t i : plan.free_order) {
                  if (ordered) {
                    pool.deallocate_async(blocks[i], plan.sizes[i], s);
                  } else {
                    pool.deallocate(blocks[i], plan.sizes[i]);
                  }
                }
                pairs += kLive;
              }
              if (ordered) cudaStreamSynchronize(s);
              return pairs;
            });
        std::sort(rates.begin(), rates.end());
        std::printf("%s %s 2^%d %u %.1f %.1f %.1f\n", label, ordered ? "stream-ordered" : "plain",
                    max_exponent, threads, rates[rates.size() / 2], rates.front(), rates.back());
        std::fflush(stdout);
      }
    }
  }
  for (auto& s : streams) cudaStreamDestroy(s);
  return 0;
}
