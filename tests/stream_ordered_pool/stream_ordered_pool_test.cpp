// StreamOrderedPool on the GPU: usable memory, reuse, trim, accounting, zero bytes,
// cross-stream hand-over, private pools, threads without a context, a reset device.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "gpu_test_policy.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/stream_ordered_pool.hpp"
#include "vram/units.hpp"
#ifdef VRAM_HAVE_TEST_KERNELS
#include "test_kernels.hpp"
#endif

namespace vram::testing {
namespace {

using namespace vram::literals;

TEST(StreamOrderedPoolGpu, ServesUsableMemory) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  cuda::Stream stream;
  constexpr std::size_t kWords = 1024;
  void* block = pool.allocate_async(kWords * 4, stream.get());
  ASSERT_NE(block, nullptr);
  std::vector<std::uint32_t> host(kWords, 0);
  // cudaMemsetAsync works bytewise: a repeated byte makes a known word.
  ASSERT_EQ(cudaMemsetAsync(block, 0xAB, kWords * 4, stream.get()), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(host.data(), block, kWords * 4, cudaMemcpyDeviceToHost, stream.get()),
            cudaSuccess);
  stream.synchronize();
  for (std::size_t i = 0; i < kWords; ++i) ASSERT_EQ(host[i], 0xABABABABu) << "word " << i;
  EXPECT_GE(pool.pool_used_bytes(), kWords * 4);
  pool.deallocate_async(block, kWords * 4, stream.get());
  stream.synchronize();
}

TEST(StreamOrderedPoolGpu, ReusesReservedMemoryAndTrimReturnsIt) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  cuda::Stream stream;
  const std::size_t bytes = 4_MiB;
  void* first = pool.allocate_async(bytes, stream.get());
  pool.deallocate_async(first, bytes, stream.get());
  stream.synchronize();
  const std::size_t reserved_after_free = pool.pool_reserved_bytes();
  EXPECT_GE(reserved_after_free, bytes) << "retain-all must keep the freed block reserved";
  void* second = pool.allocate_async(bytes, stream.get());
  stream.synchronize();
  EXPECT_EQ(pool.pool_reserved_bytes(), reserved_after_free) << "realloc must reuse, not grow";
  pool.deallocate_async(second, bytes, stream.get());
  stream.synchronize();
  pool.trim(0);
  EXPECT_LT(pool.pool_reserved_bytes(), reserved_after_free);
}

TEST(StreamOrderedPoolGpu, AccountsSeveralLiveBlocks) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  cuda::Stream stream;
  void* a = pool.allocate_async(4096, stream.get());
  void* b = pool.allocate_async(8192, stream.get());
  void* c = pool.allocate_async(16384, stream.get());
  stream.synchronize();
  const std::size_t used_all = pool.pool_used_bytes();
  EXPECT_GE(used_all, 4096U + 8192U + 16384U);
  pool.deallocate_async(b, 8192, stream.get());
  stream.synchronize();
  const std::size_t used_after = pool.pool_used_bytes();
  EXPECT_LT(used_after, used_all);
  EXPECT_GE(used_after, 4096U + 16384U);
  EXPECT_GE(pool.pool_used_high_water(), used_all);
  pool.deallocate_async(a, 4096, stream.get());
  pool.deallocate_async(c, 16384, stream.get());
  stream.synchronize();
  pool.reset_pool_high_water();
  EXPECT_LE(pool.pool_used_high_water(), used_after);
}

TEST(StreamOrderedPoolGpu, RejectsZeroBytesAndIgnoresNull) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  cuda::Stream stream;
  try {
    (void)pool.allocate_async(0, stream.get());
    FAIL() << "zero bytes must throw";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("Fix:"), std::string::npos);
  }
  pool.deallocate_async(nullptr, 0, stream.get());
  EXPECT_EQ(pool.failed_frees(), 0U);
  EXPECT_THROW((void)pool.allocate_async(64, 4096, ::cuda::stream_ref(stream.get())),
               InvalidArgument);
}

TEST(StreamOrderedPoolGpu, ReleaseThresholdIsSetAndChangeable) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  EXPECT_EQ(pool.release_threshold(), StreamOrderedPool::kRetainAll);
  pool.set_release_threshold(64_MiB);
  EXPECT_EQ(pool.release_threshold(), 64_MiB);
  pool.set_release_threshold(StreamOrderedPool::kRetainAll);
}

