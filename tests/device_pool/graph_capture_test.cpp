// DevicePool under CUDA graph capture: a capture scope sends the capturing stream's (and
// thread's) allocations to a graph pool; memory a captured graph uses is never handed to
// anyone else, and goes back to the shared tiers only when the pool's last use is released.
// Host cases run over host memory with emulated streams; GPU cases capture real graphs and
// check, by content, that launches never write blocks allocated after the capture.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
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
  options.validate_deallocations = true;
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

TEST(GraphPoolsDevicePool, FreeBlocksOfAPoolAreListedUntilThePoolLetsThemGo) {
  std::shared_ptr<TestUpstream> upstream;
  DevicePool pool = host_pool(upstream);
  const auto graph_pool = DevicePool::new_graph_pool();
  const cudaStream_t s = host_stream(0x10);
  void* kept = nullptr;
  void* freed_small = nullptr;
  void* freed_large = nullptr;
  {
    auto scope = pool.capture_into(graph_pool, s);
    kept = pool.allocate_async(2_MiB, s);
    freed_small = pool.allocate_async(4096, s);
    freed_large = pool.allocate_async(8_MiB, s);
    pool.deallocate_async(freed_small, 4096, s);
    pool.deallocate_async(freed_large, 8_MiB, s);
  }
  std::vector<DevicePool::GraphPoolBlock> free = pool.graph_pool_free_blocks(graph_pool);
  ASSERT_EQ(free.size(), 2U);
  EXPECT_LT(reinterpret_cast<std::uintptr_t>(free[0].block),
            reinterpret_cast<std::uintptr_t>(free[1].block))
      << "by address";
  std::set<void*> listed{free[0].block, free[1].block};
  EXPECT_EQ(listed, (std::set<void*>{freed_small, freed_large}));
  for (const auto& block : free) {
    EXPECT_GE(block.bytes, block.block == freed_small ? 4096U : 8_MiB) << "block bytes";
  }
  EXPECT_TRUE(pool.graph_pool_free_blocks(graph_pool + 1).empty()) << "no such pool";
  pool.release_graph_pool(graph_pool);  // the graph destroyed; `kept` keeps the pool
  pool.deallocate(kept, 2_MiB);
  EXPECT_TRUE(pool.graph_pool_free_blocks(graph_pool).empty())
      << "no use and nothing live: the blocks wait to rejoin the shared tiers";
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  DevicePool moved(std::move(pool));
  // NOLINTNEXTLINE(bugprone-use-after-move): the misuse tested
  EXPECT_TRUE(pool.graph_pool_free_blocks(graph_pool).empty()) << "a moved-from pool";
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
  const std::uint64_t invalid = pool.stats().invalid_deallocations;
  pool.release_graph_pool(graph_pool);  // the first graph
  pool.release_graph_pool(graph_pool);  // the second
  EXPECT_EQ(pool.stats().invalid_deallocations, invalid);
  EXPECT_EQ(pool.stats().graph_pools, 0U);
  pool.release_graph_pool(graph_pool);  // one too many
  pool.release_graph_pool(12345);       // unknown
  EXPECT_EQ(pool.stats().invalid_deallocations, invalid + 2);
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

DevicePool fenced_pool(std::shared_ptr<TestUpstream>& upstream, std::shared_ptr<ManualFence>& fence,
                       bool detect = true) {
  upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  fence = std::make_shared<ManualFence>();
  DevicePool::Options options;
  options.fence = fence;
  options.validate_deallocations = true;
  options.detect_unscoped_capture = detect;
  return DevicePool(upstream, options);
}

// Allocates `bytes` on `s` `rounds` times (and frees it): true when one of them was in
// `captured`.
bool hands_out_any_of(DevicePool& pool, const std::set<void*>& captured, std::size_t bytes,
                      cudaStream_t s, int rounds = 3) {
  bool handed = false;
  for (int i = 0; i < rounds; ++i) {
    void* on_s = pool.allocate_async(bytes, s);
    void* plain = pool.allocate(bytes);
    handed = handed || captured.count(on_s) != 0 || captured.count(plain) != 0;
    pool.deallocate_async(on_s, bytes, s);
    pool.deallocate(plain, bytes);
  }
  return handed;
}

TEST(GraphPoolsDevicePool, UnroutedScopePlacesOnlyWhatItsHostAsks) {
  std::shared_ptr<TestUpstream> upstream;
  DevicePool pool = host_pool(upstream);
  const auto id = DevicePool::new_graph_pool();
  const cudaStream_t s = host_stream(0x10);
  void* before = pool.allocate_async(2_MiB, s);  // allocated before the capture
  std::set<void*> captured{before};
  {
    auto scope = pool.capture_into(id);
    void* placed = scope.allocate(2_MiB);
    captured.insert(placed);
    void* ordinary = pool.allocate_async(2_MiB, s);  // not routed: the host did not ask
    EXPECT_EQ(captured.count(ordinary), 0U);
    EXPECT_EQ(pool.stats().graph_pool_bytes, pool.block_bytes(2_MiB));
    pool.deallocate_async(ordinary, 2_MiB, s);
    scope.deallocate(placed, 2_MiB);
    scope.deallocate(before, 2_MiB);  // freed during the capture: the pool's now
    EXPECT_EQ(pool.stats().graph_pool_bytes, 2 * pool.block_bytes(2_MiB));
    EXPECT_THROW(auto again = pool.capture_into(id), InvalidArgument);  // one scope per pool
  }
  EXPECT_FALSE(hands_out_any_of(pool, captured, 2_MiB, s));
  DevicePool::CaptureScope ended;
  EXPECT_THROW((void)ended.allocate(4096), InvalidArgument);
  pool.release_graph_pool(id);
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(GraphPoolsDevicePool, ACaptureWithoutAScopeKeepsItsBlocksForThatCapture) {
  std::shared_ptr<TestUpstream> upstream;
  std::shared_ptr<ManualFence> fence;
  DevicePool pool = fenced_pool(upstream, fence);
  const cudaStream_t s = host_stream(0x10);
  for (std::size_t bytes : {std::size_t{4096}, std::size_t{4} << 20}) {
    SCOPED_TRACE(bytes);
    void* before = pool.allocate_async(bytes, s);
    fence->set_capture(s, 5);
    void* inside = pool.allocate_async(bytes, s);  // allocated by the capture
    pool.deallocate_async(before, bytes, s);       // freed during it
    pool.deallocate_async(inside, bytes, s);
    void* again = pool.allocate_async(bytes, s);  // the same capture may reuse them
    EXPECT_TRUE(again == before || again == inside);
    pool.deallocate_async(again, bytes, s);
    fence->set_capture(s, 6);  // another capture: never the first one's blocks
    void* other = pool.allocate_async(bytes, s);
    EXPECT_TRUE(other != before && other != inside);
    pool.deallocate_async(other, bytes, s);
    fence->set_capture(s, 0);
    EXPECT_FALSE(hands_out_any_of(pool, {before, inside, other}, bytes, s));
  }
  EXPECT_EQ(pool.stats().unscoped_capture_calls, 8U);  // 3 requests, 1 block taken in, per size
  EXPECT_GT(pool.stats().graph_pool_bytes, 0U);
  pool.trim(0);
  EXPECT_GT(pool.stats().graph_pool_bytes, 0U) << "kept for the pool's life";
}

TEST(GraphPoolsDevicePool, AStreamForkedIntoAScopedCaptureUsesTheScopesPool) {
  std::shared_ptr<TestUpstream> upstream;
  std::shared_ptr<ManualFence> fence;
  // With the default options: routing a forked stream needs no unscoped-capture detection.
  DevicePool pool = fenced_pool(upstream, fence, DevicePool::Options{}.detect_unscoped_capture);
  const auto id = DevicePool::new_graph_pool();
  const cudaStream_t s = host_stream(0x10);
  const cudaStream_t forked = host_stream(0x20);
  std::set<void*> captured;
  {
    auto scope = pool.capture_into(id, s);
    fence->set_capture(s, 9);
    fence->set_capture(forked, 9);
    void* block = pool.allocate_async(8_MiB, forked);
    captured.insert(block);
    pool.deallocate_async(block, 8_MiB, forked);
    fence->set_capture(s, 0);
    fence->set_capture(forked, 0);
  }
  EXPECT_EQ(pool.stats().unscoped_capture_calls, 0U);
  EXPECT_EQ(pool.stats().graph_pool_bytes, pool.block_bytes(8_MiB));
  EXPECT_FALSE(hands_out_any_of(pool, captured, 8_MiB, forked));
  pool.release_graph_pool(id);
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
}

TEST(GraphPoolsDevicePool, ByDefaultACaptureWithoutAScopeFollowsTheOrdinaryRules) {
  std::shared_ptr<TestUpstream> upstream;
  std::shared_ptr<ManualFence> fence;
  DevicePool pool = fenced_pool(upstream, fence, DevicePool::Options{}.detect_unscoped_capture);
  const cudaStream_t s = host_stream(0x10);
  fence->set_capture(s, 5);
  void* inside = pool.allocate_async(1_MiB, s);
  pool.deallocate_async(inside, 1_MiB, s);
  fence->set_capture(s, 0);
  void* after = pool.allocate_async(1_MiB, s);
  EXPECT_EQ(after, inside) << "documented: undefined for graphs, the stream's own block again";
  pool.deallocate_async(after, 1_MiB, s);
  EXPECT_EQ(pool.stats().unscoped_capture_calls, 0U);
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
}

// Markers complete at once; a device synchronize fails while `refuse` is set (as one does
// during another thread's capture).
class RefusingQuiesceFence final : public StreamFence {
 public:
  std::uint64_t record(cudaStream_t) override { return 1; }
  bool completed(std::uint64_t) noexcept override { return true; }
  void wait(std::uint64_t) noexcept override {}
  void release(std::uint64_t) noexcept override {}
  void quiesce() noexcept override {}
  bool try_quiesce() noexcept override { return !refuse.load(); }
  std::atomic<bool> refuse{false};
};

TEST(GraphPoolsDevicePool, AGraphPoolsMemoryWaitsWhileTheDeviceCannotBeSynchronized) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<RefusingQuiesceFence>();
  DevicePool::Options options;
  options.fence = fence;
  DevicePool pool(upstream, options);
  const auto id = DevicePool::new_graph_pool();
  {
    auto scope = pool.capture_into(id, host_stream(0x10));
    void* block = pool.allocate_async(4_MiB, host_stream(0x10));
    pool.deallocate_async(block, 4_MiB, host_stream(0x10));
  }
  fence->refuse = true;
  pool.release_graph_pool(id);
  EXPECT_EQ(pool.stats().graph_pool_bytes, pool.block_bytes(4_MiB))
      << "no synchronize: a launch may still use the block";
  pool.trim(0);
  EXPECT_EQ(pool.stats().graph_pool_bytes, pool.block_bytes(4_MiB));
  fence->refuse = false;
  pool.trim(0);
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
  EXPECT_EQ(pool.stats().bytes_reserved, 0U);
}

// ---- scopes and graph pools misused ------------------------------------------------------

TEST(GraphPoolsDevicePool, AReleaseThroughAnEndedScopeIsAnOrdinaryRelease) {
  std::shared_ptr<TestUpstream> upstream;
  DevicePool pool = host_pool(upstream);
  const auto id = DevicePool::new_graph_pool();
  void* ordinary = pool.allocate(8192);
  auto scope = pool.capture_into(id);
  void* graph_block = scope.allocate(4096);
  scope.end();
  scope.deallocate(graph_block, 4096);  // a graph pool's block: back to its pool
  scope.deallocate(ordinary, 8192);     // any other: to the shared tiers
  EXPECT_EQ(pool.stats().bytes_in_use, pool.stats().graph_pool_bytes);
  pool.release_graph_pool(id);
  pool.trim(0);
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(GraphPoolsDevicePool, AMovedFromScopeReleasesNothingAndSaysSo) {
  std::shared_ptr<TestUpstream> upstream;
  DevicePool pool = host_pool(upstream);
  const auto id = DevicePool::new_graph_pool();
  auto scope = pool.capture_into(id);
  void* block = scope.allocate(4096);
  DevicePool::CaptureScope moved = std::move(scope);
  ::testing::internal::CaptureStderr();
  scope.deallocate(block, 4096);  // NOLINT(bugprone-use-after-move): the misuse tested
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("moved from"), std::string::npos) << said;
  EXPECT_THROW((void)scope.allocate(4096), InvalidArgument);
  moved.deallocate(block, 4096);
  moved.end();
  pool.release_graph_pool(id);
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(GraphPoolsDevicePool, DestroyingThePoolWithAScopeOpenGivesEverythingBackWhenItEnds) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::CaptureScope scope;
  {
    DevicePool::Options options;
    options.fence = std::make_shared<ManualFence>();
    options.validate_deallocations = false;
    DevicePool pool(upstream, options);
    scope = pool.capture_into(DevicePool::new_graph_pool(), host_stream(0x10));
    pool.deallocate(pool.allocate(3_MiB), 3_MiB);  // routed: the graph pool's
    pool.deallocate_async(pool.allocate_async(40_MiB, host_stream(0x10)), 40_MiB,
                          host_stream(0x10));
  }                                       // destroyed with the scope open
  EXPECT_GT(upstream->live_bytes(), 0U);  // the scope's capture may still use it
  scope.end();
  EXPECT_EQ(upstream->live_bytes(), 0U) << "the graph pool's memory stayed after the scope ended";
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(GraphPoolsDevicePool, AScopeOfADestroyedPoolRefusesToAllocate) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  {
    DevicePool::CaptureScope scope;
    {
      DevicePool::Options options;
      options.fence = std::make_shared<ManualFence>();
      DevicePool pool(upstream, options);
      scope = pool.capture_into(DevicePool::new_graph_pool());
    }
    EXPECT_THROW((void)scope.allocate(4_MiB), InvalidArgument);
  }
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(GraphPoolsDevicePool, ReleasingAGraphPoolTwiceWhileItsScopeIsOpenKeepsTheScopesUse) {
  std::shared_ptr<TestUpstream> upstream;
  DevicePool pool = host_pool(upstream);
  const auto id = DevicePool::new_graph_pool();
  auto scope = pool.capture_into(id);
  void* first = scope.allocate(1_MiB);
  pool.release_graph_pool(id);  // the graph's use
  ::testing::internal::CaptureStderr();
  pool.release_graph_pool(id);  // refused: only the scope's use is left
  const std::string said = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("release_graph_pool"), std::string::npos) << said;
  EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
  void* second = scope.allocate(1_MiB);  // still the graph pool's
  EXPECT_EQ(pool.stats().graph_pool_bytes, 2 * pool.block_bytes(1_MiB));
  scope.deallocate(first, 1_MiB);
  scope.deallocate(second, 1_MiB);
  scope.end();  // the last use: the memory rejoins the shared tiers
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// Released graph memory waits only for a moment with no scope open anywhere: the end of the
// last open scope is one.
TEST(GraphPoolsDevicePool, ReleasedGraphMemoryRejoinsWhenTheLastOpenScopeEnds) {
  std::shared_ptr<TestUpstream> upstream;
  DevicePool pool = host_pool(upstream);
  const auto other = DevicePool::new_graph_pool();
  auto open = pool.capture_into(other);
  const auto id = DevicePool::new_graph_pool();
  {
    auto scope = pool.capture_into(id);
    scope.deallocate(scope.allocate(32_MiB), 32_MiB);
  }
  pool.release_graph_pool(id);
  EXPECT_EQ(pool.stats().graph_pool_bytes, pool.block_bytes(32_MiB)) << "a scope is open";
  open.end();
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  // Threads capturing back to back reuse the memory instead of growing.
  const std::size_t reserved = pool.stats().bytes_reserved;
  for (int round = 0; round < 3; ++round) {
    std::thread([&] {
      const auto mine = DevicePool::new_graph_pool();
      {
        auto scope = pool.capture_into(mine);
        scope.deallocate(scope.allocate(32_MiB), 32_MiB);
      }
      pool.release_graph_pool(mine);
    }).join();
  }
  EXPECT_EQ(pool.stats().bytes_reserved, reserved);
  pool.release_graph_pool(other);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(GraphPoolsDevicePool, AnOutOfMemoryRetryReclaimsGraphMemoryGivenUp) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(),
                                                 TestUpstream::Options{.capacity_bytes = 64_MiB});
  auto fence = std::make_shared<RefusingQuiesceFence>();
  DevicePool::Options options;
  options.fence = fence;
  options.large_tier.memory = LargeTierMemory::segments;
  DevicePool pool(upstream, options);
  const auto id = DevicePool::new_graph_pool();
  {
    auto scope = pool.capture_into(id);
    scope.deallocate(scope.allocate(40_MiB), 40_MiB);
  }
  fence->refuse = true;  // the release cannot synchronize: the memory waits
  pool.release_graph_pool(id);
  ASSERT_EQ(pool.stats().graph_pool_bytes, pool.block_bytes(40_MiB));
  fence->refuse = false;
  void* block = nullptr;
  EXPECT_NO_THROW(block = pool.allocate(40_MiB));
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
  EXPECT_EQ(pool.stats().bytes_in_use, pool.block_bytes(40_MiB));
  pool.deallocate(block, 40_MiB);
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// Releases of graph blocks on several threads, racing the pool's destruction (even rounds)
// or each other after it (odd rounds: every release may drain the others' blocks and end
// the bookkeeping's life): every block reaches the upstream once, and nothing is touched
// after the bookkeeping is gone (ASan, TSan).
TEST(GraphPoolsDevicePoolThreads, GraphBlockReleasesRacingThePoolsDestructionLoseNothing) {
  constexpr int kThreads = 4;
  constexpr int kBlocksPerThread = 8;
  for (int round = 0; round < 40; ++round) {
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    std::vector<std::vector<DevicePool::Lease>> leases(kThreads);
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> threads;
    const bool after = round % 2 == 1;
    {
      DevicePool::Options options;
      options.fence = std::make_shared<ManualFence>();
      options.validate_deallocations = false;
      DevicePool pool(upstream, options);
      const auto id = DevicePool::new_graph_pool();
      {
        auto scope = pool.capture_into(id, host_stream(0x10));
        for (auto& mine : leases) {
          for (int i = 0; i < kBlocksPerThread; ++i) {
            mine.push_back(pool.acquire((std::size_t{1} << (12 + (i % 10))) + 256));
          }
        }
      }
      if (round % 4 < 2) pool.release_graph_pool(id);
      for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
          ready.fetch_add(1);
          while (!go.load()) std::this_thread::yield();
          for (auto& lease : leases[t]) lease.reset();
        });
      }
      while (ready.load() < kThreads) std::this_thread::yield();
      if (!after) go.store(true);
    }  // destroyed
    go.store(true);
    for (auto& thread : threads) thread.join();
    ASSERT_EQ(upstream->live_bytes(), 0U) << "round " << round;
    ASSERT_EQ(upstream->bad_frees(), 0U) << "round " << round;
  }
}

