// Hostile review (helper, branch misuse-pools): misuse and bad input of DevicePool and
// StreamOrderedPool. Each test asserts what a demanding user should get; the report lists
// which ones fail on the library as it stands.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <typeinfo>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gpu_test_policy.hpp"
#include "test_upstreams.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/device_pool.hpp"
#include "vram/stream_ordered_pool.hpp"
#include "vram/units.hpp"
#ifdef VRAM_HAVE_TEST_KERNELS
#include "test_kernels.hpp"
#endif

namespace vram::testing {
namespace {

using namespace vram::literals;

cudaStream_t fake_stream(std::uintptr_t id) { return reinterpret_cast<cudaStream_t>(id); }

// A host upstream that promises a different alignment than HostMemoryUpstream's 256 (as
// PinnedHostUpstream promises 4096). The memory itself is what the inner upstream gives.
class AlignedUpstream final : public Upstream {
 public:
  AlignedUpstream(std::shared_ptr<Upstream> inner, std::size_t alignment)
      : inner_(std::move(inner)), alignment_(alignment) {}
  void* allocate(std::size_t bytes) override {
    // Over-allocate so the block really is aligned to what we promise.
    const std::size_t padded = bytes + alignment_;
    char* raw = static_cast<char*>(inner_->allocate(padded));
    const auto addr = reinterpret_cast<std::uintptr_t>(raw);
    char* aligned = raw + ((alignment_ - addr % alignment_) % alignment_);
    std::lock_guard lock(mutex_);
    origin_[aligned] = {raw, padded};
    return aligned;
  }
  void deallocate(void* block, std::size_t) noexcept override {
    std::pair<char*, std::size_t> raw{};
    {
      std::lock_guard lock(mutex_);
      auto it = origin_.find(block);
      if (it == origin_.end()) return;
      raw = it->second;
      origin_.erase(it);
    }
    inner_->deallocate(raw.first, raw.second);
  }
  MemoryKind kind() const noexcept override { return inner_->kind(); }
  std::string_view name() const noexcept override { return "aligned"; }
  std::size_t alignment() const noexcept override { return alignment_; }

