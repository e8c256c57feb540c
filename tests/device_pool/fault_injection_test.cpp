// Fault injection: an upstream that fails on a schedule. The pools turn every failure into
// vram::OutOfMemory (or a successful retry after trim), keep their counters true, leak
// nothing (upstream live bytes == cached + in use after every fault) and keep serving.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "test_upstreams.hpp"
#include "vram/device_pool.hpp"
#include "vram/pinned_staging_pool.hpp"
#include "vram/testing/witness.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

void expect_nothing_lost(const DevicePool& pool, const TestUpstream& upstream) {
  const auto s = pool.stats();
  ASSERT_EQ(s.bytes_reserved, upstream.live_bytes());
  ASSERT_EQ(s.bytes_reserved, s.bytes_in_use + s.bytes_cached);
  ASSERT_EQ(upstream.bad_frees(), 0U);
}

TEST(FaultInjection, EveryNthUpstreamCallFails) {
  for (std::uint64_t every : {2u, 3u, 7u}) {
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(),
                                                   TestUpstream::Options{.fail_every = every});
    DevicePool pool(upstream, {.max_cached_bytes = 1_MiB, .validate_deallocations = true});
    std::mt19937 random(static_cast<unsigned>(every));
    std::vector<DevicePool::Lease> live;
    std::uint64_t thrown = 0;
    for (int step = 0; step < 2000; ++step) {
      if (random() % 3 != 0 || live.empty()) {
        try {
          live.push_back(pool.acquire(256 * (1 + random() % 512)));
        } catch (const OutOfMemory& error) {
          ++thrown;
          EXPECT_GT(error.requested_bytes(), 0U);
          expect_nothing_lost(pool, *upstream);
        }
      } else {
        live.erase(live.begin() + static_cast<long>(random() % live.size()));
      }
    }
    live.clear();
    expect_nothing_lost(pool, *upstream);
    const auto s = pool.stats();
    // misses count every upstream call, failed ones included (a segment that failed is
    // asked again at the block's own size, then again after trim).
    EXPECT_EQ(upstream->injected_failures(), s.misses - s.upstream_allocations);
    EXPECT_LE(thrown, s.oom_retries);
    EXPECT_GT(upstream->injected_failures(), 0U) << "the schedule must have fired";
    EXPECT_EQ(s.bytes_in_use, 0U);
  }
}

TEST(FaultInjection, FailureOnceAtAByteTotalIsAbsorbedByTheRetry) {
  auto upstream = std::make_shared<TestUpstream>(
      std::make_shared<HostMemoryUpstream>(), TestUpstream::Options{.fail_once_at_total = 10_MiB});
  DevicePool pool(upstream, {.validate_deallocations = true});
  std::vector<DevicePool::Lease> live;
  for (int i = 0; i < 20; ++i) live.push_back(pool.acquire(1_MiB));  // 11th call fails once
  EXPECT_EQ(upstream->injected_failures(), 1U);
  // Absorbed by asking for a segment of just the block, or by trim + retry.
  EXPECT_LE(pool.stats().oom_retries, 1U);
  EXPECT_EQ(pool.stats().bytes_in_use, 20_MiB);
  expect_nothing_lost(pool, *upstream);
}

TEST(FaultInjection, StagingPoolPinFailuresThrowAndLeaveCountersTrue) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(),
                                                 TestUpstream::Options{.fail_every = 2});
  PinnedStagingPool pool(upstream);
  std::uint64_t failures = 0;
  for (int i = 0; i < 10; ++i) {
    try {
      auto staging = pool.acquire(1_MiB + static_cast<std::size_t>(i) * 4096);  // no reuse fits
      staging.retire(WitnessMint::completed_copy_of(staging));
    } catch (const OutOfMemory&) {
      ++failures;
    }
  }
  const auto s = pool.stats();
  EXPECT_EQ(failures, upstream->injected_failures());
  EXPECT_EQ(s.pin_calls, upstream->allocations());
  EXPECT_EQ(upstream->live_bytes(), s.free_bytes);
  auto staging = pool.acquire(4096);  // still serving
  EXPECT_TRUE(staging);
}

}  // namespace
}  // namespace vram::testing
