// The segment tier's virtual-memory runs capped by available memory, map-ahead, and its
// index (FreeIndex, PointerMap) at the edges: huge sizes, the null key, a null free.
#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <memory>
#include <vector>

#include <unistd.h>

#include "test_upstreams.hpp"
#include "tier/free_index.hpp"
#include "tier/segment_tier.hpp"
#include "vram/detail/pointer_map.hpp"
#include "vram/units.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;
using detail::kUntagged;
using detail::SegmentTier;

// PointerMap's keys are documented non-null, but SegmentTier::free() hands it any pointer
// (a foreign one must come back false and change nothing). erase(nullptr) "finds" the
// first empty slot of its probe (an empty slot's key is null) and decrements size_.
TEST(PointerMapNullKey, EraseOfTheNullKeyChangesNothing) {
  detail::PointerMap<int> map;
  int value = 1;
  map.reserve_one();
  map.insert(reinterpret_cast<const void*>(std::uintptr_t{0x7f0000001000}), &value);
  EXPECT_EQ(map.erase(nullptr), nullptr);
  EXPECT_EQ(map.size(), 1U) << "erase(nullptr) dropped the count of a live entry";
  EXPECT_EQ(map.find(nullptr), nullptr);
}

// The tier-level consequence: free(nullptr) returns false but under-counts live_, which
// then grows too late; the table fills up completely and the next lookup of an absent key
// (owns() / free() of a foreign pointer) probes forever. Run in a child with an alarm.
TEST(NullFreeDeathTest, SegmentTierFreeOfNullLeavesTheLiveMapUsable) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        alarm(5);  // a hang is the failure
        auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
        ManualFence fence;
        detail::ReservedGauge gauge;
        SegmentTier tier(*upstream, fence, gauge,
                         {.granularity = 512, .packed_segment = 2_MiB, .packed_limit = 2_MiB});
        std::vector<void*> blocks;
        for (int i = 0; i < 16; ++i) blocks.push_back(tier.allocate(4096, kUntagged, true));
        for (int i = 0; i < 16; ++i) {
          if (tier.free(nullptr, kUntagged)) std::_Exit(2);
        }
        for (int i = 0; i < 16; ++i) blocks.push_back(tier.allocate(4096, kUntagged, true));
        int foreign = 0;
        if (tier.owns(&foreign)) std::_Exit(3);  // hangs when the table is full
        for (void* b : blocks) {
          if (!tier.free(b, kUntagged)) std::_Exit(4);
        }
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

// A VirtualMemory that cannot tell how much physical memory is left (available_bytes()
// SIZE_MAX: the default of the interface, CudaVirtualMemory when cudaMemGetInfo fails,
// HostVirtualMemory over an Upstream without the override), or whose figure is stale (the
// small tier's cudaMalloc under its own mutex, another pool or process on the device).
class UnknownAvailable final : public VirtualMemory {
 public:
  explicit UnknownAvailable(std::shared_ptr<Upstream> physical) : inner_(std::move(physical)) {}
  std::size_t granularity() const noexcept override { return inner_.granularity(); }
  char* reserve(std::size_t bytes) override { return inner_.reserve(bytes); }
  void unreserve(char* base, std::size_t bytes) noexcept override { inner_.unreserve(base, bytes); }
  std::uint64_t map(char* address, std::size_t bytes) override {
    return inner_.map(address, bytes);
  }
  void unmap(char* address, std::size_t bytes, std::uint64_t handle) noexcept override {
    inner_.unmap(address, bytes, handle);
  }

 private:
  HostVirtualMemory inner_;
};

// Map-ahead granules ride in the same run (one physical allocation) as the granules the
// block needs. When that map fails, map_range() reclaims and retries the SAME run, ahead
// included, and throws: a block that fits the device fails with OutOfMemory only because
// of the granules mapped for nobody. (The bound available/4 keeps this away from a
// correct, fresh available_bytes(), not from an unknown or stale one.)
TEST(MapAhead, MapAheadNeverMakesABlockThatFitsFail) {
  auto physical = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(),
                                                 TestUpstream::Options{.capacity_bytes = 24_MiB});
  UnknownAvailable vm(physical);
  ManualFence fence;
  detail::ReservedGauge gauge;
  SegmentTier tier(*physical, fence, gauge,
                   {.granularity = 512,
                    .virtual_memory = &vm,
                    .reservation = 1_GiB,
                    .map_ahead_bytes = 128_MiB});
  void* a = tier.allocate(16_MiB, kUntagged, true);  // the first map: nothing held, no ahead
  EXPECT_EQ(physical->live_bytes(), 16_MiB);
  void* b = nullptr;  // 16 + 6 MiB fits the 24 MiB device; 16 + 6 + 4 (ahead) does not
  EXPECT_NO_THROW(b = tier.allocate(6_MiB, kUntagged, true));
  if (b != nullptr) ASSERT_TRUE(tier.free(b, kUntagged));
  ASSERT_TRUE(tier.free(a, kUntagged));
  tier.trim(0, false);
  EXPECT_EQ(physical->live_bytes(), 0U);
}

