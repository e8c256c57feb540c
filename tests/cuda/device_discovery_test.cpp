// Device discovery without a driver or a device (CPU): the count and its reason, and the
// version strings.
#include <gtest/gtest.h>

#include "vram/cuda/device.hpp"

namespace vram::testing {
namespace {

TEST(DeviceDiscovery, CountNeverThrowsAndExplainsZero) {
  const auto availability = cuda::Device::availability();
  EXPECT_EQ(availability.count, cuda::Device::count());
  if (availability.count == 0) {
    EXPECT_FALSE(availability.reason.empty());
  } else {
    EXPECT_TRUE(availability.reason.empty());
  }
}

TEST(DeviceDiscovery, VersionStrings) {
  EXPECT_EQ(cuda::Device::version_string(13000), "13.0");
  EXPECT_EQ(cuda::Device::version_string(12080), "12.8");
  EXPECT_EQ(cuda::Device::version_string(0), "none");
}

}  // namespace
}  // namespace vram::testing