 private:
  std::shared_ptr<Upstream> inner_;
  std::size_t alignment_;
  std::mutex mutex_;
  std::unordered_map<void*, std::pair<char*, std::size_t>> origin_;
};

// ---------------------------------------------------------------------------------------
// DevicePool: moved-from objects. The calls run in a child process (EXPECT_EXIT) only so
// that the crash found here does not take the whole test binary down: the child exits 0
// when the moved-from handle behaves (InvalidArgument / harmless no-op), else it crashes
// (SIGSEGV today) or exits 1.

TEST(MisusePoolsDeathTest, MovedFromDevicePoolAllocateThrowsInvalidArgument) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
        DevicePool source(upstream);
        DevicePool target(std::move(source));
        int ok = 0;
        try {
          (void)source.allocate(4096);  // NOLINT(bugprone-use-after-move)
        } catch (const InvalidArgument&) {
          ++ok;
        }
        try {
          (void)source.acquire(4096);  // NOLINT(bugprone-use-after-move)
        } catch (const InvalidArgument&) {
          ++ok;
        }
        std::exit(ok == 2 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(MisusePoolsDeathTest, MovedFromDevicePoolDeallocateStatsAndTrimAreHarmless) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
        DevicePool source(upstream);
        void* block = source.allocate(4096);
        DevicePool target(std::move(source));
        // noexcept release on the moved-from handle: must not crash, must not take the block.
        source.deallocate(block, 4096);  // NOLINT(bugprone-use-after-move)
        target.deallocate(block, 4096);
        std::exit(target.stats().bytes_in_use == 0 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      {
        DevicePool source(std::make_shared<HostMemoryUpstream>());
        DevicePool target(std::move(source));
        (void)source.stats();  // NOLINT(bugprone-use-after-move)
        source.trim(0);
        source.reset_peak();
        (void)source.block_bytes(4096);
        (void)source.uses_virtual_memory();
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

// ---------------------------------------------------------------------------------------
// DevicePool: alignment vs the upstream's promise

TEST(MisusePoolsDevicePool, AlignmentAbove256IsRejectedOrHonouredOverA4KiBUpstream) {
  // PinnedHostUpstream reports alignment() == 4096; a pool over it accepts alignment 4096.
  auto upstream = std::make_shared<AlignedUpstream>(std::make_shared<HostMemoryUpstream>(), 4096);
  DevicePool pool(upstream);
  std::vector<std::pair<void*, std::size_t>> blocks;
  for (int i = 0; i < 8; ++i) {
    void* block = nullptr;
    try {
      block = pool.allocate(300, 4096);
    } catch (const InvalidArgument&) {
      continue;  // refusing is fine (the header says: alignment above 256 is refused)
    }
    blocks.emplace_back(block, 300);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block) % 4096, 0U)
        << "allocate(300, 4096) returned " << block << " (block " << i
        << "), not 4096-byte aligned";
  }
  for (int i = 0; i < 4; ++i) {
    void* block = nullptr;
    try {
      block = pool.allocate(3_MiB + 512, 4096);
    } catch (const InvalidArgument&) {
      continue;
    }
    blocks.emplace_back(block, 3_MiB + 512);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block) % 4096, 0U)
        << "allocate(3 MiB + 512, 4096) returned " << block << ", not 4096-byte aligned";
  }
  for (auto [block, bytes] : blocks) pool.deallocate(block, bytes);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

TEST(MisusePoolsDevicePool, UpstreamWithSmallerAlignmentGivesAClearErrorOrServes) {
  auto upstream = std::make_shared<AlignedUpstream>(std::make_shared<HostMemoryUpstream>(), 64);
  std::unique_ptr<DevicePool> pool;
  try {
    pool = std::make_unique<DevicePool>(upstream);
  } catch (const InvalidArgument&) {
    SUCCEED() << "rejected at construction";
    return;
  }
  try {
    void* block = pool->allocate(100);  // the default alignment, 256
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block) % 256, 0U);
    pool->deallocate(block, 100);
  } catch (const InvalidArgument& error) {
    const std::string what = error.what();
    EXPECT_EQ(what.find("256 is not a power of two"), std::string::npos)
        << "the default alignment is refused with a message that contradicts itself: " << what;
  }
}

// ---------------------------------------------------------------------------------------
// DevicePool: options that make no sense

DevicePool::Options virtual_options(std::size_t reservation) {
  DevicePool::Options options;
  options.validate_releases = true;
  options.large_tier_memory = LargeTierMemory::virtual_memory;
  options.virtual_reservation_bytes = reservation;
  return options;
}