// unmap_before_map (DevicePoolOptions: "keep reserved at in use, at the price of more
// maps") bounds reserved by the growth budget: the tiers' peaks of used bytes plus
// growth_headroom_1024/1024. map_range() checks the budget for the block's own new granules,
// then map-ahead adds up to 1/4 of what the tier holds on top, unchecked.
TEST(MapAhead, MapAheadStaysWithinTheUnmapBeforeMapBudget) {
  auto physical = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  HostVirtualMemory vm(physical);
  ManualFence fence;
  detail::ReservedGauge gauge;
  SegmentTier tier(*physical, fence, gauge,
                   {.granularity = 512,
                    .virtual_memory = &vm,
                    .reservation = 1_GiB,
                    .unmap_before_map = true,
                    .map_ahead_bytes = 128_MiB});
  std::vector<void*> blocks;
  std::size_t worst = 0;
  for (int i = 1; i <= 100; ++i) {
    blocks.push_back(tier.allocate(3_MiB, kUntagged, true));
    const std::size_t used = static_cast<std::size_t>(i) * 3_MiB;
    const std::size_t bound = used + used / 16 + 2_MiB;  // headroom 64/1024 + a block's granule
    const std::size_t reserved = gauge.reserved.load();
    if (reserved > bound) worst = std::max(worst, reserved - bound);
  }
  EXPECT_EQ(worst, 0U) << "reserved passed the unmap_before_map budget by up to " << worst
                       << " bytes";
  for (void* b : blocks) ASSERT_TRUE(tier.free(b, kUntagged));
}

// max_free_bytes (DevicePoolOptions::max_cached_bytes) bounds the free bytes the tier keeps
// mapped (free() unmaps past it). Map-ahead maps up to 1/4 of what the tier holds as free
// bytes regardless, and they stay (pinned in the run of the block that was mapped with
// them), so a pool told to cache nothing holds up to 128 MiB cached after each growth.
TEST(MapAhead, MapAheadStaysWithinMaxFreeBytes) {
  auto physical = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  HostVirtualMemory vm(physical);
  ManualFence fence;
  detail::ReservedGauge gauge;
  SegmentTier tier(*physical, fence, gauge,
                   {.granularity = 512,
                    .max_free_bytes = 0,
                    .virtual_memory = &vm,
                    .reservation = 1_GiB,
                    .map_ahead_bytes = 128_MiB});
  std::vector<void*> blocks;
  std::size_t worst = 0;
  for (int i = 1; i <= 100; ++i) {
    blocks.push_back(tier.allocate(3_MiB, kUntagged, true));
    worst = std::max(worst, tier.counters().free_bytes);
  }
  EXPECT_LE(worst, 2_MiB) << "max_free_bytes 0: at most the part of a granule a block leaves";
  for (void* b : blocks) ASSERT_TRUE(tier.free(b, kUntagged));
}

// FreeIndex at the top of the size range (rows 59-60; bin_of near 2^64).
TEST(FreeIndexHugeSizes, HugeSizesAreFoundInOrder) {
  struct Node {
    std::size_t size = 0;
    char* addr = nullptr;
    Node* bin_prev = nullptr;
    Node* bin_next = nullptr;
    detail::FreeIndex<Node>* index = nullptr;
  };
  for (unsigned shift : {0u, 9u, 21u}) {
    SCOPED_TRACE(shift);
    detail::FreeIndex<Node> index(shift);
    const std::size_t top = ~std::size_t{0} >> shift << shift;
    Node nodes[4];
    nodes[0].size = std::size_t{1} << 63;
    nodes[1].size = top;
    nodes[2].size = (std::size_t{1} << 63) - (std::size_t{1} << shift);
    nodes[3].size = std::size_t{1} << shift;
    for (int i = 0; i < 4; ++i) {
      nodes[i].addr = reinterpret_cast<char*>(std::uintptr_t{4096} * (i + 1));
      index.insert(&nodes[i]);
    }
    EXPECT_EQ(index.best(1), &nodes[3]);
    EXPECT_EQ(index.best(std::size_t{1} << 62), &nodes[2]);
    EXPECT_EQ(index.best(nodes[2].size), &nodes[2]);
    EXPECT_EQ(index.best(nodes[2].size + 1), &nodes[0]);
    EXPECT_EQ(index.best((std::size_t{1} << 63) + 1), &nodes[1]);
    EXPECT_EQ(index.best(top), &nodes[1]);
    if (top != ~std::size_t{0}) EXPECT_EQ(index.best(top + 1), nullptr);
    Node* out[4];
    ASSERT_EQ(index.best_k(1, out, 4), 4U);
    EXPECT_EQ(out[0], &nodes[3]);
    EXPECT_EQ(out[1], &nodes[2]);
    EXPECT_EQ(out[2], &nodes[0]);
    EXPECT_EQ(out[3], &nodes[1]);
    for (Node& n : nodes) index.erase(&n);
    EXPECT_TRUE(index.empty());
    EXPECT_EQ(index.best(1), nullptr);
  }
}

}  // namespace
}  // namespace vram::testing
