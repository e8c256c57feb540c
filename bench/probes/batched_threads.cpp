// A probe, not part of the build: the batched scenario's pattern on one DevicePool, every
// thread kept for the whole run (or restarted every RESTART_MS, as `vram bench` starts its
// threads per timed batch), printing the rate, the CPU time over wall time and what the run
// added to the pool's counters (quiesces, wants, markers, upstream maps, peak reserved).
// Each thread: batches of 32 live blocks of log-uniform size from 256 B to 2^MAX_EXP, drawn
// afresh per batch (256 batches per thread, fixed seeds), freed in shuffled order; its own
// stream. Pool options from the environment: CHUNK (thread_cache.large_chunk_bytes), KEEP
// (thread_cache.large_bytes), CMAX (thread_cache.contended_max_bytes), HEADROOM
// (growth_headroom). HOST=1: host memory, no streams (no GPU needed); with FENCE=1 also
// emulated streams whose markers complete at once. Build here against the library, run on
// the GPU machine:
//   g++ -O2 -std=c++20 -Iinclude -isystem /usr/local/cuda/include/cccl
//     -I/usr/local/cuda/include -DLIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
//     bench/probes/batched_threads.cpp build/libvram.a -L/usr/local/cuda/lib64
//     -lcudart_static -ldl -lrt -lpthread -o batched_threads   (one command line)
//   ./batched_threads THREADS MAX_EXP so|plain SECONDS [RESTART_MS]
// Results: bench/RESULTS.md, "batched".
#include <cuda_runtime_api.h>
#include <sys/resource.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <thread>
#include <vector>
#include "vram/device_pool.hpp"
#include "vram/upstream.hpp"
using namespace vram;
// Host emulation of streams: every marker completes at once (no queued work).
class InstantFence final : public StreamFence {
 public:
  std::atomic<uint64_t> n{0}, q{0};
  std::uint64_t record(cudaStream_t) override { return ++n; }
  bool completed(std::uint64_t) noexcept override { return true; }
  void wait(std::uint64_t) noexcept override {}
  void release(std::uint64_t) noexcept override {}
  void quiesce() noexcept override { ++q; }
  std::uint64_t stream_id(cudaStream_t s) noexcept override { return (uint64_t)s; }
};
struct Plan {
  std::vector<size_t> sizes;
  std::vector<size_t> order;
};
static double cpu() {
  rusage r;
  getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_utime.tv_usec * 1e-6 + r.ru_stime.tv_sec +
         r.ru_stime.tv_usec * 1e-6;
}
static size_t envz(const char* n, size_t d) {
  const char* v = getenv(n);
  return v ? strtoull(v, nullptr, 0) : d;
}
int main(int argc, char** argv) {
  unsigned threads = atoi(argv[1]);
  int mx = atoi(argv[2]);
  bool so = argv[3][0] == 's';
  double seconds = atof(argv[4]);
  double restart_ms = argc > 5 ? atof(argv[5]) : 0;
  DevicePool::Options o;
  o.max_cached_bytes = size_t{16} << 30;
  o.validate_deallocations = false;
  o.thread_cache.large_chunk_bytes = envz("CHUNK", o.thread_cache.large_chunk_bytes);
  o.thread_cache.large_bytes = envz("KEEP", o.thread_cache.large_bytes);
  o.thread_cache.contended_max_bytes = envz("CMAX", o.thread_cache.contended_max_bytes);
  if (getenv("HEADROOM")) o.growth_headroom = atof(getenv("HEADROOM"));
  auto fence = std::make_shared<InstantFence>();
  if (getenv("FENCE")) o.fence = fence;
  std::shared_ptr<Upstream> up;
  if (getenv("HOST"))
    up = std::make_shared<HostMemoryUpstream>();
  else
    up = std::make_shared<DeviceMemoryUpstream>(0);
  DevicePool pool(up, o);
  std::vector<cudaStream_t> streams(threads, nullptr);
  if (!getenv("HOST"))
    for (auto& s : streams) cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (getenv("FENCE"))
    for (unsigned t = 0; t < threads; ++t)
      streams[t] = reinterpret_cast<cudaStream_t>(0x1000 + 64 * t);
  std::vector<std::vector<Plan>> plans(threads);
  for (unsigned t = 0; t < threads; ++t) {
    std::mt19937_64 rnd(4321 + t);
    std::uniform_real_distribution<double> e(8.0, mx);
    for (int b = 0; b < 256; ++b) {
      Plan p;
      for (int i = 0; i < 32; ++i) p.sizes.push_back((size_t)std::exp2(e(rnd)));
      p.order.resize(32);
      std::iota(p.order.begin(), p.order.end(), 0);
      std::shuffle(p.order.begin(), p.order.end(), rnd);
      plans[t].push_back(std::move(p));
    }
  }
  auto run = [&](double secs, bool report) {
    const auto s0 = pool.stats();
    const double c0 = cpu();
    const auto w0 = std::chrono::steady_clock::now();
    std::atomic<uint64_t> total{0};
    double elapsed = 0;
    const double slice = restart_ms > 0 ? restart_ms / 1000 : secs;
    int slices = 0;
    while (elapsed < secs) {
      std::atomic<bool> stop{false};
      std::atomic<unsigned> ready{0};
      std::vector<std::thread> ws;
      for (unsigned t = 0; t < threads; ++t)
        ws.emplace_back([&, t] {
          ready.fetch_add(1);
          while (ready.load() < threads) {
          }
          size_t next = 0;
          void* b[32];
          uint64_t pairs = 0;
          cudaStream_t s = streams[t];
          while (!stop.load(std::memory_order_relaxed)) {
            const Plan& p = plans[t][next];
            next = (next + 1) % plans[t].size();
            for (int i = 0; i < 32; ++i)
              b[i] = so ? pool.allocate_async(p.sizes[i], s) : pool.allocate(p.sizes[i]);
            for (size_t i : p.order) {
              if (so)
                pool.deallocate_async(b[i], p.sizes[i], s);
              else
                pool.deallocate(b[i], p.sizes[i]);
            }
            pairs += 32;
          }
          if (so && s && !getenv("HOST")) cudaStreamSynchronize(s);
          total.fetch_add(pairs);
        });
      while (ready.load() < threads) {
      }
      std::this_thread::sleep_for(std::chrono::duration<double>(slice));
      stop = true;
      for (auto& w : ws) w.join();
      ++slices;
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
    }
    const auto s1 = pool.stats();
    const double c1 = cpu();
    if (report)
      printf(
          "threads %u max 2^%d %s restart_ms %.0f: %.2f M pairs/s, cpu/wall %.2f, quiesces %lu "
          "stream_q %lu wants %lu markers %lu up_alloc %lu up_free %lu misses %lu peak_res %.0f "
          "MiB\n",
          threads, mx, so ? "so" : "plain", restart_ms, total / elapsed / 1e6, (c1 - c0) / elapsed,
          s1.quiesces - s0.quiesces, s1.stream_quiesces - s0.stream_quiesces,
          s1.stream_marker_wants - s0.stream_marker_wants, s1.stream_markers - s0.stream_markers,
          s1.upstream_allocations - s0.upstream_allocations, s1.upstream_frees - s0.upstream_frees,
          s1.misses - s0.misses, s1.peak_bytes_reserved / 1048576.0);
    fflush(stdout);
  };
  run(restart_ms > 0 ? 0.05 : 0.2, false);
  run(seconds, true);
  return 0;
}