TEST(MisusePoolsDevicePool, ReservationSmallerThanAGranuleIsRejectedOrOutOfMemory) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  std::unique_ptr<DevicePool> pool;
  try {
    pool = std::make_unique<DevicePool>(upstream, virtual_options(1_MiB));
  } catch (const InvalidArgument&) {
    return;
  }
  EXPECT_THROW((void)pool->allocate(4_MiB), OutOfMemory);
  EXPECT_THROW((void)pool->allocate(1_MiB + 512), OutOfMemory);
  void* small = pool->allocate(4096);  // the small tier still serves
  pool->deallocate(small, 4096);
  pool->trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(MisusePoolsDevicePool, RequestAboveTheVirtualReservationIsOutOfMemoryAndLosesNothing) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, virtual_options(64_MiB));
  void* keep = pool.allocate(8_MiB);
  try {
    (void)pool.allocate(100_MiB);
    FAIL() << "a block larger than the whole reservation cannot be served";
  } catch (const OutOfMemory& error) {
    EXPECT_EQ(error.requested_bytes(), 100_MiB);
  } catch (const std::exception& error) {
    FAIL() << "wrong exception type: " << error.what();
  }
  void* again = pool.allocate(8_MiB);  // keeps serving
  pool.deallocate(again, 8_MiB);
  pool.deallocate(keep, 8_MiB);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(MisusePoolsDevicePool, ExtremeRunAndMapAheadOptionsStillServeAndAccount) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(),
                                                 TestUpstream::Options{.capacity_bytes = 256_MiB});
  for (const std::size_t run : {std::size_t{0}, std::size_t{1}, SIZE_MAX}) {
    for (const std::size_t ahead : {std::size_t{0}, std::size_t{1}, SIZE_MAX}) {
      SCOPED_TRACE("virtual_run_bytes " + std::to_string(run) + " virtual_map_ahead_bytes " +
                   std::to_string(ahead));
      auto options = virtual_options(1_GiB);
      options.virtual_run_bytes = run;
      options.virtual_map_ahead_bytes = ahead;
      {
        DevicePool pool(upstream, options);
        std::vector<void*> blocks;
        for (int i = 0; i < 10; ++i) blocks.push_back(pool.allocate(3_MiB));
        const auto s = pool.stats();
        EXPECT_EQ(s.bytes_reserved, upstream->live_bytes());
        EXPECT_LE(s.bytes_reserved, 256_MiB);
        for (void* b : blocks) pool.deallocate(b, 3_MiB);
        pool.trim(0);
        EXPECT_EQ(upstream->live_bytes(), 0U);
      }
      EXPECT_EQ(upstream->bad_frees(), 0U);
    }
  }
}

TEST(MisusePoolsDevicePool, AbsurdLargeSegmentBytesIsRejectedOrStillServes) {
  for (const std::size_t segment : {std::size_t{0}, std::size_t{1}, std::size_t{3} << 20 | 1,
                                    SIZE_MAX / 2, SIZE_MAX}) {
    SCOPED_TRACE("large_segment_bytes " + std::to_string(segment));
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(),
                                                   TestUpstream::Options{.capacity_bytes = 1_GiB});
    DevicePool::Options options;
    options.validate_releases = true;
    options.large_tier_memory = LargeTierMemory::segments;
    options.large_segment_bytes = segment;
    std::unique_ptr<DevicePool> pool;
    try {
      pool = std::make_unique<DevicePool>(upstream, options);
    } catch (const InvalidArgument&) {
      continue;
    }
    try {
      void* a = pool->allocate(3_MiB);
      void* b = pool->allocate(5_MiB + 512);
      EXPECT_NE(a, b);
      EXPECT_EQ(pool->stats().bytes_reserved, upstream->live_bytes());
      pool->deallocate(a, 3_MiB);
      pool->deallocate(b, 5_MiB + 512);
    } catch (const std::exception& error) {
      ADD_FAILURE() << "a 3 MiB request fails on a 1 GiB upstream: " << error.what();
    }
    pool->trim(0);
    EXPECT_EQ(upstream->live_bytes(), 0U);
    EXPECT_EQ(upstream->bad_frees(), 0U);
  }
}

// ---------------------------------------------------------------------------------------
// DevicePool: stream-ordered release on cudaStreamPerThread (a different stream on every
// thread, one handle value)

TEST(MisusePoolsDevicePool, PerThreadDefaultStreamFreesAreNotHandedToAnotherThreadsStream) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<ManualFence>();
  DevicePool::Options options;
  options.validate_releases = true;
  options.fence = fence;
  DevicePool pool(upstream, options);
  void* keep = pool.allocate(8_MiB);  // so the freed block is not a wholly free segment
  void* freed = nullptr;
  std::thread a([&] {
    freed = pool.allocate_async(4_MiB, cudaStreamPerThread);
    // thread A's per-thread stream still runs work on `freed`
    pool.deallocate_async(freed, 4_MiB, cudaStreamPerThread);
  });
  a.join();
  void* got = nullptr;
  std::thread b([&] { got = pool.allocate_async(4_MiB, cudaStreamPerThread); });
  b.join();
  EXPECT_NE(got, freed) << "thread B's per-thread default stream got the block thread A freed "
                           "on its own per-thread stream, with no marker completed ("
                        << fence->recorded() << " recorded)";
  pool.deallocate_async(got, 4_MiB, cudaStreamPerThread);
  pool.deallocate(keep, 8_MiB);
  pool.trim(0);
}

