// DevicePool contract, written once and run over host memory (everywhere) and device
// memory (on the GPU): reuse, zero upstream calls when warm, bounds, trim, out-of-memory
// retry, bad input, usable and distinct blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <thread>
#include <type_traits>
#include <vector>

#include "gpu_test_policy.hpp"
#include "test_upstreams.hpp"
#include "vram/device_pool.hpp"
#include "vram/size_classes.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

template <class Memory>
class DevicePoolContract : public ::testing::Test {
 protected:
  void SetUp() override {
    if constexpr (std::is_same_v<Memory, DeviceMemory>) {
      VRAM_GPU_TEST_OR_SKIP();
    }
  }
  std::shared_ptr<TestUpstream> make_upstream(TestUpstream::Options options = {}) {
    return std::make_shared<TestUpstream>(Memory::make(), options);
  }
  static DevicePool::Options options() {
    DevicePool::Options o;
    o.validate_deallocations = true;
    return o;
  }
};

using MemoryKinds = ::testing::Types<HostMemory, DeviceMemory>;
class MemoryKindNames {
 public:
  template <class T>
  static std::string GetName(int) {
    return T::kName;
  }
};
TYPED_TEST_SUITE(DevicePoolContract, MemoryKinds, MemoryKindNames);

TYPED_TEST(DevicePoolContract, SameClassGetsTheSameBlockBack) {
  auto upstream = this->make_upstream();
  DevicePool pool(upstream, this->options());
  void* first = pool.allocate(1000);
  pool.deallocate(first, 1000);
  void* second = pool.allocate(1024);  // same class (1024 bytes)
  EXPECT_EQ(first, second);
  pool.deallocate(second, 1024);
  EXPECT_EQ(upstream->allocations(), 1U);
}

TYPED_TEST(DevicePoolContract, TenThousandWarmCyclesMakeNoUpstreamCall) {
  auto upstream = this->make_upstream();
  auto options = this->options();
  options.validate_deallocations = false;
  DevicePool pool(upstream, options);
  const std::vector<std::size_t> sizes = {256, 4_KiB, 64_KiB, 1_MiB, 16_MiB};
  for (auto bytes : sizes) pool.deallocate(pool.allocate(bytes), bytes);  // warm up
  const auto before = pool.stats();
  const auto calls_before = upstream->allocations() + upstream->frees();
  for (int cycle = 0; cycle < 10000; ++cycle) {
    const std::size_t bytes = sizes[cycle % sizes.size()];
    pool.deallocate(pool.allocate(bytes), bytes);
  }
  const auto after = pool.stats();
  EXPECT_EQ(upstream->allocations() + upstream->frees(), calls_before);
  EXPECT_EQ(after.upstream_allocations, before.upstream_allocations);
  EXPECT_EQ(after.upstream_frees, before.upstream_frees);
  EXPECT_EQ(after.hits - before.hits, 10000U);
  EXPECT_EQ(after.misses, before.misses);
}

TYPED_TEST(DevicePoolContract, LiveBlocksAreUsableAndDistinct) {
  auto upstream = this->make_upstream();
  DevicePool pool(upstream, this->options());
  std::vector<DevicePool::Lease> leases;
  for (int i = 0; i < 16; ++i) leases.push_back(pool.acquire(64_KiB + 512 * i));
  for (std::size_t i = 0; i < leases.size(); ++i) {
    TypeParam::fill(leases[i].data(), leases[i].size(), static_cast<unsigned char>(i + 1));
  }
  for (std::size_t i = 0; i < leases.size(); ++i) {
    EXPECT_TRUE(
        TypeParam::holds(leases[i].data(), leases[i].size(), static_cast<unsigned char>(i + 1)))
        << "block " << i << " was overwritten: two leases share memory";
  }
  std::set<void*> distinct;
  for (auto& lease : leases) distinct.insert(lease.data());
  EXPECT_EQ(distinct.size(), leases.size());
}

