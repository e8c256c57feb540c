// DevicePool under CUDA graph capture: a capture scope sends the capturing stream's (and
// thread's) allocations to a graph pool; memory a captured graph uses is never handed to
// anyone else, and goes back to the shared tiers only when the pool's last use is released.
// Host cases run over host memory with emulated streams; GPU cases capture real graphs and
// check, by content, that launches never write blocks allocated after the capture.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "gpu_test_policy.hpp"
#include "test_upstreams.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/device_pool.hpp"
#include "vram/stream_fence.hpp"
#include "vram/units.hpp"
#ifdef VRAM_HAVE_TEST_KERNELS
#include "test_kernels.hpp"
#endif

namespace vram::testing {
namespace {

using namespace vram::literals;

cudaStream_t host_stream(std::uintptr_t id) { return reinterpret_cast<cudaStream_t>(id); }

DevicePool host_pool(std::shared_ptr<TestUpstream>& upstream) {
  upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Options options;
  options.fence = std::make_shared<ManualFence>();
  options.validate_releases = true;
  return DevicePool(upstream, options);
}

TEST(GraphPoolsDevicePool, BlocksFreedUnderAScopeAreNotHandedOutOutsideIt) {
  std::shared_ptr<TestUpstream> upstream;
  DevicePool pool = host_pool(upstream);
  const auto graph_pool = DevicePool::new_graph_pool();
  const cudaStream_t s = host_stream(0x10);
  std::set<void*> captured;
  {
    auto scope = pool.capture_into(graph_pool, s);
    for (std::size_t bytes : {std::size_t{4096}, std::size_t{4} << 20, std::size_t{64} << 20}) {
      void* a = pool.allocate_async(bytes, s);
      void* b = pool.allocate(bytes);  // the scope's thread, no stream: the graph pool too
      captured.insert(a);
      captured.insert(b);
      pool.deallocate_async(a, bytes, s);
      pool.deallocate(b, bytes);
    }
  }
  EXPECT_GT(pool.stats().graph_pool_bytes, 0U);
  for (int round = 0; round < 3; ++round) {
    for (std::size_t bytes : {std::size_t{4096}, std::size_t{4} << 20, std::size_t{64} << 20}) {
      void* after = pool.allocate(bytes);
      void* on_s = pool.allocate_async(bytes, s);
      EXPECT_EQ(captured.count(after), 0U) << bytes << " B: a captured block handed out";
      EXPECT_EQ(captured.count(on_s), 0U) << bytes << " B: a captured block handed out on s";
      pool.deallocate(after, bytes);
      pool.deallocate_async(on_s, bytes, s);
    }
  }
  pool.release_graph_pool(graph_pool);
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
  EXPECT_EQ(pool.stats().graph_pools, 0U);
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_reserved, 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(GraphPoolsDevicePool, OtherStreamsAndThreadsStayOnTheSharedTiers) {
  std::shared_ptr<TestUpstream> upstream;
  DevicePool pool = host_pool(upstream);
  const auto graph_pool = DevicePool::new_graph_pool();
  auto scope = pool.capture_into(graph_pool, host_stream(0x10));
  void* other_stream = pool.allocate_async(1_MiB, host_stream(0x20));
  void* other_thread = nullptr;
  std::thread([&] { other_thread = pool.allocate(1_MiB); }).join();
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
  pool.deallocate_async(other_stream, 1_MiB, host_stream(0x20));
  pool.deallocate(other_thread, 1_MiB);
  scope.end();
  pool.release_graph_pool(graph_pool);
}

TEST(GraphPoolsDevicePool, SharedPoolReturnsMemoryOnlyAtUseCountZero) {
  std::shared_ptr<TestUpstream> upstream;
  DevicePool pool = host_pool(upstream);
  const auto shared = DevicePool::new_graph_pool();
  const cudaStream_t s = host_stream(0x10);
  void* first = nullptr;
  {
    auto scope = pool.capture_into(shared, s);  // graph A
    first = pool.allocate_async(8_MiB, s);
    pool.deallocate_async(first, 8_MiB, s);
  }
  {
    auto scope = pool.capture_into(shared, s);  // graph B, same pool: may reuse A's block
    void* second = pool.allocate_async(8_MiB, s);
    EXPECT_EQ(second, first) << "captures into one pool replay in order: reuse is allowed";
    pool.deallocate_async(second, 8_MiB, s);
  }
  const std::size_t held = pool.stats().graph_pool_bytes;
  EXPECT_GE(held, 8_MiB);
  pool.release_graph_pool(shared);  // A destroyed
  EXPECT_EQ(pool.stats().graph_pool_bytes, held);
  pool.release_graph_pool(shared);  // B destroyed
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
  void* later = pool.allocate(8_MiB);
  pool.deallocate(later, 8_MiB);
  pool.release_graph_pool(shared);  // one release too many: ignored
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(GraphPoolsDevicePool, LiveGraphBlocksKeepThePoolUntilFreed) {
  std::shared_ptr<TestUpstream> upstream;
  DevicePool pool = host_pool(upstream);
  const auto graph_pool = DevicePool::new_graph_pool();
  const cudaStream_t s = host_stream(0x10);
  void* output = nullptr;
  {
    auto scope = pool.capture_into(graph_pool, s);
    output = pool.allocate_async(2_MiB, s);  // a graph output, freed long after
  }
  pool.release_graph_pool(graph_pool);
  EXPECT_GE(pool.stats().graph_pool_bytes, 2_MiB) << "a live block keeps its pool";
  const std::size_t in_use = pool.stats().bytes_in_use;
  pool.deallocate(output, 2_MiB);
  EXPECT_GE(pool.stats().graph_pool_bytes, 2_MiB) << "rejoins only at a trim or release";
  EXPECT_EQ(pool.stats().bytes_in_use, in_use) << "never inside a release";
  pool.trim(0);
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(GraphPoolsDevicePool, ScopesAreRefusedTwiceAndMovable) {
  std::shared_ptr<TestUpstream> upstream;
  DevicePool pool = host_pool(upstream);
  const auto graph_pool = DevicePool::new_graph_pool();
  auto scope = pool.capture_into(graph_pool, host_stream(0x10));
  EXPECT_THROW((void)pool.capture_into(graph_pool, host_stream(0x10)), InvalidArgument);
  EXPECT_THROW((void)pool.capture_into(graph_pool + 1, host_stream(0x20)), InvalidArgument)
      << "one scope per thread";
  EXPECT_THROW((void)pool.capture_into(graph_pool + 1, nullptr), InvalidArgument)
      << "the legacy stream cannot be captured";
  std::thread([&] {
    EXPECT_THROW((void)pool.capture_into(graph_pool, host_stream(0x30)), InvalidArgument)
        << "captures into one pool follow each other";
  }).join();
  DevicePool::CaptureScope moved(std::move(scope));
  scope.end();  // moved-from: nothing
  moved.end();
  moved.end();  // twice: nothing
  auto again = pool.capture_into(graph_pool, host_stream(0x10));
  again.end();
  const std::uint64_t invalid = pool.stats().invalid_releases;
  pool.release_graph_pool(graph_pool);  // the first graph
  pool.release_graph_pool(graph_pool);  // the second
  EXPECT_EQ(pool.stats().invalid_releases, invalid);
  EXPECT_EQ(pool.stats().graph_pools, 0U);
  pool.release_graph_pool(graph_pool);  // one too many
  pool.release_graph_pool(12345);       // unknown
  EXPECT_EQ(pool.stats().invalid_releases, invalid + 2);
  DevicePool moved_from(std::move(pool));
  EXPECT_THROW((void)pool.capture_into(graph_pool, host_stream(0x10)), InvalidArgument);
  pool.release_graph_pool(graph_pool);  // moved-from: nothing
}

TEST(GraphPoolsDevicePool, DestroyingThePoolWithGraphMemoryFreesItOnce) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  {
    DevicePool::Options options;
    options.fence = std::make_shared<ManualFence>();
    DevicePool pool(upstream, options);
    const auto graph_pool = DevicePool::new_graph_pool();
    auto scope = pool.capture_into(graph_pool, host_stream(0x10));
    pool.deallocate(pool.allocate(3_MiB), 3_MiB);
    scope.end();
  }  // the graph pool was never released
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(GraphPoolsDevicePool, DestroyingThePoolKeepsLiveGraphBlocksLeased) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Lease lease;
  {
    DevicePool::Options options;
    options.fence = std::make_shared<ManualFence>();
    DevicePool pool(upstream, options);
    const auto graph_pool = DevicePool::new_graph_pool();
    {
      auto scope = pool.capture_into(graph_pool, host_stream(0x10));
      lease = pool.acquire(4_MiB);  // a graph output the caller keeps
    }
    pool.release_graph_pool(graph_pool);
  }  // the pool goes first: the lease must stay valid
  EXPECT_GE(upstream->live_bytes(), 4_MiB) << "a leased graph block was freed with the pool";
  lease.reset();
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(GraphPoolsDevicePoolThreads, ConcurrentScopesKeepTheirBlocksApart) {
  std::shared_ptr<TestUpstream> upstream;
  DevicePool pool = host_pool(upstream);
  std::atomic<int> shared_blocks{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const auto graph_pool = DevicePool::new_graph_pool();
      const cudaStream_t s = host_stream(0x100 + static_cast<std::uintptr_t>(t));
      std::set<void*> mine;
      for (int round = 0; round < 50; ++round) {
        auto scope = pool.capture_into(graph_pool, s);
        void* block = pool.allocate_async(std::size_t{1} << (12 + (round % 12)), s);
        mine.insert(block);
        pool.deallocate_async(block, std::size_t{1} << (12 + (round % 12)), s);
      }
      for (int round = 0; round < 50; ++round) {
        void* block = pool.allocate(std::size_t{1} << (12 + (round % 12)));
        if (mine.count(block) != 0) shared_blocks.fetch_add(1);
        pool.deallocate(block, std::size_t{1} << (12 + (round % 12)));
      }
      for (int round = 0; round < 50; ++round) pool.release_graph_pool(graph_pool);
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(shared_blocks.load(), 0);
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

#ifdef VRAM_HAVE_TEST_KERNELS

// Captures `kernel writes a 4 MiB intermediate, frees it` (either allocate form), then
// allocates the same size after the capture, fills it and launches the graph `launches`
// times: the post-capture block must keep its contents.
void capture_then_check_post_capture_blocks(bool async_form, DevicePool::GraphPoolId id,
                                            DevicePool& pool, int launches) {
  constexpr std::size_t kBytes = 4_MiB;
  cuda::Stream capturing;
  cudaGraph_t graph = nullptr;
  {
    auto scope = pool.capture_into(id, capturing.get());
    ASSERT_EQ(cudaStreamBeginCapture(capturing.get(), cudaStreamCaptureModeGlobal), cudaSuccess);
    void* scratch =
        async_form ? pool.allocate_async(kBytes, capturing.get()) : pool.allocate(kBytes);
    launch_fill(scratch, kBytes / 4, 0xDEADBEEFu, capturing.get());
    if (async_form) {
      pool.deallocate_async(scratch, kBytes, capturing.get());
    } else {
      pool.deallocate(scratch, kBytes);
    }
    ASSERT_EQ(cudaStreamEndCapture(capturing.get(), &graph), cudaSuccess)
        << "the pool's calls must not invalidate a global-mode capture";
  }
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  cuda::Stream user;
  std::vector<void*> after;
  for (int i = 0; i < 4; ++i) {
    void* block = async_form ? pool.allocate_async(kBytes, user.get()) : pool.allocate(kBytes);
    launch_fill(block, kBytes / 4, 0x12345678u + static_cast<std::uint32_t>(i), user.get());
    after.push_back(block);
  }
  user.synchronize();
  for (int i = 0; i < launches; ++i) ASSERT_EQ(cudaGraphLaunch(exec, capturing.get()), cudaSuccess);
  capturing.synchronize();
  unsigned long long* mismatches = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches), cudaSuccess);
  ASSERT_EQ(cudaMemset(mismatches, 0, sizeof *mismatches), cudaSuccess);
  for (int i = 0; i < 4; ++i) {
    launch_count_mismatches(after[static_cast<std::size_t>(i)], kBytes / 4,
                            0x12345678u + static_cast<std::uint32_t>(i), mismatches, user.get());
  }
  unsigned long long host = 0;
  ASSERT_EQ(cudaMemcpyAsync(&host, mismatches, sizeof host, cudaMemcpyDeviceToHost, user.get()),
            cudaSuccess);
  user.synchronize();
  EXPECT_EQ(host, 0U) << "a graph launch wrote a block allocated after the capture";
  for (void* block : after) {
    if (async_form) {
      pool.deallocate_async(block, kBytes, user.get());
    } else {
      pool.deallocate(block, kBytes);
    }
  }
  EXPECT_EQ(cudaFree(mismatches), cudaSuccess);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  user.synchronize();
}

TEST(GraphPoolsDevicePoolGpu, LaunchesNeverWriteBlocksAllocatedAfterTheCapture) {
  VRAM_GPU_TEST_OR_SKIP();
  for (bool async_form : {false, true}) {
    SCOPED_TRACE(async_form ? "allocate_async" : "allocate");
    DevicePool pool(0);
    const auto id = DevicePool::new_graph_pool();
    capture_then_check_post_capture_blocks(async_form, id, pool, 10);
    EXPECT_GE(pool.stats().graph_pool_bytes, 4_MiB);
    pool.release_graph_pool(id);
    EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
    pool.trim(0);
    EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  }
}

TEST(GraphPoolsDevicePoolGpu, TwoGraphsShareAPool) {
  VRAM_GPU_TEST_OR_SKIP();
  DevicePool pool(0);
  const auto id = DevicePool::new_graph_pool();
  capture_then_check_post_capture_blocks(true, id, pool, 5);
  capture_then_check_post_capture_blocks(false, id, pool, 5);
  pool.release_graph_pool(id);
  EXPECT_GE(pool.stats().graph_pool_bytes, 4_MiB) << "the second graph still uses the pool";
  pool.release_graph_pool(id);
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
}

// A capture whose allocation makes the pool grow (nothing cached yet: a fresh segment or
// mapped granules) leaves the global-mode capture valid.
TEST(GraphPoolsDevicePoolGpu, GrowingDuringAGlobalCaptureKeepsItValid) {
  VRAM_GPU_TEST_OR_SKIP();
  for (auto memory : {LargeTierMemory::automatic, LargeTierMemory::segments}) {
    DevicePool::Options options;
    options.large_tier_memory = memory;
    DevicePool pool(std::make_shared<DeviceMemoryUpstream>(0), options);
    const auto id = DevicePool::new_graph_pool();
    cuda::Stream capturing;
    cudaGraph_t graph = nullptr;
    {
      auto scope = pool.capture_into(id, capturing.get());
      ASSERT_EQ(cudaStreamBeginCapture(capturing.get(), cudaStreamCaptureModeGlobal), cudaSuccess);
      for (std::size_t bytes : {std::size_t{4096}, std::size_t{3} << 20, std::size_t{96} << 20}) {
        void* block = pool.allocate_async(bytes, capturing.get());
        launch_fill(block, bytes / 4, 0x0F0F0F0Fu, capturing.get());
        pool.deallocate_async(block, bytes, capturing.get());
      }
      ASSERT_EQ(cudaStreamEndCapture(capturing.get(), &graph), cudaSuccess);
    }
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, capturing.get()), cudaSuccess);
    capturing.synchronize();
    EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
    pool.release_graph_pool(id);
    pool.trim(0);
    EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  }
}

#endif  // VRAM_HAVE_TEST_KERNELS

}  // namespace
}  // namespace vram::testing