TEST(MisusePoolsDevicePool, PerThreadDefaultStreamSmallFreesAreNotHandedToAnotherThread) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<ManualFence>();
  DevicePool::Options options;
  options.validate_releases = true;
  options.thread_cache_blocks = 0;  // the free reaches the shared tier at once
  options.fence = fence;
  DevicePool pool(upstream, options);
  void* freed = nullptr;
  std::thread a([&] {
    freed = pool.allocate_async(4096, cudaStreamPerThread);
    pool.deallocate_async(freed, 4096, cudaStreamPerThread);
  });
  a.join();
  void* got = nullptr;
  std::thread b([&] { got = pool.allocate_async(4096, cudaStreamPerThread); });
  b.join();
  EXPECT_NE(got, freed);
  pool.deallocate_async(got, 4096, cudaStreamPerThread);
  pool.trim(0);
}


// ---------------------------------------------------------------------------------------
// DevicePool: release-build (no validation) misuse of large blocks: interior pointer,
// double release, release after trim. (Passes: pins the release-build rule of the header.)
TEST(MisusePoolsDevicePool, LargeBlockInteriorAndDoubleReleaseAreRejectedWithoutValidation) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Options options;
  options.validate_releases = false;
  for (const auto memory : {LargeTierMemory::segments, LargeTierMemory::virtual_memory}) {
    options.large_tier_memory = memory;
    options.virtual_reservation_bytes = 1_GiB;
    DevicePool pool(upstream, options);
    char* block = static_cast<char*>(pool.allocate(4_MiB));
    pool.deallocate(block + 4096, 4_MiB - 4096);  // interior pointer
    pool.deallocate(block + 512, 4_MiB);          // interior pointer, the right size
    EXPECT_EQ(pool.stats().invalid_releases, 2U);
    pool.trim(0);
    pool.deallocate(block, 4_MiB);  // release after trim: accepted once
    pool.deallocate(block, 4_MiB);  // double release: rejected
    EXPECT_EQ(pool.stats().invalid_releases, 3U);
    void* a = pool.allocate(4_MiB);
    void* b = pool.allocate(4_MiB);
    EXPECT_NE(a, b) << "the double release handed one block out twice";
    pool.deallocate(a, 4_MiB);
    pool.deallocate(b, 4_MiB);
    EXPECT_EQ(pool.stats().bytes_in_use, 0U);
    pool.trim(0);
  }
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

// ---------------------------------------------------------------------------------------
// DevicePool: upstreams that misbehave

// Returns null "successfully" (a custom upstream over an allocator that signals failure by
// null, as malloc does).
class NullUpstream final : public Upstream {
 public:
  void* allocate(std::size_t) override { return nullptr; }
  void deallocate(void*, std::size_t) noexcept override {}
  MemoryKind kind() const noexcept override { return MemoryKind::host; }
  std::string_view name() const noexcept override { return "null"; }
};

TEST(MisusePoolsDevicePool, UpstreamReturningNullIsAnErrorNotANullBlock) {
  for (const auto memory : {LargeTierMemory::segments, LargeTierMemory::virtual_memory}) {
    SCOPED_TRACE(memory == LargeTierMemory::segments ? "segments" : "virtual memory");
    DevicePool::Options options;
    options.large_tier_memory = memory;
    options.virtual_reservation_bytes = 1_GiB;
    DevicePool pool(std::make_shared<NullUpstream>(), options);
    for (const std::size_t bytes : {std::size_t{4096}, std::size_t{4_MiB}}) {
      void* block = nullptr;
      try {
        block = pool.allocate(bytes);
      } catch (const std::exception&) {
        continue;  // any clear error is fine
      }
      EXPECT_NE(block, nullptr) << "allocate(" << bytes
                                << ") returned null without throwing (the upstream returned null)";
    }
  }
}