TYPED_TEST(DevicePoolContract, AccountingAddsUp) {
  auto upstream = this->make_upstream();
  DevicePool pool(upstream, this->options());
  auto a = pool.acquire(3000);   // class 3072
  auto b = pool.acquire(1_MiB);  // class 1 MiB
  {
    auto c = pool.acquire(100);  // class 256, returned at scope end
  }
  const auto s = pool.stats();
  EXPECT_EQ(s.bytes_in_use, 3072U + 1_MiB);
  EXPECT_EQ(s.bytes_cached_in_threads, 256U);
  EXPECT_EQ(s.bytes_reserved, s.bytes_in_use + s.bytes_cached);
  EXPECT_EQ(s.bytes_reserved, upstream->live_bytes());
  EXPECT_EQ(s.peak_bytes_reserved, s.bytes_reserved);
  EXPECT_EQ(s.acquires, 3U);
  EXPECT_EQ(s.deallocations, 1U);
}

TYPED_TEST(DevicePoolContract, RetentionIsBoundedByMaxCachedBytes) {
  auto upstream = this->make_upstream();
  auto options = this->options();
  options.max_cached_bytes = 1_MiB;  // no ring can hold two 1 MiB blocks: none is made
  options.thread_cache.blocks = 0;   // only the ring and the segments
  DevicePool pool(upstream, options);
  std::vector<DevicePool::Lease> leases;
  for (int i = 0; i < 4; ++i) leases.push_back(pool.acquire(1_MiB));  // two 2 MiB segments
  EXPECT_EQ(upstream->live_bytes(), 4_MiB);
  leases.pop_back();  // 1 MiB free: within the bound, kept
  EXPECT_EQ(pool.stats().bytes_cached, 1_MiB);
  EXPECT_EQ(upstream->live_bytes(), 4_MiB);
  leases.clear();  // each wholly free segment past the bound goes back
  const auto s = pool.stats();
  EXPECT_EQ(s.bytes_cached_in_rings, 0U);
  EXPECT_EQ(s.bytes_cached, 0U);
  EXPECT_EQ(s.upstream_frees, 2U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TYPED_TEST(DevicePoolContract, RetentionIsBoundedPerClass) {
  auto upstream = this->make_upstream();
  auto options = this->options();
  options.max_cached_blocks_per_class = 2;
  options.thread_cache.blocks = 0;
  DevicePool pool(upstream, options);
  std::vector<DevicePool::Lease> leases;
  for (int i = 0; i < 5; ++i) leases.push_back(pool.acquire(4096));
  leases.clear();
  EXPECT_EQ(pool.stats().bytes_cached_in_rings, 2U * 4096);
  EXPECT_EQ(pool.stats().bytes_reserved, upstream->live_bytes());
}

TYPED_TEST(DevicePoolContract, TrimFreesCacheDownToKeep) {
  auto upstream = this->make_upstream();
  DevicePool pool(upstream, this->options());
  {
    std::vector<DevicePool::Lease> leases;
    for (int i = 0; i < 4; ++i) leases.push_back(pool.acquire(1_MiB));
    leases.push_back(pool.acquire(4096));
  }
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  EXPECT_GE(pool.stats().bytes_cached, 4_MiB + 4096);
  pool.trim(1_MiB);
  EXPECT_LE(pool.stats().bytes_cached, 1_MiB);
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_cached, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TYPED_TEST(DevicePoolContract, OutOfMemoryTrimsTheCacheAndRetriesOnce) {
  auto upstream = this->make_upstream({.capacity_bytes = 4_MiB});
  DevicePool pool(upstream, this->options());
  {
    auto a = pool.acquire(1_MiB);
    auto b = pool.acquire(1_MiB);
  }  // both in this thread's cache: their 2 MiB segment cannot be given back on its own
  ASSERT_EQ(pool.stats().bytes_cached_in_threads, 2_MiB);
  auto big = pool.acquire(3_MiB);  // 2 MiB held + 3 MiB > 4 MiB: needs trim + retry
  EXPECT_TRUE(big);
  const auto s = pool.stats();
  EXPECT_EQ(s.oom_retries, 1U);
  EXPECT_EQ(s.bytes_in_use, 3_MiB);
  EXPECT_EQ(s.bytes_cached_in_threads, 0U);
  EXPECT_EQ(s.bytes_reserved, upstream->live_bytes());
  EXPECT_EQ(upstream->live_bytes(), 3_MiB);
}

TYPED_TEST(DevicePoolContract, OutOfMemoryAfterRetryReportsSizesAndLosesNothing) {
  auto upstream = this->make_upstream({.capacity_bytes = 4_MiB});
  DevicePool pool(upstream, this->options());
  auto held = pool.acquire(3_MiB);
  try {
    (void)pool.acquire(2_MiB);
    FAIL() << "expected vram::OutOfMemory";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.requested_bytes(), 2_MiB);
    EXPECT_EQ(error.in_use_bytes(), 3_MiB);
    EXPECT_NE(std::string(error.what()).find("2097152 bytes requested"), std::string::npos)
        << error.what();
  }
  const auto s = pool.stats();
  EXPECT_EQ(s.bytes_in_use, 3_MiB);
  EXPECT_EQ(s.bytes_reserved, upstream->live_bytes());
  // Still serving afterwards.
  held.reset();
  auto again = pool.acquire(2_MiB);
  EXPECT_TRUE(again);
}

TYPED_TEST(DevicePoolContract, BadRequestsThrowAndLeaveNothingBehind) {
  auto upstream = this->make_upstream();
  DevicePool pool(upstream, this->options());
  EXPECT_THROW((void)pool.allocate(0), InvalidArgument);
  EXPECT_THROW((void)pool.allocate(64, 512), InvalidArgument);
  EXPECT_THROW((void)pool.allocate(64, 3), InvalidArgument);
  EXPECT_THROW((void)pool.allocate(SIZE_MAX), OutOfMemory);
  EXPECT_THROW((void)pool.allocate(SizeClasses::kMaxBytes + 1), std::bad_alloc);
  pool.deallocate(nullptr, 64);  // no-op
  const auto s = pool.stats();
  EXPECT_EQ(s.bytes_reserved, 0U);
  EXPECT_EQ(s.acquires, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TYPED_TEST(DevicePoolContract, ManyThreadsGetDistinctBlocks) {
  auto upstream = this->make_upstream();
  DevicePool pool(upstream, this->options());
  constexpr int kThreads = 8;
  constexpr int kRounds = 200;
  std::vector<std::vector<void*>> seen(kThreads);
  std::vector<std::thread> threads;
  std::atomic<int> overlaps{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        auto lease = pool.acquire(4096);
        auto* words = static_cast<unsigned char*>(lease.data());
        if constexpr (std::is_same_v<TypeParam, HostMemory>) {
          std::memset(words, t + 1, 4096);
          std::this_thread::yield();
          if (!HostMemory::holds(words, 4096, static_cast<unsigned char>(t + 1))) ++overlaps;
        }
        seen[t].push_back(lease.data());
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(overlaps.load(), 0);
  const auto s = pool.stats();
  EXPECT_EQ(s.acquires, static_cast<std::uint64_t>(kThreads * kRounds));
  EXPECT_EQ(s.deallocations, s.acquires);
  EXPECT_EQ(s.bytes_in_use, 0U);
  EXPECT_EQ(s.bytes_reserved, upstream->live_bytes());
  EXPECT_LE(upstream->allocations(), static_cast<std::uint64_t>(kThreads * 2));
}

TYPED_TEST(DevicePoolContract, HeldBlocksAcrossThreadsAreDistinct) {
  auto upstream = this->make_upstream();
  DevicePool pool(upstream, this->options());
  constexpr int kThreads = 8;
  constexpr int kPerThread = 32;
  std::vector<std::vector<DevicePool::Lease>> held(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) held[t].push_back(pool.acquire(8192));
    });
  }
  for (auto& thread : threads) thread.join();
  std::set<void*> distinct;
  for (auto& leases : held) {
    for (auto& lease : leases) distinct.insert(lease.data());
  }
  EXPECT_EQ(distinct.size(), static_cast<std::size_t>(kThreads * kPerThread));
  // Released on other threads than the acquiring ones: accounting still adds up.
  std::vector<std::thread> releasers;
  for (int t = 0; t < kThreads; ++t) {
    releasers.emplace_back([&, t] { held[(t + 1) % kThreads].clear(); });
  }
  for (auto& thread : releasers) thread.join();
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  EXPECT_EQ(pool.stats().bytes_reserved, upstream->live_bytes());
}

}  // namespace
}  // namespace vram::testing
