// The bad-input table (docs/RELIABILITY.md): each row, what it gets.
#include <gtest/gtest.h>

#include "gpu_test_policy.hpp"
#include "test_upstreams.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/device_pool.hpp"
#include "vram/pinned_host_upstream.hpp"
#include "vram/pinned_staging_pool.hpp"
#include "vram/stream_ordered_pool.hpp"
#include "vram/testing/witness.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

TEST(BadInput, ReleaseIntoTheWrongPoolIsRejectedWhenValidating) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Options options;
  options.validate_deallocations = true;
  DevicePool first(upstream, options);
  DevicePool second(upstream, options);
  void* block = first.allocate(4096);
  ::testing::internal::CaptureStderr();
  second.deallocate(block, 4096);
  (void)::testing::internal::GetCapturedStderr();
  EXPECT_EQ(second.stats().invalid_deallocations, 1U);
  EXPECT_EQ(second.stats().bytes_cached, 0U);
  first.deallocate(block, 4096);
  EXPECT_EQ(first.stats().bytes_in_use, 0U);
}

TEST(BadInput, ReleaseWithZeroOrAbsurdBytesIsIgnoredAndCounted) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>());
  int local = 0;
  pool.deallocate(&local, 0);
  pool.deallocate(&local, SIZE_MAX);
  EXPECT_EQ(pool.stats().invalid_deallocations, 2U);
  EXPECT_EQ(pool.stats().bytes_cached, 0U);
}

TEST(BadInput, HostUpstreamRejectsOverflowingSizes) {
  HostMemoryUpstream upstream;
  EXPECT_THROW((void)upstream.allocate(SIZE_MAX), OutOfMemory);
  EXPECT_THROW((void)upstream.allocate(SIZE_MAX - 100), OutOfMemory);
  EXPECT_EQ(upstream.live_bytes(), 0U);
}

TEST(BadInput, NullUpstreamIsRejected) {
  EXPECT_THROW(DevicePool pool(std::shared_ptr<Upstream>{}), InvalidArgument);
  EXPECT_THROW(PinnedStagingPool pool(std::shared_ptr<Upstream>{}), InvalidArgument);
}

TEST(BadInput, StagingPoolAbsurdSizeFailsCleanly) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  PinnedStagingPool pool(upstream);
  EXPECT_THROW((void)pool.acquire(SIZE_MAX), std::bad_alloc);
  EXPECT_EQ(pool.stats().pin_calls, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(BadInputGpu, DevicePoolSizeJustOverTheDeviceIsOutOfMemoryAndLeaksNothing) {
  VRAM_GPU_TEST_OR_SKIP();
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<DeviceMemoryUpstream>(0));
  DevicePool pool(upstream);
  const auto props = cuda::Device::properties(0);
  { auto warm = pool.acquire(1_MiB); }
  try {
    (void)pool.acquire(props.total_memory_bytes + 1);
    FAIL() << "a request larger than the device must fail";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.requested_bytes(), props.total_memory_bytes + 1);
  }
  EXPECT_EQ(pool.stats().oom_retries, 1U);
  EXPECT_EQ(upstream->live_bytes(), pool.stats().bytes_reserved);
  auto after = pool.acquire(1_MiB);  // still serving
  EXPECT_TRUE(after);
  EXPECT_THROW((void)pool.acquire(SIZE_MAX), OutOfMemory);
}

TEST(BadInputGpu, StreamOrderedPoolAbsurdSizes) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  cuda::Stream stream;
  const auto props = cuda::Device::properties(0);
  EXPECT_THROW((void)pool.allocate_async(props.total_memory_bytes + 1, stream.get()),
               std::bad_alloc);
  EXPECT_THROW((void)pool.allocate_async(SIZE_MAX, stream.get()), std::exception);
  void* block = pool.allocate_async(4096, stream.get());
  pool.deallocate_async(block, 4096, stream.get());
  stream.synchronize();
}

TEST(BadInputGpu, PinningAnAbsurdSizeIsAClearError) {
  VRAM_GPU_TEST_OR_SKIP();
  PinnedHostUpstream upstream({.method = PinningMethod::host_alloc});
  try {
    (void)upstream.allocate(std::size_t{1} << 50);
    FAIL() << "pinning a petabyte must fail";
  } catch (const PinningError& error) {
    EXPECT_NE(std::string(error.what()).find("RLIMIT_MEMLOCK"), std::string::npos);
    EXPECT_NE(std::string(error.what()).find("Fix:"), std::string::npos);
  } catch (const std::bad_alloc&) {
  }
}

}  // namespace
}  // namespace vram::testing
