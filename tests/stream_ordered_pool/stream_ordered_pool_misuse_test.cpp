// StreamOrderedPool misused: options that make no sense, and on a GPU wrong-size, foreign
// and double releases, a moved-from pool and a device out of range.
#include <gtest/gtest.h>

#include <exception>
#include <typeinfo>

#include "gpu_test_policy.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/stream_ordered_pool.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

TEST(StreamOrderedPoolMisuse, NegativeDeviceOtherThanMinusOneIsInvalidArgument) {
  // -1 means "the current device"; -7 is a typo and must not silently mean the same.
  try {
    StreamOrderedPool pool({.device = -7});
    ADD_FAILURE() << "device -7 accepted (as device " << pool.device() << ")";
  } catch (const InvalidArgument&) {
  } catch (const std::exception& error) {
    ADD_FAILURE() << "device -7: wrong error type " << typeid(error).name() << ": " << error.what();
  }
}

// StreamOrderedPool records what it hands out: wrong-size, foreign and double releases are
// refused before cuMemFreeAsync sees them (a wrong size must not wrap bytes_in_use, and the
// driver must not free another pool's block through this object).
TEST(StreamOrderedPoolMisuseGpu, WrongSizeReleaseIsRefusedAndTheBlockStaysAllocated) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  cuda::Stream stream;
  void* block = pool.allocate_async(4096, stream.get());
  ::testing::internal::CaptureStderr();
  pool.deallocate_async(block, 8192, stream.get());  // wrong size
  const std::string err = ::testing::internal::GetCapturedStderr();
  stream.synchronize();
  EXPECT_EQ(pool.bytes_in_use(), 4096U);
  EXPECT_EQ(pool.invalid_releases(), 1U);
  EXPECT_NE(err.find("allocated with 4096"), std::string::npos) << err;
  EXPECT_GE(pool.pool_used_bytes(), 4096U) << "the block must still be allocated in the pool";
  pool.deallocate_async(block, 4096, stream.get());  // the right size frees it
  stream.synchronize();
  EXPECT_EQ(pool.bytes_in_use(), 0U);
  EXPECT_EQ(pool.invalid_releases(), 1U);
}

TEST(StreamOrderedPoolMisuseGpu, ReleaseIntoAnotherPrivatePoolIsRefused) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool owner;
  StreamOrderedPool other;
  cuda::Stream stream;
  void* block = owner.allocate_async(1_MiB, stream.get());
  stream.synchronize();
  ::testing::internal::CaptureStderr();
  other.deallocate_async(block, 1_MiB, stream.get());  // the wrong pool
  (void)::testing::internal::GetCapturedStderr();
  stream.synchronize();
  EXPECT_EQ(other.bytes_in_use(), 0U);
  EXPECT_EQ(other.invalid_releases(), 1U);
  EXPECT_EQ(owner.pool_used_bytes(), 1_MiB)
      << "the block was freed from its owner's pool through another pool object";
  owner.deallocate_async(block, 1_MiB, stream.get());
  stream.synchronize();
  EXPECT_EQ(owner.bytes_in_use(), 0U);
  EXPECT_EQ(owner.invalid_releases(), 0U);
}

TEST(StreamOrderedPoolMisuseGpu, ForeignCudaMallocPointerIsRefusedAndStaysAllocated) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  cuda::Stream stream;
  void* foreign = nullptr;
  ASSERT_EQ(cudaMalloc(&foreign, 1_MiB), cudaSuccess);
  ::testing::internal::CaptureStderr();
  pool.deallocate_async(foreign, 1_MiB, stream.get());
  const std::string err = ::testing::internal::GetCapturedStderr();
  stream.synchronize();
  EXPECT_EQ(pool.invalid_releases(), 1U);
  EXPECT_EQ(pool.failed_frees(), 0U) << "the driver must not have seen it";
  EXPECT_NE(err.find("did not hand it out"), std::string::npos) << err;
  EXPECT_EQ(pool.bytes_in_use(), 0U);
  EXPECT_EQ(cudaFree(foreign), cudaSuccess) << "the cudaMalloc block was freed through the pool";
}

TEST(StreamOrderedPoolMisuseGpu, DoubleReleaseIsRefusedAndBytesInUseStaysExact) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  cuda::Stream stream;
  void* keep = pool.allocate_async(4096, stream.get());
  void* block = pool.allocate_async(4096, stream.get());
  pool.deallocate_async(block, 4096, stream.get());
  stream.synchronize();
  ::testing::internal::CaptureStderr();
  pool.deallocate_async(block, 4096, stream.get());  // double release
  const std::string err = ::testing::internal::GetCapturedStderr();
  stream.synchronize();
  EXPECT_EQ(pool.invalid_releases(), 1U) << err;
  EXPECT_EQ(pool.failed_frees(), 0U);
  EXPECT_EQ(pool.bytes_in_use(), 4096U);
  pool.deallocate_async(keep, 4096, stream.get());
  stream.synchronize();
  EXPECT_EQ(pool.bytes_in_use(), 0U);
}

TEST(StreamOrderedPoolMisuseGpu, MovedFromPoolThrowsInvalidArgumentNamingTheMove) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool source;
  StreamOrderedPool target(std::move(source));
  cuda::Stream stream;
  try {
    void* block = source.allocate_async(4096, stream.get());  // NOLINT(bugprone-use-after-move)
    ADD_FAILURE() << "a moved-from StreamOrderedPool served " << block;
  } catch (const InvalidArgument&) {
  } catch (const std::exception& error) {
    ADD_FAILURE() << "moved-from allocate_async: " << typeid(error).name() << ": " << error.what();
  }
  EXPECT_THROW(source.trim(0), InvalidArgument);
  EXPECT_THROW((void)source.pool_used_bytes(), InvalidArgument);
  EXPECT_THROW(source.set_release_threshold(0), InvalidArgument);
  // A release through the moved-from handle must not free the new owner's block.
  void* block = target.allocate_async(1_MiB, stream.get());
  stream.synchronize();
  source.deallocate_async(block, 1_MiB, stream.get());
  stream.synchronize();
  EXPECT_EQ(target.pool_used_bytes(), 1_MiB) << "freed through the moved-from handle";
  EXPECT_EQ(source.bytes_in_use(), 0U) << "moved-from bytes_in_use: " << source.bytes_in_use();
  if (target.pool_used_bytes() == 1_MiB) target.deallocate_async(block, 1_MiB, stream.get());
  stream.synchronize();
}

TEST(StreamOrderedPoolMisuseGpu, DeviceOutOfRangeIsInvalidArgument) {
  VRAM_GPU_TEST_OR_SKIP();
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  for (const int device : {-7, count, 1000}) {
    SCOPED_TRACE("device " + std::to_string(device));
    try {
      StreamOrderedPool pool({.device = device});
      ADD_FAILURE() << "accepted, as device " << pool.device();
    } catch (const InvalidArgument&) {
    } catch (const std::exception& error) {
      ADD_FAILURE() << typeid(error).name() << ": " << error.what();
    }
  }
}

}  // namespace
}  // namespace vram::testing
