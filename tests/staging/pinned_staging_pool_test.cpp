// PinnedStagingPool over host memory (CPU) and over pinned memory with real copies (GPU).
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "gpu_test_policy.hpp"
#include "test_upstreams.hpp"
#include "vram/copy.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/pinned_host_upstream.hpp"
#include "vram/pinned_staging_pool.hpp"
#include "vram/testing/witness.hpp"
#include "vram/units.hpp"
#ifdef VRAM_HAVE_TEST_KERNELS
#include "test_kernels.hpp"
#endif

namespace vram::testing {
namespace {

using namespace vram::literals;

CopyCompleted witness_for(const PooledStaging& staging) {
  return WitnessMint::completed_copy_of(staging);
}

std::shared_ptr<TestUpstream> host_upstream() {
  return std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
}

TEST(PinnedStagingPool, SameSizePageInsReuseOneBuffer) {
  auto upstream = host_upstream();
  PinnedStagingPool pool(upstream);
  for (int i = 0; i < 64; ++i) {
    auto staging = pool.acquire(4_MiB);
    std::memset(staging.data(), 0xAB, staging.len());
    staging.retire(witness_for(staging));
  }
  const auto s = pool.stats();
  EXPECT_EQ(s.pin_calls, 1U);
  EXPECT_EQ(s.reuses, 63U);
  EXPECT_EQ(upstream->allocations(), 1U);
}

TEST(PinnedStagingPool, ChoosesTheSmallestBufferThatFits) {
  PinnedStagingPool pool(host_upstream());
  auto small = pool.acquire(1_MiB);
  auto large = pool.acquire(8_MiB);
  auto medium = pool.acquire(4_MiB);
  const auto* medium_data = medium.data();
  small.retire(witness_for(small));
  large.retire(witness_for(large));
  medium.retire(witness_for(medium));
  auto chosen = pool.acquire(2_MiB);  // fits 4 MiB and 8 MiB: best fit is 4 MiB
  EXPECT_EQ(chosen.data(), medium_data);
  EXPECT_EQ(chosen.capacity(), 4_MiB);
  EXPECT_EQ(chosen.len(), 2_MiB);
  auto bigger = pool.acquire(16_MiB);  // nothing fits: a fresh pin of exactly 16 MiB
  EXPECT_EQ(bigger.capacity(), 16_MiB);
  EXPECT_EQ(pool.stats().pin_calls, 4U);
}

TEST(PinnedStagingPool, RetentionIsBoundedByCount) {
  auto upstream = host_upstream();
  PinnedStagingPool pool(upstream, {.max_buffers = 2, .max_bytes = SIZE_MAX});
  auto a = pool.acquire(1024);
  auto b = pool.acquire(1024);
  auto c = pool.acquire(1024);
  a.retire(witness_for(a));
  b.retire(witness_for(b));
  c.retire(witness_for(c));
  const auto s = pool.stats();
  EXPECT_EQ(s.free_buffers, 2U);
  EXPECT_EQ(s.freed_over_bounds, 1U);
  EXPECT_EQ(upstream->live_bytes(), 2048U);
}

TEST(PinnedStagingPool, RetentionIsBoundedByBytes) {
  auto upstream = host_upstream();
  PinnedStagingPool pool(upstream, {.max_buffers = 8, .max_bytes = 1_MiB + 1});
  auto a = pool.acquire(1_MiB);
  auto b = pool.acquire(1_MiB);
  a.retire(witness_for(a));
  b.retire(witness_for(b));
  EXPECT_EQ(pool.stats().free_buffers, 1U);
  EXPECT_EQ(pool.stats().free_bytes, 1_MiB);
  EXPECT_EQ(upstream->live_bytes(), 1_MiB);
}

TEST(PinnedStagingPool, DroppingWithoutWitnessFreesNeverReuses) {
  auto upstream = host_upstream();
  PinnedStagingPool pool(upstream);
  { auto staging = pool.acquire(1_MiB); }
  auto s = pool.stats();
  EXPECT_EQ(s.freed_without_witness, 1U);
  EXPECT_EQ(s.free_buffers, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  auto next = pool.acquire(1_MiB);  // must pin again: nothing was reused
  EXPECT_EQ(pool.stats().pin_calls, 2U);
  EXPECT_EQ(pool.stats().reuses, 0U);
}

TEST(PinnedStagingPool, IntoInnerThenReleaseReturnsTheBuffer) {
  PinnedStagingPool pool(host_upstream());
  auto staging = pool.acquire(2_MiB);
  const auto* data = staging.data();
  PinnedBuffer raw = staging.into_inner();
  EXPECT_FALSE(staging);
  auto witness = WitnessMint::completed_copy_of(raw);
  pool.retire(std::move(raw), std::move(witness));
  EXPECT_EQ(pool.stats().free_buffers, 1U);
  EXPECT_EQ(pool.acquire(1_MiB).data(), data);
}

TEST(PinnedStagingPool, WitnessOfAnotherBufferIsRefusedAndLosesNothing) {
  auto upstream = host_upstream();
  PinnedStagingPool pool(upstream);
  PinnedStagingPool other_pool(host_upstream());
  {
    auto mine = pool.acquire(1_MiB);
    auto theirs = other_pool.acquire(1_MiB);
    EXPECT_THROW(mine.retire(witness_for(theirs)), InvalidArgument);  // proves nothing here
    const auto s = pool.stats();
    EXPECT_EQ(s.witness_mismatches, 1U);
    EXPECT_EQ(s.free_buffers, 0U);
    EXPECT_TRUE(mine) << "the lease stays with the caller";
    EXPECT_EQ(upstream->live_bytes(), 1_MiB);
  }
  EXPECT_EQ(upstream->live_bytes(), 0U);  // dropped without a witness: freed, not kept
  EXPECT_EQ(pool.stats().freed_without_witness, 1U);
}

TEST(PinnedStagingPool, CountersResetButBuffersStay) {
  PinnedStagingPool::reset_global_counters();
  PinnedStagingPool pool(host_upstream());
  auto staging = pool.acquire(4096);
  staging.retire(witness_for(staging));
  auto again = pool.acquire(4096);
  again.retire(witness_for(again));
  EXPECT_EQ(PinnedStagingPool::global_pin_calls(), 1U);
  EXPECT_EQ(PinnedStagingPool::global_reuses(), 1U);
  pool.reset_counters();
  EXPECT_EQ(pool.stats().pin_calls, 0U);
  EXPECT_EQ(pool.stats().free_buffers, 1U);
  (void)pool.acquire(4096);
  EXPECT_EQ(pool.stats().reuses, 1U);
}

TEST(PinnedStagingPool, CanRetainConcurrentAnswersForTheBounds) {
  PinnedStagingPool pool(host_upstream(), {.max_buffers = 8, .max_bytes = 64_MiB});
  EXPECT_TRUE(pool.can_retain_concurrent(32_MiB, 2));
  EXPECT_FALSE(pool.can_retain_concurrent(33_MiB, 2));
  EXPECT_FALSE(pool.can_retain_concurrent(1, 9));
}

TEST(PinnedStagingPool, ReservePinsAheadWithinBounds) {
  auto upstream = host_upstream();
  PinnedStagingPool pool(upstream, {.max_buffers = 3, .max_bytes = 64_MiB});
  pool.reserve(5, 8_MiB);
  EXPECT_EQ(pool.stats().free_buffers, 3U);
  EXPECT_EQ(pool.stats().pin_calls, 3U);
  auto staging = pool.acquire(8_MiB);
  EXPECT_EQ(pool.stats().reuses, 1U);
  pool.clear();
  EXPECT_EQ(pool.stats().free_buffers, 0U);
}

TEST(PinnedStagingPool, ZeroBytesIsRejected) {
  PinnedStagingPool pool(host_upstream());
  EXPECT_THROW((void)pool.acquire(0), InvalidArgument);
  EXPECT_EQ(pool.stats().pin_calls, 0U);
}

TEST(PinnedStagingPool, BuffersOutliveThePool) {
  auto upstream = host_upstream();
  std::optional<PooledStaging> survivor;
  {
    PinnedStagingPool pool(upstream);
    survivor.emplace(pool.acquire(4096));
  }
  std::memset(survivor->data(), 1, survivor->len());
  survivor->retire(WitnessMint::completed_copy_of(*survivor));
  survivor.reset();
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(PinnedStagingPool, ManyThreadsNeverShareABuffer) {
  auto upstream = host_upstream();
  PinnedStagingPool pool(upstream, {.max_buffers = 4, .max_bytes = 64_MiB});
  constexpr int kThreads = 8;
  std::atomic<int> corrupted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 300; ++i) {
        auto staging = pool.acquire(4096 + 512 * ((t + i) % 4));
        std::memset(staging.data(), t, staging.len());
        std::this_thread::yield();
        for (std::size_t k = 0; k < staging.len(); ++k) {
          if (staging.data()[k] != static_cast<std::byte>(t)) {
            ++corrupted;
            break;
          }
        }
        if (i % 7 == 0) continue;  // dropped without a witness: freed
        staging.retire(witness_for(staging));
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(corrupted.load(), 0);
  const auto s = pool.stats();
  EXPECT_EQ(s.pin_calls + s.reuses, static_cast<std::uint64_t>(kThreads * 300));
  EXPECT_LE(s.free_buffers, 4U);
  EXPECT_EQ(upstream->live_bytes(), s.free_bytes);
}

// --- On the GPU: real pinning and real copies ---------------------------------------

TEST(PinnedStagingPoolGpu, SixtyFourPageInsMakeOnePinCall) {
  VRAM_GPU_TEST_OR_SKIP();
  PinnedStagingPool pool;
  cuda::Stream stream;
  const std::size_t bytes = 4_MiB;
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, bytes), cudaSuccess);
  std::vector<unsigned char> back(bytes);
  for (int page_in = 0; page_in < 64; ++page_in) {
    auto staging = pool.acquire(bytes);
    std::memset(staging.data(), page_in, bytes);
    auto done = copy_to_device(device, staging, stream.get());
    EXPECT_GT(done.elapsed_ms, 0.0F);
    staging.retire(std::move(done.completed));
    ASSERT_EQ(cudaMemcpy(back.data(), device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(back[0], static_cast<unsigned char>(page_in));
    ASSERT_EQ(back[bytes - 1], static_cast<unsigned char>(page_in));
    ASSERT_EQ(std::memcmp(back.data(), back.data() + 1, bytes - 1), 0) << "page-in " << page_in;
  }
  EXPECT_EQ(pool.stats().pin_calls, 1U);
  EXPECT_EQ(pool.stats().reuses, 63U);
  cudaFree(device);
}

TEST(PinnedStagingPoolGpu, BothPinningMethodsGivePinnedMemory) {
  VRAM_GPU_TEST_OR_SKIP();
  for (auto method : {PinningMethod::host_alloc, PinningMethod::touch_register}) {
    PinnedHostUpstream upstream({.method = method});
    void* block = upstream.allocate(8_MiB);
    cudaPointerAttributes attributes{};
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, block), cudaSuccess);
    EXPECT_EQ(attributes.type, cudaMemoryTypeHost) << "memory is not page-locked";
    upstream.deallocate(block, 8_MiB);
  }
}

#ifdef VRAM_HAVE_TEST_KERNELS
TEST(PinnedStagingPoolGpu, PendingCopyWithholdsTheWitnessUntilTheCopyIsDone) {
  VRAM_GPU_TEST_OR_SKIP();
  PinnedStagingPool pool;
  cuda::Stream stream;
  const std::size_t bytes = 64_MiB;
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, bytes), cudaSuccess);
  auto staging = pool.acquire(bytes);
  std::memset(staging.data(), 0x5A, bytes);
  // A kernel spinning ~200 ms ahead of the copy on the same stream keeps the copy queued.
  launch_spin_then_fill(device, 1, 0, 200'000'000ull, stream.get());
  PendingCopy copy = copy_to_device_async(device, staging, stream.get());
  EXPECT_FALSE(copy.ready()) << "the copy cannot be done while the kernel ahead of it runs";
  CopyResult result = std::move(copy).wait_timed();
  EXPECT_TRUE(copy.ready());  // NOLINT(bugprone-use-after-move): consumed reads as ready
  EXPECT_GT(result.elapsed_ms, 0.0F);
  EXPECT_TRUE(stream.ready());
  staging.retire(std::move(result.completed));
  EXPECT_EQ(pool.stats().free_buffers, 1U);
  std::vector<unsigned char> back(bytes);
  ASSERT_EQ(cudaMemcpy(back.data(), device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back[12345], 0x5A);
  EXPECT_EQ(back[bytes - 1], 0x5A);
  cudaFree(device);
}
#endif

}  // namespace
}  // namespace vram::testing