// Throws a CudaError (not OutOfMemory) on a schedule: a driver failure while growing.
TEST(MisusePoolsDevicePool, UpstreamCudaErrorWhileGrowingLeavesThePoolUsableAndExact) {
  class FailingUpstream final : public Upstream {
   public:
    void* allocate(std::size_t bytes) override {
      if (fail) throw CudaError("cudaMalloc", 999, false, "cudaErrorUnknown", "injected");
      return inner.allocate(bytes);
    }
    void deallocate(void* block, std::size_t bytes) noexcept override {
      inner.deallocate(block, bytes);
    }
    MemoryKind kind() const noexcept override { return MemoryKind::host; }
    std::string_view name() const noexcept override { return "failing"; }
    HostMemoryUpstream inner;
    bool fail = false;
  };
  auto upstream = std::make_shared<FailingUpstream>();
  DevicePool::Options options;
  options.validate_releases = true;
  DevicePool pool(upstream, options);
  void* a = pool.allocate(4096);
  void* big = pool.allocate(4_MiB);
  upstream->fail = true;
  EXPECT_THROW((void)pool.allocate(64_MiB), CudaError);  // a new 64 MiB segment: fails
  std::vector<void*> smalls;  // fill the small tier's first 2 MiB segment, then grow it
  try {
    for (int i = 0; i < 64; ++i) smalls.push_back(pool.allocate(512_KiB));
    ADD_FAILURE() << "64 x 512 KiB from a failing upstream";
  } catch (const CudaError&) {
  }
  for (void* b : smalls) pool.deallocate(b, 512_KiB);
  upstream->fail = false;
  void* b = pool.allocate(64_MiB);
  pool.deallocate(b, 64_MiB);
  pool.deallocate(big, 4_MiB);
  pool.deallocate(a, 4096);
  const auto s = pool.stats();
  EXPECT_EQ(s.bytes_in_use, 0U);
  EXPECT_EQ(s.invalid_releases, 0U);
  pool.trim(0);
  EXPECT_EQ(upstream->inner.live_bytes(), 0U);
}

TEST(MisusePoolsDevicePool, AbsurdVirtualReservationIsAClearError) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = virtual_options(SIZE_MAX);
  std::unique_ptr<DevicePool> pool;
  try {
    pool = std::make_unique<DevicePool>(upstream, options);
  } catch (const InvalidArgument&) {
    return;
  }
  try {
    void* block = pool->allocate(4_MiB);
    pool->deallocate(block, 4_MiB);
  } catch (const OutOfMemory& error) {
    SUCCEED() << error.what();
  } catch (const InvalidArgument& error) {
    SUCCEED() << error.what();
  } catch (const std::exception& error) {
    ADD_FAILURE() << "virtual_reservation_bytes = SIZE_MAX: allocate(4 MiB) threw "
                  << typeid(error).name() << ": " << error.what();
  }
  void* small = pool->allocate(4096);
  pool->deallocate(small, 4096);
}

// ---------------------------------------------------------------------------------------
// DevicePool: the per-class ring bound "SIZE_MAX" (no bound but max_cached_bytes) makes the
// first release of a small block allocate a ring for max_cached_bytes / 256 blocks.
TEST(MisusePoolsDevicePool, UnboundedBlocksPerClassDoesNotAllocateHugeRings) {
  DevicePool::Options options;
  options.max_cached_blocks_per_class = SIZE_MAX;
  options.thread_cache_blocks = 0;  // releases go to the ring
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), options);
  void* block = pool.allocate(256);
  const auto start = std::chrono::steady_clock::now();
  pool.deallocate(block, 256);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(std::chrono::duration_cast<std::chrono::milliseconds>(took).count(), 20)
      << "the first release of one 256-byte block took "
      << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
      << " ms (it builds a ring of 4 GiB / 256 = 16 Mi cells, 256 MiB of host memory)";
}