TEST(StreamOrderedPoolGpu, OutOfMemoryIsABadAlloc) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  cuda::Stream stream;
  EXPECT_THROW((void)pool.allocate_async(std::size_t{1} << 50, stream.get()), std::bad_alloc);
  void* block = pool.allocate_async(4096, stream.get());  // still serving
  pool.deallocate_async(block, 4096, stream.get());
  stream.synchronize();
}

#ifdef VRAM_HAVE_TEST_KERNELS
TEST(StreamOrderedPoolGpu, CrossStreamReuseWithHandOverKeepsDataCorrect) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  // Without these the driver may add its own dependency or pick other memory, and the test
  // would pass with hand_over deleted: reuse across streams only through an event the
  // allocating stream waits on (what hand_over creates).
  auto* native = static_cast<cudaMemPool_t>(pool.native_handle());
  int off = 0;
  int on = 1;
  ASSERT_EQ(cudaMemPoolSetAttribute(native, cudaMemPoolReuseAllowOpportunistic, &off), cudaSuccess);
  ASSERT_EQ(cudaMemPoolSetAttribute(native, cudaMemPoolReuseAllowInternalDependencies, &off),
            cudaSuccess);
  ASSERT_EQ(cudaMemPoolSetAttribute(native, cudaMemPoolReuseFollowEventDependencies, &on),
            cudaSuccess);
  cuda::Stream first;
  cuda::Stream second;
  const std::size_t bytes = 8_MiB;
  const std::size_t words = bytes / 4;
  void* a = pool.allocate_async(bytes, first.get());
  // ~150 ms kernel writes A on the first stream; A is freed behind it on that stream.
  launch_spin_then_fill(a, words, 0x11111111u, 150'000'000ull, first.get());
  pool.deallocate_async(a, bytes, first.get());
  StreamOrderedPool::hand_over(first.get(), second.get());
  EXPECT_FALSE(first.ready()) << "the first stream's kernel should still run";
  void* b = pool.allocate_async(bytes, second.get());
  EXPECT_EQ(b, a) << "after hand_over the second stream reuses the first stream's block";
  launch_fill(b, words, 0x22222222u, second.get());
  unsigned long long* mismatches = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(mismatches, 0, sizeof *mismatches, second.get()), cudaSuccess);
  launch_count_mismatches(b, words, 0x22222222u, mismatches, second.get());
  unsigned long long host = 1;
  ASSERT_EQ(cudaMemcpyAsync(&host, mismatches, sizeof host, cudaMemcpyDeviceToHost, second.get()),
            cudaSuccess);
  second.synchronize();
  EXPECT_EQ(host, 0U) << "the first stream's kernel overwrote the second stream's block";
  pool.deallocate_async(b, bytes, second.get());
  second.synchronize();
  cudaFree(mismatches);
}
#endif

TEST(StreamOrderedPoolGpu, PrivatePoolsAreCreatedAndDestroyed) {
  VRAM_GPU_TEST_OR_SKIP();
  cuda::Stream stream;
  {
    StreamOrderedPool pool({.release_threshold = 0});
    EXPECT_TRUE(pool.is_private());
    void* block = pool.allocate_async(1_MiB, stream.get());
    pool.deallocate_async(block, 1_MiB, stream.get());
    stream.synchronize();
    EXPECT_EQ(pool.release_threshold(), 0U);
  }
  StreamOrderedPool shareable({.ipc_shareable = true});
  void* block = shareable.allocate_async(2_MiB, stream.get());
  shareable.deallocate_async(block, 2_MiB, stream.get());
  stream.synchronize();
  StreamOrderedPool default_pool({.use_default_pool = true});
  EXPECT_FALSE(default_pool.is_private());
  EXPECT_NE(default_pool.native_handle(), shareable.native_handle());
}

TEST(StreamOrderedPoolGpu, WorksFromAThreadWithNoCurrentContext) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  cuda::Stream stream;
  std::exception_ptr failure;
  std::thread([&] {
    try {
      void* block = pool.allocate_async(1_MiB, stream.get());
      pool.deallocate_async(block, 1_MiB, stream.get());
    } catch (...) {
      failure = std::current_exception();
    }
  }).join();
  stream.synchronize();
  if (failure) std::rethrow_exception(failure);
  EXPECT_EQ(pool.failed_frees(), 0U);
}