// A real capture: the pool destroyed after the capture ended but before its scope did; the
// scope's end gives the graph pool's memory back to the device (cudaMalloc segments, seen
// through the upstream's count).
TEST(GraphPoolsDevicePoolGpu, DestroyingThePoolWithAScopeOpenGivesItsMemoryBackWhenItEnds) {
  VRAM_GPU_TEST_OR_SKIP();
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<DeviceMemoryUpstream>(0));
  cuda::Stream capturing;
  cudaGraph_t graph = nullptr;
  DevicePool::CaptureScope scope;
  {
    DevicePool::Options options;
    options.large_tier.memory = LargeTierMemory::segments;
    DevicePool pool(upstream, options);
    scope = pool.capture_into(DevicePool::new_graph_pool(), capturing.get());
    ASSERT_EQ(cudaStreamBeginCapture(capturing.get(), cudaStreamCaptureModeGlobal), cudaSuccess);
    for (std::size_t bytes : {std::size_t{4096}, std::size_t{3} << 20, std::size_t{40} << 20}) {
      void* block = pool.allocate_async(bytes, capturing.get());
      ASSERT_EQ(cudaMemsetAsync(block, 0x5A, bytes, capturing.get()), cudaSuccess);
      pool.deallocate_async(block, bytes, capturing.get());
    }
    ASSERT_EQ(cudaStreamEndCapture(capturing.get(), &graph), cudaSuccess);
  }  // destroyed with the scope open
  EXPECT_GT(upstream->live_bytes(), 0U);
  EXPECT_THROW((void)scope.allocate(4096), InvalidArgument);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  scope.end();
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

