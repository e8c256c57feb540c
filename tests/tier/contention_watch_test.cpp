// ContentionWatch: a thread's view of a tier's count of contended locks. Only a change between
// two of the thread's calls counts; the first call, and the first after reset(), only records.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "tier/contention_watch.hpp"

namespace vram::detail {
namespace {

TEST(ContentionWatch, TheFirstCountOnlyRecords) {
  ContentionWatch watch;
  EXPECT_FALSE(watch.moved(7));
  EXPECT_FALSE(watch.moved(7));
  EXPECT_TRUE(watch.moved(8));
  EXPECT_FALSE(watch.moved(8));
}

TEST(ContentionWatch, ACountOfZeroAtTheFirstCallStillCounts) {
  ContentionWatch watch;
  EXPECT_FALSE(watch.moved(0));
  EXPECT_TRUE(watch.moved(1));
}

TEST(ContentionWatch, ResetForgetsTheLastCount) {
  ContentionWatch watch;
  EXPECT_FALSE(watch.moved(3));
  watch.reset();
  EXPECT_FALSE(watch.moved(5));  // a new thread's first call
  EXPECT_TRUE(watch.moved(6));
}

TEST(ContentionWatch, TheCountWrappingAroundIsAChange) {
  ContentionWatch watch;
  const std::uint32_t top = std::numeric_limits<std::uint32_t>::max();
  EXPECT_FALSE(watch.moved(top));
  EXPECT_FALSE(watch.moved(top));
  EXPECT_TRUE(watch.moved(0));
}

}  // namespace
}  // namespace vram::detail
