// A probe, not part of the build: the fresh-size batched pattern through the public API only
// (DevicePool(device) with its defaults, allocate/deallocate or allocate_async/
// deallocate_async, stats().peak_bytes_reserved), so that one source builds against this tree
// and against older ones and both builds run side by side on one GPU.
// Each thread: batches of 32 live blocks of log-uniform size from 256 B to 2^MAX_EXP, drawn
// afresh per batch (256 batches per thread, fixed seeds), freed in shuffled order; its own
// non-blocking stream; threads kept for the whole run. Prints all threads' M pairs/s and the
// pool's peak reserved. Build here against a tree's library with NDEBUG (the options'
// defaults are read in this file: without NDEBUG they turn validate_deallocations on, and every
// allocation and deallocation of every thread then leaves the warm path and takes one mutex of
// the pool), run on the GPU machine:
//   g++ -O2 -DNDEBUG -std=c++20 -Iinclude -isystem /usr/local/cuda/include/cccl
//     -I/usr/local/cuda/include -DLIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
//     bench/probes/fresh_sizes_public_api.cpp build/libvram.a -L/usr/local/cuda/lib64
//     -lcudart_static -ldl -lrt -lpthread -o fresh_sizes   (one command line)
//   ./fresh_sizes THREADS MAX_EXP so|plain SECONDS
// `host` instead of so|plain, no GPU needed: one thread, plain calls, a DevicePool over a
// HostMemoryUpstream, SECONDS read as a whole number of passes over the 256 batches (no
// warm-up, no timing), for instruction counts on the build machine: run it under
// `valgrind --tool=callgrind` with 1 and with N passes; the difference over (N - 1) * 8192
// pairs is the instructions of a warm pair. `fenced`: the same with allocate_async/
// deallocate_async on one stream whose fence (below) completes every marker at once and names
// the stream as one id, so the stream-ordered path's instructions count the same way.
// A fifth argument `vm` (host and fenced): the large tier over the host emulation of virtual
// memory (a 4 GiB reservation), as DevicePool(device) backs it on a GPU; the default over a host
// upstream is segments. Trees before the large tier's options were grouped (4faa1e4) build
// with -DPROBE_FLAT_OPTIONS.
// Results: bench/RESULTS.md, "batched".
#include <cuda_runtime_api.h>
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

#ifndef NDEBUG
#error "build with -DNDEBUG: the shipped path runs without release validation"
#endif

// `fenced`: every marker complete at once, the one stream named as one id (as a steady stream
// is named). stream_id has no `override`: trees before the pool named streams lack it.
class NamingFence final : public vram::StreamFence {
 public:
  std::uint64_t record(cudaStream_t) override { return ++recorded_; }
  bool completed(std::uint64_t) noexcept override { return true; }
  void wait(std::uint64_t) noexcept override {}
  void release(std::uint64_t) noexcept override {}
  void quiesce() noexcept override {}
  virtual std::uint64_t stream_id(cudaStream_t) noexcept { return 1; }