// ---------------------------------------------------------------------------------------
// StreamOrderedPool: options that make no sense

TEST(MisusePoolsStreamOrderedPool, NegativeDeviceOtherThanMinusOneIsInvalidArgument) {
  // -1 means "the current device"; -7 is a typo and must not silently mean the same.
  try {
    StreamOrderedPool pool({.device = -7});
    ADD_FAILURE() << "device -7 accepted (as device " << pool.device() << ")";
  } catch (const InvalidArgument&) {
  } catch (const std::exception& error) {
    ADD_FAILURE() << "device -7: wrong error type " << typeid(error).name() << ": "
                  << error.what();
  }
}

// ---------------------------------------------------------------------------------------
// GPU-only (skip without a device; VRAM_REQUIRE_GPU=1 makes them fail instead).

TEST(MisusePoolsStreamOrderedPoolGpu, WrongSizeReleaseDoesNotWrapBytesInUse) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  cuda::Stream stream;
  void* block = pool.allocate_async(4096, stream.get());
  pool.deallocate_async(block, 8192, stream.get());  // wrong size
  stream.synchronize();
  EXPECT_LE(pool.bytes_in_use(), 4096U)
      << "bytes_in_use after allocating 4096 and releasing it as 8192: " << pool.bytes_in_use();
}

TEST(MisusePoolsStreamOrderedPoolGpu, ReleaseIntoAnotherPrivatePoolIsRefused) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool owner;
  StreamOrderedPool other;
  cuda::Stream stream;
  void* block = owner.allocate_async(1_MiB, stream.get());
  stream.synchronize();
  other.deallocate_async(block, 1_MiB, stream.get());  // the wrong pool
  stream.synchronize();
  EXPECT_EQ(other.bytes_in_use(), 0U)
      << "the wrong pool accepted the release: its bytes_in_use is now " << other.bytes_in_use();
  EXPECT_EQ(owner.pool_used_bytes(), 1_MiB)
      << "the block was freed from its owner's pool through another pool object";
  EXPECT_EQ(other.failed_frees(), 1U) << "a release into the wrong pool should be counted";
  owner.deallocate_async(block, 1_MiB, stream.get());
  stream.synchronize();
}

TEST(MisusePoolsStreamOrderedPoolGpu, ForeignCudaMallocPointerIsRefusedAndStaysAllocated) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  cuda::Stream stream;
  void* foreign = nullptr;
  ASSERT_EQ(cudaMalloc(&foreign, 1_MiB), cudaSuccess);
  ::testing::internal::CaptureStderr();
  pool.deallocate_async(foreign, 1_MiB, stream.get());
  (void)cudaStreamSynchronize(stream.get());
  const std::string err = ::testing::internal::GetCapturedStderr();
  (void)cudaGetLastError();
  EXPECT_EQ(pool.failed_frees(), 1U) << "stderr: " << err;
  EXPECT_EQ(pool.bytes_in_use(), 0U) << "bytes_in_use wrapped: " << pool.bytes_in_use();
  EXPECT_EQ(cudaFree(foreign), cudaSuccess)
      << "the cudaMalloc block was freed through the pool (its owner's cudaFree now fails)";
  (void)cudaGetLastError();
}

TEST(MisusePoolsStreamOrderedPoolGpu, DoubleReleaseIsCountedOnceAndBytesInUseStaysExact) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool pool;
  cuda::Stream stream;
  void* keep = pool.allocate_async(4096, stream.get());
  void* block = pool.allocate_async(4096, stream.get());
  pool.deallocate_async(block, 4096, stream.get());
  stream.synchronize();
  ::testing::internal::CaptureStderr();
  pool.deallocate_async(block, 4096, stream.get());  // double release
  (void)cudaStreamSynchronize(stream.get());
  const std::string err = ::testing::internal::GetCapturedStderr();
  (void)cudaGetLastError();
  EXPECT_EQ(pool.failed_frees(), 1U) << "stderr: " << err;
  EXPECT_EQ(pool.bytes_in_use(), 4096U);
  pool.deallocate_async(keep, 4096, stream.get());
  stream.synchronize();
}