TEST(StreamOrderedPoolGpu, SynchronousFormsWork) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  void* block = pool.allocate(4096);
  ASSERT_EQ(cudaMemset(block, 0, 4096), cudaSuccess);
  pool.deallocate(block, 4096);
}

TEST(StreamOrderedPool, IpcWithTheDefaultPoolIsRejectedBeforeAnyCudaCall) {
  try {
    StreamOrderedPool pool({.use_default_pool = true, .ipc_shareable = true});
    FAIL() << "ipc_shareable needs a private pool";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("Fix:"), std::string::npos);
  }
}

// The device's default pool, read through the runtime (not through the class under test).
std::uint64_t default_pool_threshold() {
  cudaMemPool_t pool = nullptr;
  cuda::check(cudaDeviceGetDefaultMemPool(&pool, cuda::Device::current()),
              "cudaDeviceGetDefaultMemPool");
  std::uint64_t value = 0;
  cuda::check(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &value),
              "cudaMemPoolGetAttribute");
  return value;
}

void set_default_pool_threshold(std::uint64_t value) {
  cudaMemPool_t pool = nullptr;
  cuda::check(cudaDeviceGetDefaultMemPool(&pool, cuda::Device::current()),
              "cudaDeviceGetDefaultMemPool");
  cuda::check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &value),
              "cudaMemPoolSetAttribute");
}

TEST(StreamOrderedPoolGpu, DefaultConstructedPoolIsPrivateAndLeavesTheDefaultPoolAlone) {
  VRAM_GPU_TEST_OR_SKIP();
  const std::uint64_t original = default_pool_threshold();
  constexpr std::uint64_t kMarker = 12345;
  set_default_pool_threshold(kMarker);
  {
    StreamOrderedPool pool;
    EXPECT_TRUE(pool.is_private());
    cudaMemPool_t device_default = nullptr;
    ASSERT_EQ(cudaDeviceGetDefaultMemPool(&device_default, cuda::Device::current()), cudaSuccess);
    EXPECT_NE(pool.native_handle(), static_cast<void*>(device_default));
    EXPECT_EQ(pool.release_threshold(), StreamOrderedPool::kRetainAll);
    pool.set_release_threshold(64_MiB);
    EXPECT_EQ(default_pool_threshold(), kMarker) << "a private pool changed the default pool";
  }
  EXPECT_EQ(default_pool_threshold(), kMarker);
  set_default_pool_threshold(original);
}

TEST(StreamOrderedPoolGpu, DefaultPoolThresholdIsChangedOnlyWhenAskedAndRestored) {
  VRAM_GPU_TEST_OR_SKIP();
  const std::uint64_t original = default_pool_threshold();
  constexpr std::uint64_t kMarker = 12345;
  set_default_pool_threshold(kMarker);
  {
    StreamOrderedPool pool({.use_default_pool = true});
    EXPECT_FALSE(pool.is_private());
    EXPECT_EQ(default_pool_threshold(), kMarker) << "changed without being asked";
    EXPECT_EQ(pool.release_threshold(), kMarker);
  }
  EXPECT_EQ(default_pool_threshold(), kMarker);
  {
    StreamOrderedPool pool({.use_default_pool = true, .release_threshold = 0});
    EXPECT_EQ(default_pool_threshold(), 0U);
    pool.set_release_threshold(StreamOrderedPool::kRetainAll);
    EXPECT_EQ(default_pool_threshold(), StreamOrderedPool::kRetainAll);
  }
  EXPECT_EQ(default_pool_threshold(), kMarker) << "not restored at destruction";
  {
    StreamOrderedPool pool({.use_default_pool = true});
    pool.set_release_threshold(1_MiB);
    StreamOrderedPool moved = std::move(pool);
    EXPECT_EQ(default_pool_threshold(), 1_MiB);
  }
  EXPECT_EQ(default_pool_threshold(), kMarker) << "a move lost the value to restore";
  {
    StreamOrderedPool pool({.use_default_pool = true, .release_threshold = 2_MiB});
    set_default_pool_threshold(3_MiB);  // another user of the default pool, after us
  }
  EXPECT_EQ(default_pool_threshold(), 3_MiB) << "destruction undid another user's setting";
  set_default_pool_threshold(original);
}

