#include <gtest/gtest.h>

#include <random>

#include "vram/size_classes.hpp"

namespace vram {
namespace {

TEST(SizeClasses, EveryRequestFitsItsClassWithUnderAQuarterWaste) {
  std::mt19937_64 random(7);
  for (int i = 0; i < 200000; ++i) {
    const unsigned shift = 1 + random() % 39;
    const std::size_t bytes = 1 + random() % (std::size_t{1} << shift);
    const std::size_t index = SizeClasses::index_for(bytes);
    ASSERT_LT(index, SizeClasses::kCount);
    const std::size_t size = SizeClasses::bytes_of(index);
    ASSERT_GE(size, bytes);
    if (bytes > SizeClasses::kMinBytes) {
      ASSERT_LT(static_cast<double>(size - bytes), 0.25 * static_cast<double>(bytes)) << bytes;
      ASSERT_LT(SizeClasses::bytes_of(index - 1), bytes) << "not the smallest class";
    }
  }
}

TEST(SizeClasses, ClassesAreIncreasingAndLargeOnesAre2MiBMultiples) {
  for (std::size_t i = 1; i < SizeClasses::kCount; ++i) {
    EXPECT_LT(SizeClasses::bytes_of(i - 1), SizeClasses::bytes_of(i));
    EXPECT_EQ(SizeClasses::index_for(SizeClasses::bytes_of(i)), i);
    if (SizeClasses::bytes_of(i) >= (std::size_t{8} << 20)) {
      EXPECT_EQ(SizeClasses::bytes_of(i) % (std::size_t{2} << 20), 0U);
    }
  }
  EXPECT_EQ(SizeClasses::index_for(SizeClasses::kMaxBytes), SizeClasses::kCount - 1);
}

}  // namespace
}  // namespace vram
