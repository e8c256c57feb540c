// Microbenchmarks of the pools' hot paths over host memory: what a warm acquire/release
// costs without any device in the way. `vram bench` measures the same on the GPU against
// the peers; bench/RESULTS.md has both.
#include <benchmark/benchmark.h>

#include <memory>

#include "vram/detail/mpmc_ring.hpp"
#include "vram/device_pool.hpp"
#include "vram/size_classes.hpp"

namespace {

vram::DevicePool& shared_pool() {
  static vram::DevicePool pool(std::make_shared<vram::HostMemoryUpstream>(),
                               vram::DevicePoolOptions{.validate_releases = false});
  return pool;
}

// Warm allocate + deallocate pair; per-thread tier for small sizes, shared rings above.
void BM_DevicePoolPair(benchmark::State& state) {
  auto& pool = shared_pool();
  const auto bytes = static_cast<std::size_t>(state.range(0));
  pool.deallocate(pool.allocate(bytes), bytes);
  for (auto _ : state) {
    void* block = pool.allocate(bytes);
    benchmark::DoNotOptimize(block);
    pool.deallocate(block, bytes);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_DevicePoolPair)
    ->Arg(256)
    ->Arg(64 << 10)
    ->Arg(1 << 20)
    ->Arg(16 << 20)
    ->ThreadRange(1, 8);

void BM_LeasePair(benchmark::State& state) {
  auto& pool = shared_pool();
  for (auto _ : state) {
    auto lease = pool.acquire(4096);
    benchmark::DoNotOptimize(lease.data());
  }
}
BENCHMARK(BM_LeasePair)->ThreadRange(1, 8);

void BM_SizeClassIndex(benchmark::State& state) {
  std::size_t bytes = 1;
  for (auto _ : state) {
    benchmark::DoNotOptimize(vram::SizeClasses::index_for(bytes));
    bytes = bytes * 33 % 1000003 + 1;
  }
}
BENCHMARK(BM_SizeClassIndex);

void BM_MpmcRingPushPop(benchmark::State& state) {
  static vram::detail::MpmcRing<void*> ring(1024);
  void* value = &state;
  for (auto _ : state) {
    ring.try_push(value);
    ring.try_pop(value);
  }
}
BENCHMARK(BM_MpmcRingPushPop)->ThreadRange(1, 8);

}  // namespace

BENCHMARK_MAIN();
