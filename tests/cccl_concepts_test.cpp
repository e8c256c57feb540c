// Our resources satisfy the toolkit CCCL's cuda::mr concepts, so they plug into CCCL and
// RMM code (cuda::mr::resource_ref and friends).
#include <gtest/gtest.h>

#include <cuda/memory_resource>

#include "vram/device_pool.hpp"
#include "vram/stream_ordered_pool.hpp"

namespace {

static_assert(cuda::mr::resource<vram::DevicePool>);
static_assert(cuda::mr::resource_with<vram::DevicePool, cuda::mr::device_accessible>);
static_assert(!cuda::mr::resource_with<vram::DevicePool, cuda::mr::host_accessible>);
static_assert(cuda::mr::async_resource<vram::StreamOrderedPool>);
static_assert(cuda::mr::async_resource_with<vram::StreamOrderedPool, cuda::mr::device_accessible>);
static_assert(!std::is_copy_constructible_v<vram::DevicePool::Lease>);

TEST(CcclConcepts, DevicePoolWorksThroughAResourceRef) {
  vram::DevicePool pool(std::make_shared<vram::HostMemoryUpstream>());
  cuda::mr::resource_ref<cuda::mr::device_accessible> ref{pool};
  void* block = ref.allocate(4096, 256);
  ASSERT_NE(block, nullptr);
  ref.deallocate(block, 4096, 256);
  EXPECT_EQ(pool.stats().acquires, 1U);
  EXPECT_EQ(pool.stats().deallocations, 1U);
}

}  // namespace