TEST(StreamOrderedPoolGpu, BytesInUseCountsOnlyThisObject) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool mine({.use_default_pool = true});
  StreamOrderedPool theirs({.use_default_pool = true});
  cuda::Stream stream;
  void* a = mine.allocate_async(4096, stream.get());
  void* b = mine.allocate_async(8192, std::size_t{256}, ::cuda::stream_ref(stream.get()));
  void* other = theirs.allocate_async(1_MiB, stream.get());
  EXPECT_EQ(mine.bytes_in_use(), 4096U + 8192U);
  EXPECT_EQ(theirs.bytes_in_use(), 1_MiB);
  stream.synchronize();
  EXPECT_GE(mine.pool_used_bytes(), 4096U + 8192U + 1_MiB) << "pool-wide: both objects' blocks";
  mine.deallocate_async(b, 8192, 256, ::cuda::stream_ref(stream.get()));
  EXPECT_EQ(mine.bytes_in_use(), 4096U);
  mine.deallocate_async(a, 4096, stream.get());
  theirs.deallocate_async(other, 1_MiB, stream.get());
  EXPECT_EQ(mine.bytes_in_use(), 0U);
  EXPECT_EQ(theirs.bytes_in_use(), 0U);
  void* sync_block = mine.allocate(1024);
  EXPECT_EQ(mine.bytes_in_use(), 1024U);
  mine.deallocate(sync_block, 1024);
  EXPECT_EQ(mine.bytes_in_use(), 0U);
  stream.synchronize();
}

// Last in this file: resets the device, so it creates everything it uses itself.
TEST(StreamOrderedPoolGpu, UseAfterDeviceResetThrowsAndTeardownIsQuiet) {
  VRAM_GPU_TEST_OR_SKIP();
  auto pool = std::make_unique<StreamOrderedPool>(StreamOrderedPoolOptions{});
  void* block = pool->allocate_async(1_MiB, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cudaDeviceReset(), cudaSuccess);
  try {
    (void)pool->allocate_async(1_MiB, nullptr);
    ADD_FAILURE() << "allocating from a pool whose context is gone must throw";
  } catch (const CudaError& error) {
    EXPECT_FALSE(std::string(error.what()).empty());
  } catch (const std::bad_alloc&) {
    // Some drivers report the destroyed pool as out of memory: also a clear failure.
  }
  pool->deallocate_async(block, 1_MiB, nullptr);  // noexcept, must not crash
  pool.reset();                                   // destroy after the context: quiet
  ASSERT_EQ(cudaFree(nullptr), cudaSuccess) << "the device comes back for later tests";
}

// Two objects over the device's default pool share one CUmemoryPool, but each records its
// own blocks and refuses the other's; in cuda::mr, equal resources free each other's
// memory. So an object is equal only to itself, and a refused release loses nothing.
TEST(StreamOrderedPoolIdentityGpu, DefaultPoolObjectsAreEqualOnlyToThemselves) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool a({.use_default_pool = true});
  StreamOrderedPool b({.use_default_pool = true});
  EXPECT_TRUE(a == a);
  EXPECT_FALSE(a == b) << "equal objects must accept each other's blocks";
  EXPECT_EQ(a.native_handle(), b.native_handle());
  cuda::Stream stream;
  void* block = a.allocate_async(1_MiB, stream.get());
  stream.synchronize();
  const std::size_t used = a.pool_used_bytes();
  ::testing::internal::CaptureStderr();
  b.deallocate_async(block, 1_MiB, stream.get());
  (void)::testing::internal::GetCapturedStderr();
  stream.synchronize();
  EXPECT_EQ(b.invalid_releases(), 1U);
  EXPECT_EQ(a.pool_used_bytes(), used) << "refused, so still allocated";
  a.deallocate_async(block, 1_MiB, stream.get());
  stream.synchronize();
  EXPECT_EQ(a.bytes_in_use(), 0U);
  EXPECT_EQ(a.invalid_releases(), 0U);
  StreamOrderedPool moved(std::move(a));
  EXPECT_TRUE(moved == moved);
  EXPECT_FALSE(moved == b);
}

}  // namespace
}  // namespace vram::testing
