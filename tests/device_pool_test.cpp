// DevicePool behaviour beyond the contract: validation of releases, the per-thread tier
// (trim epochs, thread exit), destruction with live leases, moves, peaks.
#include <gtest/gtest.h>

#include <thread>

#include "test_upstreams.hpp"
#include "vram/device_pool.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

DevicePool::Options validating() {
  DevicePool::Options o;
  o.validate_releases = true;
  return o;
}

TEST(DevicePool, DoubleReleaseIsRejectedAndCounted) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, validating());
  void* block = pool.allocate(4096);
  pool.deallocate(block, 4096);
  ::testing::internal::CaptureStderr();
  pool.deallocate(block, 4096);
  const std::string message = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(message.find("double release"), std::string::npos) << message;
  EXPECT_EQ(pool.stats().invalid_releases, 1U);
  // The block was cached once, not twice: two acquires give two different blocks.
  void* a = pool.allocate(4096);
  void* b = pool.allocate(4096);
  EXPECT_NE(a, b);
  pool.deallocate(a, 4096);
  pool.deallocate(b, 4096);
}

TEST(DevicePool, ForeignPointerAndWrongSizeAreRejected) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), validating());
  int local = 0;
  ::testing::internal::CaptureStderr();
  pool.deallocate(&local, sizeof local);
  void* block = pool.allocate(4096);
  pool.deallocate(block, 64_KiB);  // wrong size class
  const std::string message = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(message.find("never handed out"), std::string::npos) << message;
  EXPECT_NE(message.find("does not match"), std::string::npos) << message;
  EXPECT_EQ(pool.stats().invalid_releases, 2U);
  EXPECT_EQ(pool.stats().bytes_cached, 0U);
  pool.deallocate(block, 4096);  // the right release still works
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

TEST(DevicePool, TrimOnAnotherThreadReachesThisThreadsCacheAtItsNextCall) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, validating());
  pool.deallocate(pool.allocate(4096), 4096);  // parked in this thread's cache
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 4096U);
  std::thread([&] { pool.trim(0); }).join();
  EXPECT_EQ(upstream->live_bytes(), 4096U);  // not reachable from the other thread yet
  pool.deallocate(pool.allocate(256), 256);  // next call here frees the old block
  EXPECT_EQ(upstream->live_bytes(), 256U);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(DevicePool, ThreadExitHandsItsCacheToTheSharedTier) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, validating());
  std::thread([&] { pool.deallocate(pool.allocate(4096), 4096); }).join();
  const auto s = pool.stats();
  EXPECT_EQ(s.bytes_cached_in_threads, 0U);
  EXPECT_EQ(s.bytes_cached, 4096U);
  EXPECT_EQ(s.acquires, 1U);          // counters of the exited thread are kept
  void* again = pool.allocate(4096);  // served from the shared ring
  EXPECT_EQ(upstream->allocations(), 1U);
  pool.deallocate(again, 4096);
}

TEST(DevicePool, DestroyedWithLiveLeasesKeepsThemSafe) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Lease survivor;
  DevicePool::Lease other_thread_survivor;
  {
    DevicePool pool(upstream, validating());
    survivor = pool.acquire(4096);
    other_thread_survivor = pool.acquire(8192);
    pool.deallocate(pool.allocate(256), 256);  // something cached
    ::testing::internal::CaptureStderr();
  }
  const std::string warning = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warning.find("still leased"), std::string::npos) << warning;
  EXPECT_EQ(upstream->live_bytes(), 4096U + 8192U);  // cache freed, leases intact
  std::thread([&] { other_thread_survivor.reset(); }).join();
  EXPECT_EQ(upstream->live_bytes(), 4096U);
  survivor.reset();  // last one: memory back upstream, bookkeeping freed
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(DevicePool, MovedPoolKeepsItsBlocksAndLeases) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool first(upstream, validating());
  auto lease = first.acquire(4096);
  DevicePool second(std::move(first));
  lease.reset();
  EXPECT_EQ(second.stats().bytes_cached, 4096U);
  DevicePool third(std::make_shared<HostMemoryUpstream>());
  third = std::move(second);
  EXPECT_EQ(third.stats().bytes_cached, 4096U);
}

TEST(DevicePool, ResetPeakStartsANewWindow) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), validating());
  { auto big = pool.acquire(8_MiB); }
  pool.trim(0);
  EXPECT_EQ(pool.stats().peak_bytes_reserved, 8_MiB);
  pool.reset_peak();
  auto small = pool.acquire(4096);
  EXPECT_EQ(pool.stats().peak_bytes_reserved, 4096U);
}

TEST(DevicePool, LeaseReleaseHandsOwnershipToTheCaller) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), validating());
  auto lease = pool.acquire(1000);
  EXPECT_EQ(lease.size(), 1000U);
  void* raw = lease.release();
  EXPECT_FALSE(lease);
  EXPECT_EQ(pool.stats().bytes_in_use, 1024U);
  pool.deallocate(raw, 1000);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

TEST(DevicePool, ThreadCacheCanBeTurnedOff) {
  DevicePool::Options options = validating();
  options.thread_cache_blocks = 0;
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), options);
  pool.deallocate(pool.allocate(4096), 4096);
  EXPECT_EQ(pool.stats().bytes_cached_in_threads, 0U);
  EXPECT_EQ(pool.stats().bytes_cached, 4096U);
}

}  // namespace
}  // namespace vram::testing

namespace vram::testing {
namespace {

TEST(DevicePool, ThreadCacheIsBoundedInBytes) {
  DevicePool::Options options;
  options.validate_releases = true;
  options.thread_cache_max_bytes = 8192;
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), options);
  std::vector<DevicePool::Lease> leases;
  for (int i = 0; i < 4; ++i) leases.push_back(pool.acquire(4096));
  leases.clear();
  const auto s = pool.stats();
  EXPECT_EQ(s.bytes_cached_in_threads, 8192U);
  EXPECT_EQ(s.bytes_cached, 4U * 4096);
}

}  // namespace
}  // namespace vram::testing