#ifdef VRAM_HAVE_TEST_KERNELS

// How the captured intermediate is allocated and freed.
enum class Form {
  allocate,        // a scope on the stream; allocate/deallocate (the scope's thread)
  allocate_async,  // a scope on the stream; allocate_async/deallocate_async on it
  forked_stream,   // a scope on the stream; the block is used on a stream forked into the capture
  unrouted,        // an unrouted scope; scope.allocate/scope.deallocate
  unscoped,        // no scope: allocate_async/deallocate_async on the capturing stream
};
const char* name_of(Form form) {
  switch (form) {
    case Form::allocate:
      return "allocate";
    case Form::allocate_async:
      return "allocate_async";
    case Form::forked_stream:
      return "forked stream";
    case Form::unrouted:
      return "unrouted scope";
    case Form::unscoped:
      return "no scope";
  }
  return "?";
}
bool async_after(Form form) { return form != Form::allocate && form != Form::unrouted; }

// Captures `kernel writes a 4 MiB intermediate, frees it` (in `form`), then allocates the
// same size after the capture, fills it and launches the graph `launches` times: the
// post-capture block must keep its contents.
void capture_then_check_post_capture_blocks(Form form, DevicePool::GraphPoolId id, DevicePool& pool,
                                            int launches) {
  constexpr std::size_t kBytes = 4_MiB;
  cuda::Stream capturing;
  cuda::Stream forked;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), cudaSuccess);
  cudaGraph_t graph = nullptr;
  {
    DevicePool::CaptureScope scope;
    if (form == Form::unrouted) {
      scope = pool.capture_into(id);
    } else if (form != Form::unscoped) {
      scope = pool.capture_into(id, capturing.get());
    }
    const cudaStream_t s = capturing.get();
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    void* scratch = nullptr;
    switch (form) {
      case Form::allocate:
        scratch = pool.allocate(kBytes);
        launch_fill(scratch, kBytes / 4, 0xDEADBEEFu, s);
        pool.deallocate(scratch, kBytes);
        break;
      case Form::allocate_async:
      case Form::unscoped:
        scratch = pool.allocate_async(kBytes, s);
        launch_fill(scratch, kBytes / 4, 0xDEADBEEFu, s);
        pool.deallocate_async(scratch, kBytes, s);
        break;
      case Form::forked_stream:
        ASSERT_EQ(cudaEventRecord(fork, s), cudaSuccess);
        ASSERT_EQ(cudaStreamWaitEvent(forked.get(), fork, 0), cudaSuccess);
        scratch = pool.allocate_async(kBytes, forked.get());
        launch_fill(scratch, kBytes / 4, 0xDEADBEEFu, forked.get());
        pool.deallocate_async(scratch, kBytes, forked.get());
        ASSERT_EQ(cudaEventRecord(join, forked.get()), cudaSuccess);
        ASSERT_EQ(cudaStreamWaitEvent(s, join, 0), cudaSuccess);
        break;
      case Form::unrouted:
        scratch = scope.allocate(kBytes);
        launch_fill(scratch, kBytes / 4, 0xDEADBEEFu, s);
        scope.deallocate(scratch, kBytes);
        break;
    }
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess)
        << "the pool's calls must not invalidate a global-mode capture";
  }
  EXPECT_EQ(cudaEventDestroy(fork), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(join), cudaSuccess);
  const bool async_form = async_after(form);
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
  for (Form form : {Form::allocate, Form::allocate_async, Form::forked_stream, Form::unrouted}) {
    SCOPED_TRACE(name_of(form));
    DevicePool pool(0);
    const auto id = DevicePool::new_graph_pool();
    capture_then_check_post_capture_blocks(form, id, pool, 10);
    EXPECT_GE(pool.stats().graph_pool_bytes, 4_MiB);
    EXPECT_EQ(pool.stats().unscoped_capture_calls, 0U);
    pool.release_graph_pool(id);
    EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
    pool.trim(0);
    EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  }
}

// Without a scope the pool sees the capture on the stream and keeps the block apart.
TEST(GraphPoolsDevicePoolGpu, ACaptureWithoutAScopeKeepsItsBlocksApart) {
  VRAM_GPU_TEST_OR_SKIP();
  DevicePool::Options options;
  options.detect_unscoped_capture = true;
  DevicePool pool(std::make_shared<DeviceMemoryUpstream>(0), options);
  capture_then_check_post_capture_blocks(Form::unscoped, DevicePool::new_graph_pool(), pool, 10);
  EXPECT_EQ(pool.stats().unscoped_capture_calls, 1U);  // the request (its free was its own)
  EXPECT_GE(pool.stats().graph_pool_bytes, 4_MiB) << "kept for the pool's life";
}

TEST(GraphPoolsDevicePoolGpu, TwoGraphsShareAPool) {
  VRAM_GPU_TEST_OR_SKIP();
  DevicePool pool(0);
  const auto id = DevicePool::new_graph_pool();
  capture_then_check_post_capture_blocks(Form::allocate_async, id, pool, 5);
  capture_then_check_post_capture_blocks(Form::allocate, id, pool, 5);
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
    options.large_tier.memory = memory;
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
