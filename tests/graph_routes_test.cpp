// The plug-in's routes to PyTorch's private pools (plugins/torch/graph_routes.hpp) over a
// pool in host memory: a pool's free blocks, listed for snapshots with the stream noted at
// their free, and forgotten with the pool.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>

#include "graph_routes.hpp"
#include "test_upstreams.hpp"
#include "vram/device_pool.hpp"
#include "vram/stream_fence.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;
using vram_torch::GraphRoutes;

std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

TEST(GraphRoutes, APoolsFreeBlocksCarryTheStreamNotedAtTheirFreeAndGoWithThePool) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Options options;
  options.fence = std::make_shared<ManualFence>();
  DevicePool pool(upstream, options);
  GraphRoutes routes(pool);
  const GraphRoutes::MempoolId id{0, 1};
  const auto s = reinterpret_cast<cudaStream_t>(0x10);
  routes.retain(id);                                    // a MemPool
  routes.begin(id, [](cudaStream_t) { return true; });  // use_mem_pool: the thread's route
  const GraphRoutes::Routed small = routes.allocate(4096, s);
  const GraphRoutes::Routed large = routes.allocate(8_MiB, s);
  ASSERT_NE(small.ptr, nullptr);
  ASSERT_NE(large.ptr, nullptr);
  EXPECT_EQ(large.id, id);
  routes.end(id);
  routes.release(id);  // use_mem_pool's exit: the MemPool's use stays open
  EXPECT_EQ(routes.use_count(id), 1);
  EXPECT_TRUE(routes.free_blocks().empty()) << "live blocks are not free";

  pool.deallocate(large.ptr, 8_MiB);  // back to the MemPool's graph pool
  routes.note_free(id, large.ptr, s);
  routes.note_free({0, 9}, small.ptr, s);  // no such pool: nothing noted
  pool.deallocate(small.ptr, 4096);        // no stream noted for it
  const std::vector<GraphRoutes::FreeBlock> free = routes.free_blocks();
  ASSERT_EQ(free.size(), 2U);
  EXPECT_LT(free[0].address, free[1].address) << "by address";
  for (const GraphRoutes::FreeBlock& block : free) {
    EXPECT_EQ(block.id, id);
    if (block.address == address(large.ptr)) {
      EXPECT_EQ(block.stream, s);
      EXPECT_GE(block.bytes, 8_MiB);
    } else {
      EXPECT_EQ(block.address, address(small.ptr));
      EXPECT_EQ(block.stream, nullptr);
      EXPECT_GE(block.bytes, 4096U);
    }
  }

  routes.release(id);  // the MemPool's end: no use open
  EXPECT_TRUE(routes.free_blocks().empty()) << "the pool's blocks are no pool's any more";
  EXPECT_EQ(routes.use_count(id), 0);
  routes.retain(id);  // the same id again: a new pool, with no block and no noted stream
  EXPECT_TRUE(routes.free_blocks().empty());
  routes.release(id);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

}  // namespace
}  // namespace vram::testing