TEST(MisusePoolsStreamOrderedPoolGpu, MovedFromPoolThrowsInvalidArgumentNamingTheMove) {
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
  try {
    source.trim(0);
    (void)source.pool_used_bytes();
    ADD_FAILURE() << "trim/pool_used_bytes on a moved-from pool succeeded silently";
  } catch (const InvalidArgument&) {
  } catch (const std::exception& error) {
    ADD_FAILURE() << "moved-from trim/pool_used_bytes: " << typeid(error).name() << ": "
                  << error.what();
  }
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

TEST(MisusePoolsStreamOrderedPoolGpu, DeviceOutOfRangeIsInvalidArgument) {
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

TEST(MisusePoolsDevicePoolGpu, DeviceOutOfRangeIsInvalidArgument) {
  VRAM_GPU_TEST_OR_SKIP();
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  for (const int device : {-1, count}) {
    SCOPED_TRACE("device " + std::to_string(device));
    try {
      DevicePool pool(device);
      ADD_FAILURE() << "accepted";
    } catch (const InvalidArgument&) {
    } catch (const std::exception& error) {
      ADD_FAILURE() << typeid(error).name() << ": " << error.what();
    }
  }
}

#ifdef VRAM_HAVE_TEST_KERNELS
// Thread A's kernel on its per-thread default stream still writes the block it freed with
// deallocate_async(..., cudaStreamPerThread); thread B asks for the same size on its own
// per-thread default stream (the same handle value, another stream).
TEST(MisusePoolsDevicePoolGpu, PerThreadDefaultStreamBlockIsNotReusedByAnotherThreadEarly) {
  VRAM_GPU_TEST_OR_SKIP();
  DevicePool pool(0);
  constexpr std::size_t kBytes = 4_MiB;
  constexpr std::size_t kWords = kBytes / 4;
  void* keep = pool.allocate(8_MiB);  // the freed block is not a wholly free segment
  void* freed = nullptr;
  std::thread a([&] {
    freed = pool.allocate_async(kBytes, cudaStreamPerThread);
    launch_spin_then_fill(freed, kWords, 0xAAAAAAAAu, 300'000'000, cudaStreamPerThread);
    pool.deallocate_async(freed, kBytes, cudaStreamPerThread);
  });
  a.join();
  void* got = nullptr;
  unsigned long long host = 0;
  std::thread b([&] {
    got = pool.allocate_async(kBytes, cudaStreamPerThread);
    launch_fill(got, kWords, 0xBBBBBBBBu, cudaStreamPerThread);
    cuda::check(cudaStreamSynchronize(cudaStreamPerThread), "cudaStreamSynchronize");
    cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // A's kernel done too
    unsigned long long* mismatches = nullptr;
    cuda::check(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches),
                "cudaMalloc");
    cuda::check(cudaMemset(mismatches, 0, sizeof *mismatches), "cudaMemset");
    launch_count_mismatches(got, kWords, 0xBBBBBBBBu, mismatches, cudaStreamPerThread);
    cuda::check(cudaMemcpy(&host, mismatches, sizeof host, cudaMemcpyDeviceToHost), "cudaMemcpy");
    cudaFree(mismatches);
  });
  b.join();
  EXPECT_NE(got, freed) << "thread B got the block thread A's kernel still wrote";
  EXPECT_EQ(host, 0U) << "thread B's block was overwritten by thread A's kernel";
  pool.deallocate(got, kBytes);
  pool.deallocate(keep, 8_MiB);
  pool.trim(0);
}
#endif

}  // namespace
}  // namespace vram::testing
