// Microbenchmarks of the pools' hot paths over host memory: what a warm acquire/release
// costs without any device in the way. `vram bench` measures the same on the GPU against
// the peers; bench/RESULTS.md has both.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <random>
#include <vector>

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

// Fresh sizes (micro-benchmark, host memory): each thread keeps 32 blocks live, their
// sizes drawn afresh for every batch (log-uniform from 256 B to the maximum, the argument in
// MiB), and deallocates them in shuffled order; the items are allocate/deallocate pairs.
// The host form of `vram bench --scenario batched`: what threads meeting on the large tier
// cost without a device (the large tier here is in segments over host memory).
vram::DevicePool& fresh_pool(std::size_t max_mib) {
  static vram::DevicePool* pools[65] = {};
  static std::once_flag once[65];
  std::call_once(once[max_mib], [max_mib] {
    pools[max_mib] = new vram::DevicePool(std::make_shared<vram::HostMemoryUpstream>(),
                                          vram::DevicePoolOptions{.validate_deallocations = false});
  });
  return *pools[max_mib];  // lives until exit
}

void BM_DevicePoolFreshSizes(benchmark::State& state) {
  const auto max_mib = static_cast<std::size_t>(state.range(0));
  auto& pool = fresh_pool(max_mib);
  constexpr std::size_t kLive = 32;
  constexpr std::size_t kBatches = 256;
  std::mt19937_64 random(0x5eed + static_cast<std::uint64_t>(state.thread_index()));
  const double lo = std::log(256.0);
  const double hi = std::log(static_cast<double>(max_mib << 20));
  std::uniform_real_distribution<double> draw(lo, hi);
  std::vector<std::size_t> sizes(kBatches * kLive);
  for (std::size_t& bytes : sizes) bytes = static_cast<std::size_t>(std::exp(draw(random)));
  std::vector<std::size_t> order(kLive);
  for (std::size_t i = 0; i < kLive; ++i) order[i] = i;
  std::vector<std::vector<std::size_t>> orders(kBatches, order);
  for (auto& o : orders) std::shuffle(o.begin(), o.end(), random);
  void* blocks[kLive];
  std::size_t batch = 0;
  for (auto _ : state) {
    const std::size_t* batch_sizes = &sizes[batch * kLive];
    for (std::size_t i = 0; i < kLive; ++i) blocks[i] = pool.allocate(batch_sizes[i]);
    for (std::size_t i : orders[batch]) pool.deallocate(blocks[i], batch_sizes[i]);
    batch = (batch + 1) % kBatches;
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(kLive));
}
BENCHMARK(BM_DevicePoolFreshSizes)->Arg(1)->Arg(4)->Arg(64)->ThreadRange(1, 2)->UseRealTime();

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
