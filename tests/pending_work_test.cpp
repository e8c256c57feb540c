// PendingWork: blocks used by queued work stay out of the free list until the fence fires.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>

#include "gpu_test_policy.hpp"
#include "test_upstreams.hpp"
#include "vram/cuda/event.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/pending_work.hpp"
#include "vram/units.hpp"
#ifdef VRAM_HAVE_TEST_KERNELS
#include "test_kernels.hpp"
#endif

namespace vram::testing {
namespace {

using namespace vram::literals;

// A fence the test fires by hand (host stand-in for a CUDA event).
struct ManualFence {
  std::shared_ptr<std::atomic<bool>> fired = std::make_shared<std::atomic<bool>>(false);
  bool ready() const { return fired->load(); }
  void wait() const {
    while (!fired->load()) {
    }
  }
};

TEST(PendingWork, HoldsBlocksUntilTheFenceFires) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>());
  ManualFence fence;
  auto lease = pool.acquire(4096);
  void* in_flight = lease.data();
  PendingWork<ManualFence> work(fence, std::move(lease));
  EXPECT_FALSE(work.poll());
  auto other = pool.acquire(4096);
  EXPECT_NE(other.data(), in_flight) << "a block of unfinished work was handed out again";
  EXPECT_EQ(pool.stats().bytes_in_use, 2U * 4096);
  fence.fired->store(true);
  EXPECT_TRUE(work.poll());
  EXPECT_TRUE(work.released());
  auto reused = pool.acquire(4096);
  EXPECT_EQ(reused.data(), in_flight);
}

TEST(PendingWork, QueueReleasesFinishedWorkInOrder) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>());
  PendingWorkQueue<ManualFence> queue;
  ManualFence first;
  ManualFence second;
  queue.submit(first, pool.acquire(256), pool.acquire(512));
  queue.submit(second, pool.acquire(1024));
  EXPECT_EQ(queue.collect(), 0U);
  second.fired->store(true);
  EXPECT_EQ(queue.collect(), 0U);  // in order: the first still runs
  first.fired->store(true);
  EXPECT_EQ(queue.collect(), 2U);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

TEST(PendingWork, DestructionWaitsForTheFence) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>());
  ManualFence fence;
  fence.fired->store(true);
  { PendingWork<ManualFence> work(fence, pool.acquire(4096)); }
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

#ifdef VRAM_HAVE_TEST_KERNELS
TEST(PendingWorkGpu, BlockOfARunningKernelIsNotHandedOutUntilItsEventFires) {
  VRAM_GPU_TEST_OR_SKIP();
  DevicePool pool(0);
  cuda::Stream stream;
  const std::size_t bytes = 4_MiB;
  const std::size_t words = bytes / 4;
  auto lease = pool.acquire(bytes);
  void* block = lease.data();
  // A kernel that spins ~200 ms, then writes the whole block.
  launch_spin_then_fill(block, words, 0xC0FFEEu, 200'000'000ull, stream.get());
  cuda::Event done;
  done.record(stream.get());
  PendingWork<cuda::Event> work(std::move(done), std::move(lease));
  EXPECT_FALSE(work.poll()) << "the kernel cannot have finished yet";
  {
    auto meanwhile = pool.acquire(bytes);
    EXPECT_NE(meanwhile.data(), block) << "a block still written by a kernel was handed out";
  }
  work.wait();
  // After the event the block is back in the free list (the shared tier is FIFO, so it is
  // one of the next two of its class), and it holds the kernel's complete output.
  const auto allocations = pool.stats().upstream_allocations;
  auto next = pool.acquire(bytes);
  auto after_next = pool.acquire(bytes);
  EXPECT_TRUE(next.data() == block || after_next.data() == block);
  EXPECT_EQ(pool.stats().upstream_allocations, allocations) << "both must come from the cache";
  unsigned long long* mismatches = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches), cudaSuccess);
  ASSERT_EQ(cudaMemset(mismatches, 0, sizeof *mismatches), cudaSuccess);
  launch_count_mismatches(block, words, 0xC0FFEEu, mismatches, stream.get());
  unsigned long long host = 1;
  ASSERT_EQ(cudaMemcpyAsync(&host, mismatches, sizeof host, cudaMemcpyDeviceToHost, stream.get()),
            cudaSuccess);
  stream.synchronize();
  EXPECT_EQ(host, 0U);
  cudaFree(mismatches);
}
#endif

}  // namespace
}  // namespace vram::testing
