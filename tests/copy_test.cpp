// The copy layer's rules that hold without a GPU: what a witness covers, bad input.
#include <gtest/gtest.h>

#include "vram/copy.hpp"
#include "vram/cuda/error.hpp"
#include "vram/testing/witness.hpp"

namespace vram::testing {
namespace {

TEST(CopyCompleted, CoversOnlyRangesInsideTheBuffer) {
  char buffer[1024];
  auto whole = WitnessMint::completed_copy_of(buffer, sizeof buffer);
  EXPECT_TRUE(whole.covers_range_in(buffer, sizeof buffer));
  EXPECT_FALSE(whole.covers_range_in(buffer, 512));  // copied more than this range holds
  auto middle = WitnessMint::completed_copy_of(buffer + 100, 200);
  EXPECT_TRUE(middle.covers_range_in(buffer, sizeof buffer));
  EXPECT_FALSE(middle.covers_range_in(buffer + 200, 800));
  char other[16];
  EXPECT_FALSE(middle.covers_range_in(other, sizeof other));
  auto moved = std::move(middle);
  EXPECT_EQ(moved.source(), buffer + 100);
  EXPECT_EQ(moved.bytes(), 200U);
}

TEST(CopyToDevice, RejectsZeroBytesAndNullPointersBeforeAnyCudaCall) {
  char host[16];
  EXPECT_THROW((void)copy_to_device_async(host, host, 0, nullptr), InvalidArgument);
  EXPECT_THROW((void)copy_to_device_async(nullptr, host, 16, nullptr), InvalidArgument);
  EXPECT_THROW((void)copy_to_device(host, nullptr, 16, nullptr), InvalidArgument);
}

}  // namespace
}  // namespace vram::testing
