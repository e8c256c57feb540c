// The segment tier's map-ahead in virtual mode: runs capped by available memory, never a
// failed fit, within the unmap-before-map budget and max_free_bytes.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <vector>

#include "test_upstreams.hpp"
#include "tier/segment_tier.hpp"
#include "vram/units.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;
using detail::kUntagged;
using detail::SegmentTier;

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
TEST(SegmentTierMapAhead, MapAheadNeverMakesABlockThatFitsFail) {
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
TEST(SegmentTierMapAhead, MapAheadStaysWithinTheUnmapBeforeMapBudget) {
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
TEST(SegmentTierMapAhead, MapAheadStaysWithinMaxFreeBytes) {
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

}  // namespace
}  // namespace vram::testing
