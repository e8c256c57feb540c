// The bench report's verdicts: on par while the p10..p90 ranges of the two allocators
// overlap, the winner named once they are apart.
#include <gtest/gtest.h>

#include <vector>

#include "bench/report.hpp"

namespace vram::testing {
namespace {

// A verdict names a winner only when the p10..p90 ranges of the two are apart.
TEST(BenchVerdict, OverlappingRangesAreOnParApartRangesNameTheWinner) {
  using bench::make_measurement;
  const std::vector<bench::Measurement> close = {
      make_measurement("pairs", "256 B", 256, "vram", true, "ns/pair", true, {9, 10, 14}),
      make_measurement("pairs", "256 B", 256, "peer", false, "ns/pair", true, {11, 12, 13})};
  const auto tie = bench::verdicts(close);
  ASSERT_EQ(tie.size(), 1U);
  EXPECT_TRUE(tie[0].ranges_overlap);
  EXPECT_STREQ(bench::verdict_word(tie[0]), "on par");
  EXPECT_EQ(tie[0].ours_samples, 3U);
  const std::vector<bench::Measurement> apart = {
      make_measurement("pairs", "256 B", 256, "vram", true, "ns/pair", true, {9, 10, 10}),
      make_measurement("pairs", "256 B", 256, "peer", false, "ns/pair", true, {20, 21, 22})};
  const auto win = bench::verdicts(apart);
  ASSERT_EQ(win.size(), 1U);
  EXPECT_FALSE(win[0].ranges_overlap);
  EXPECT_STREQ(bench::verdict_word(win[0]), "better");
  const std::vector<bench::Measurement> loss = {
      make_measurement("pairs", "256 B", 256, "vram", true, "ns/pair", true, {20, 21, 22}),
      make_measurement("pairs", "256 B", 256, "peer", false, "ns/pair", true, {9, 10, 10})};
  EXPECT_STREQ(bench::verdict_word(bench::verdicts(loss)[0]), "WORSE");
}

}  // namespace
}  // namespace vram::testing
