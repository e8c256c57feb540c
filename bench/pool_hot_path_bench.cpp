// Microbenchmarks of the pools' hot paths over host memory: what a warm acquire/release
// costs without any device in the way. `vram bench` measures the same on the GPU against
// the peers; bench/RESULTS.md has both.
#include <benchmark/benchmark.h>

#include <memory>

#include "vram/detail/asymmetric_barrier.hpp"
#include "vram/detail/mpmc_ring.hpp"
#include "vram/device_pool.hpp"
#include "vram/size_classes.hpp"

namespace {

vram::DevicePool& shared_pool() {
  static vram::DevicePool pool(std::make_shared<vram::HostMemoryUpstream>(),
                               vram::DevicePoolOptions{.validate_deallocations = false});
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

// The 256-byte warm pair in a pool whose thread caches use the given handshake mode
// (detail/asymmetric_barrier.hpp): 0 membarrier, 1 fence. The default mode is printed in
// the context (vram_fence_mode).
vram::DevicePool* pool_with_mode(vram::detail::BarrierMode mode) {
  if (!vram::detail::force_barrier_mode_for_testing(mode)) return nullptr;
  auto* pool = new vram::DevicePool(std::make_shared<vram::HostMemoryUpstream>(),
                                    vram::DevicePoolOptions{.validate_deallocations = false});
  vram::detail::reset_barrier_mode_for_testing();
  return pool;  // lives until exit
}

void BM_DevicePoolPairBarrierMode(benchmark::State& state) {
  static vram::DevicePool* const pools[2] = {
      pool_with_mode(vram::detail::BarrierMode::membarrier),
      pool_with_mode(vram::detail::BarrierMode::full_barrier)};
  vram::DevicePool* pool = pools[state.range(0)];
  if (pool == nullptr) {
    state.SkipWithError("this fence mode is not available here");
    return;
  }
  constexpr std::size_t kBytes = 256;
  pool->deallocate(pool->allocate(kBytes), kBytes);
  for (auto _ : state) {
    void* block = pool->allocate(kBytes);
    benchmark::DoNotOptimize(block);
    pool->deallocate(block, kBytes);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_DevicePoolPairBarrierMode)->Arg(0)->Arg(1)->ThreadRange(1, 2);

const bool barrier_mode_in_context = [] {
  benchmark::AddCustomContext("vram_fence_mode", vram::detail::asymmetric_barrier_mode());
  return true;
}();

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