 private:
  std::uint64_t recorded_ = 0;
};

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s THREADS MAX_EXP so|plain|host|fenced SECONDS|PASSES [vm]\n",
                 argv[0]);
    return 2;
  }
  const unsigned threads = std::atoi(argv[1]);
  const int max_exp = std::atoi(argv[2]);
  const bool fenced = argv[3][0] == 'f';  // the stream-ordered calls on the host
  const bool so = argv[3][0] == 's' || fenced;
  const bool host = argv[3][0] == 'h' || fenced;
  const double seconds = std::atof(argv[4]);
  if (host && threads != 1) {
    std::fprintf(stderr, "host and fenced: one thread only\n");
    return 2;
  }
  vram::DevicePool::Options options;
  if (fenced) options.fence = std::make_shared<NamingFence>();
  const bool vm = host && argc > 5 && argv[5][0] == 'v';
  if (vm) {
#ifdef PROBE_FLAT_OPTIONS
    options.large_tier_memory = vram::LargeTierMemory::virtual_memory;
    options.virtual_reservation_bytes = std::size_t{4} << 30;
#else
    options.large_tier.memory = vram::LargeTierMemory::virtual_memory;
    options.large_tier.virtual_reservation_bytes = std::size_t{4} << 30;
#endif
  }
  vram::DevicePool pool =
      host ? vram::DevicePool(std::make_shared<vram::HostMemoryUpstream>(), options)
           : vram::DevicePool(0);
  std::vector<cudaStream_t> streams(host ? 0 : threads, nullptr);
  // `fenced`'s stream: a handle no call dereferences (the fence above takes every call on it).
  const cudaStream_t host_stream = fenced ? reinterpret_cast<cudaStream_t>(0x1000) : nullptr;
  for (auto& s : streams) cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  struct Batch {
    std::vector<std::size_t> sizes, order;
  };
  std::vector<std::vector<Batch>> batches(threads);
  for (unsigned t = 0; t < threads; ++t) {
    std::mt19937_64 rnd(4321 + t);
    std::uniform_real_distribution<double> e(8.0, max_exp);
    for (int b = 0; b < 256; ++b) {
      Batch batch;
      for (int i = 0; i < 32; ++i) batch.sizes.push_back((std::size_t)std::exp2(e(rnd)));
      batch.order.resize(32);
      std::iota(batch.order.begin(), batch.order.end(), 0);
      std::shuffle(batch.order.begin(), batch.order.end(), rnd);
      batches[t].push_back(std::move(batch));
    }
  }
  // One batch: its 32 blocks allocated, then freed in its shuffled order (on `s` when so).
  auto run_batch = [&](const Batch& b, cudaStream_t s) {
    void* blocks[32];
    for (int i = 0; i < 32; ++i)
      blocks[i] = so ? pool.allocate_async(b.sizes[i], s) : pool.allocate(b.sizes[i]);
    for (std::size_t i : b.order) {
      if (so)
        pool.deallocate_async(blocks[i], b.sizes[i], s);
      else
        pool.deallocate(blocks[i], b.sizes[i]);
    }
  };
  if (host) {  // one thread (plain calls, or stream-ordered when fenced), a fixed number of passes
    const int passes = static_cast<int>(seconds);
    for (int pass = 0; pass < passes; ++pass) {
      for (const Batch& b : batches[0]) run_batch(b, host_stream);
    }
    std::printf("%s%s max 2^%d: %d passes, %d pairs, peak reserved %.0f MiB\n",
                fenced ? "fenced" : "host", vm ? " vm" : "", max_exp, passes, passes * 8192,
                pool.stats().peak_bytes_reserved / 1048576.0);
    return 0;
  }
  // One timed window: every thread starts together, runs batches until told to stop, then
  // synchronizes its stream (stream-ordered frees complete inside the window).
  auto window = [&](double secs) {
    std::atomic<bool> stop{false};
    std::atomic<unsigned> ready{0};
    std::atomic<std::uint64_t> total{0};
    std::vector<std::thread> workers;
    for (unsigned t = 0; t < threads; ++t)
      workers.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < threads) {
        }
        std::size_t next = 0;
        std::uint64_t pairs = 0;
        while (!stop.load(std::memory_order_relaxed)) {
          run_batch(batches[t][next], streams[t]);
          next = (next + 1) % batches[t].size();
          pairs += 32;
        }
        if (so) cudaStreamSynchronize(streams[t]);
        total.fetch_add(pairs);
      });
    while (ready.load() < threads) {
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(std::chrono::duration<double>(secs));
    stop = true;
    for (auto& w : workers) w.join();
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return total.load() / elapsed / 1e6;
  };
  window(0.2);  // warm-up: the pool grows to the pattern's working set
  const double rate = window(seconds);
  std::printf("threads %u max 2^%d %s: %.3f M pairs/s, peak reserved %.0f MiB\n", threads, max_exp,
              so ? "so" : "plain", rate, pool.stats().peak_bytes_reserved / 1048576.0);
  for (auto s : streams) cudaStreamDestroy(s);
  return 0;
}
