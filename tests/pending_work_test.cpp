// PendingWork: blocks used by queued work stay out of the free list until the fence is ready.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "gpu_test_policy.hpp"
#include "test_fences.hpp"
#include "test_upstreams.hpp"
#include "vram/completion.hpp"
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

// A fence the test completes by hand (host stand-in for a CUDA event).
struct ManualFence {
  std::shared_ptr<std::atomic<bool>> completed = std::make_shared<std::atomic<bool>>(false);
  bool ready() const { return completed->load(); }
  void wait() const {
    while (!completed->load()) {
    }
  }
};

TEST(PendingWork, HoldsBlocksUntilTheFenceIsReady) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>());
  ManualFence fence;
  auto lease = pool.acquire(4096);
  void* in_flight = lease.data();
  PendingWork<ManualFence> work(fence, std::move(lease));
  EXPECT_FALSE(work.poll());
  auto other = pool.acquire(4096);
  EXPECT_NE(other.data(), in_flight) << "a block of unfinished work was handed out again";
  EXPECT_EQ(pool.stats().bytes_in_use, 2U * 4096);
  fence.completed->store(true);
  EXPECT_TRUE(work.poll());
  EXPECT_TRUE(work.released());
  auto reused = pool.acquire(4096);
  EXPECT_EQ(reused.data(), in_flight);
}

TEST(PendingWork, ReadySaysWhetherTheWorkCompletedWithoutReleasingTheBlocks) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>());
  ManualFence fence;
  PendingWork<ManualFence> work(fence, pool.acquire(4096));
  EXPECT_FALSE(work.ready());
  fence.completed->store(true);
  EXPECT_TRUE(work.ready());
  EXPECT_EQ(work.held(), 1U) << "ready() must not release the blocks";
  EXPECT_TRUE(work.poll());
  EXPECT_TRUE(work.ready());  // nothing held
}

TEST(PendingWork, QueueReleasesCompletedWorkInOrder) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>());
  PendingWorkQueue<ManualFence> queue;
  ManualFence first;
  ManualFence second;
  queue.submit(first, pool.acquire(256), pool.acquire(512));
  queue.submit(second, pool.acquire(1024));
  EXPECT_EQ(queue.collect(), 0U);
  second.completed->store(true);
  EXPECT_EQ(queue.collect(), 0U);  // in order: the first still runs
  first.completed->store(true);
  EXPECT_EQ(queue.collect(), 2U);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

TEST(PendingWork, DestructionWaitsForTheFence) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>());
  ManualFence fence;
  fence.completed->store(true);
  { PendingWork<ManualFence> work(fence, pool.acquire(4096)); }
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

// Counts waits; wait() spins until the test completes it.
struct CountingFence {
  std::shared_ptr<std::atomic<bool>> completed = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<std::atomic<int>> waits = std::make_shared<std::atomic<int>>(0);
  bool ready() const { return completed->load(); }
  void wait() const {
    waits->fetch_add(1);
    while (!completed->load()) std::this_thread::yield();
  }
};

static_assert(Completion<ManualFence> && Completion<FiresWhenWaited> && Completion<CountingFence> &&
              Completion<cuda::Event>);

TEST(PendingWork, MoveAssignmentWaitsForTheOldWorkFirst) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>());
  FiresWhenWaited old_fence;
  FiresWhenWaited new_fence;
  PendingWork<FiresWhenWaited> work(old_fence, pool.acquire(4096));
  PendingWork<FiresWhenWaited> replacement(new_fence, pool.acquire(4096));
  work = std::move(replacement);
  EXPECT_EQ(old_fence.waits->load(), 1) << "the old work was dropped without waiting";
  EXPECT_EQ(new_fence.waits->load(), 0);
  EXPECT_EQ(work.held(), 1U);
  EXPECT_TRUE(replacement.released());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(pool.stats().bytes_in_use, 4096U);
  work.wait();
  EXPECT_EQ(new_fence.waits->load(), 1);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

TEST(PendingWork, MoveAssignmentHoldsTheOldBlockUntilItsFenceIsReady) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>());
  CountingFence never_yet;
  auto lease = pool.acquire(4096);
  void* in_flight = lease.data();
  PendingWork<CountingFence> work(never_yet, std::move(lease));
  CountingFence done;
  done.completed->store(true);
  std::atomic<bool> assigned{false};
  std::thread assigner([&] {
    work = PendingWork<CountingFence>(done, std::vector<DevicePool::Lease>{});
    assigned = true;
  });
  while (never_yet.waits->load() == 0) std::this_thread::yield();  // the assignment waits
  EXPECT_FALSE(assigned.load());
  {
    auto other = pool.acquire(4096);
    EXPECT_NE(other.data(), in_flight) << "a block of unfinished work was handed out again";
  }
  never_yet.completed->store(true);
  assigner.join();
  EXPECT_TRUE(assigned.load());
  EXPECT_TRUE(work.released());
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

TEST(PendingWork, MovedFromWorkHoldsNothing) {
  DevicePool pool(std::make_shared<HostMemoryUpstream>());
  FiresWhenWaited fence;
  PendingWork<FiresWhenWaited> work(fence, pool.acquire(4096), pool.acquire(4096));
  PendingWork<FiresWhenWaited> moved(std::move(work));
  EXPECT_TRUE(work.released());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(moved.held(), 2U);
  moved.wait();
  EXPECT_EQ(fence.waits->load(), 1);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
}

#ifdef VRAM_HAVE_TEST_KERNELS
TEST(PendingWorkGpu, BlockOfARunningKernelIsNotHandedOutUntilItsEventIsReady) {
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
