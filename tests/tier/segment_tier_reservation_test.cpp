// The segment tier's reserved address range in virtual mode: the range goes back whole,
// with the size it was reserved with, whatever the reservation option's size.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>

#include "test_upstreams.hpp"
#include "tier/segment_tier.hpp"
#include "vram/units.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;
using detail::kUntagged;
using detail::SegmentTier;

// Host virtual memory that records each reserved range and checks each unreserve against
// it, as the driver does (cuMemAddressFree takes back only a whole range, with the size it
// was reserved with; any other size fails and the range stays reserved). It also refuses
// an unreserve while any granule is still mapped: the tier unmaps every run first.
class RecordedRanges final : public VirtualMemory {
 public:
  explicit RecordedRanges(std::shared_ptr<Upstream> physical) : inner_(std::move(physical)) {}
  std::size_t granularity() const noexcept override { return inner_.granularity(); }
  char* reserve(std::size_t bytes) override {
    char* base = inner_.reserve(bytes);
    reserved[base] = bytes;
    return base;
  }
  void unreserve(char* base, std::size_t bytes) noexcept override {
    const auto it = reserved.find(base);
    if (it == reserved.end() || it->second != bytes || mapped_bytes != 0) {
      ++refused;  // left reserved, as the driver leaves it
      return;
    }
    reserved.erase(it);
    inner_.unreserve(base, bytes);
  }
  std::uint64_t map(char* address, std::size_t bytes) override {
    const std::uint64_t handle = inner_.map(address, bytes);
    mapped_bytes += bytes;
    return handle;
  }
  void unmap(char* address, std::size_t bytes, std::uint64_t handle) noexcept override {
    mapped_bytes -= bytes;
    inner_.unmap(address, bytes, handle);
  }
  std::size_t available_bytes() const noexcept override { return inner_.available_bytes(); }

  std::map<char*, std::size_t> reserved;  // base -> bytes, still reserved
  std::size_t mapped_bytes = 0;
  int refused = 0;

 private:
  HostVirtualMemory inner_;
};

// The default reservation is twice the device's memory, which need not be whole 2 MiB
// granules: the range still goes back. The tier reserves whole granules within the option.
TEST(SegmentTierReservation, TheRangeGoesBackWithTheSizeItWasReservedWith) {
  for (const std::size_t reservation : {64_MiB, 64_MiB + 1_MiB, 66_MiB - 1}) {
    SCOPED_TRACE(reservation);
    auto physical = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    RecordedRanges vm(physical);
    ASSERT_EQ(vm.granularity(), 2_MiB);
    {
      ManualFence fence;
      detail::ReservedGauge gauge;
      SegmentTier tier(*physical, fence, gauge,
                       {.granularity = 512, .virtual_memory = &vm, .reservation = reservation});
      void* block = tier.allocate(4_MiB, kUntagged, true);
      ASSERT_NE(block, nullptr);
      ASSERT_EQ(vm.reserved.size(), 1U);
      EXPECT_EQ(vm.reserved.begin()->second, 64_MiB);
      ASSERT_TRUE(tier.free(block, kUntagged));
    }
    EXPECT_EQ(vm.refused, 0);
    EXPECT_TRUE(vm.reserved.empty());
    EXPECT_EQ(physical->live_bytes(), 0U);
  }
}

}  // namespace
}  // namespace vram::testing
