// PagerPlan (vram/pager_plan.hpp): which layers stay resident, the ring of slots for the
// rest, and the messages of a refused plan (pure host).
#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <vector>

#include "vram/cuda/error.hpp"
#include "vram/pager_plan.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

std::vector<std::size_t> uniform(std::size_t count, std::size_t bytes) {
  return std::vector<std::size_t>(count, bytes);
}

TEST(PagerPlan, EverythingResidentWhenItFits) {
  const auto plan = plan_residency(uniform(4, 1_MiB), {}, {.budget_bytes = 4_MiB});
  EXPECT_EQ(plan.streamed_layers(), 0U);
  EXPECT_EQ(plan.slot_count, 0U);
  EXPECT_EQ(plan.arena_bytes, 4_MiB);
  EXPECT_EQ(plan.streamed_bytes_per_step, 0U);
  EXPECT_TRUE(plan.warnings.empty());
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(plan.offset[i], i * 1_MiB);
}

TEST(PagerPlan, KeepsWhatFitsAndStreamsTheRestThroughDepthPlusOneSlots) {
  // A large stack: 48 layers of 256 MiB under 4 GiB with one layer of look-ahead.
  const auto plan =
      plan_residency(uniform(48, 256_MiB), {}, {.budget_bytes = 4_GiB, .prefetch_depth = 1});
  EXPECT_EQ(plan.slot_count, 2U);
  EXPECT_EQ(plan.slot_bytes, 256_MiB);
  EXPECT_EQ(plan.prefetch_depth, 1U);
  EXPECT_EQ(plan.streamed_layers(), 48U - 14U);  // 16 layers of budget - 2 slots
  EXPECT_EQ(plan.streamed_bytes_per_step, 34 * 256_MiB);
  EXPECT_LE(plan.arena_bytes, 4_GiB);
  EXPECT_EQ(plan.arena_bytes, 16 * 256_MiB);
  EXPECT_TRUE(plan.warnings.empty());
}

TEST(PagerPlan, LargeLayerIsForcedResidentWhenThatBuysPrefetch) {
  // Slots of the 100-byte layer would leave no room for prefetch; slots of 10 bytes do.
  const auto plan = plan_residency({100, 10, 10, 10, 10}, {},
                                   {.budget_bytes = 130, .prefetch_depth = 1, .alignment = 1});
  EXPECT_TRUE(plan.resident[0]);
  EXPECT_EQ(plan.slot_bytes, 10U);
  EXPECT_EQ(plan.slot_count, 2U);
  EXPECT_EQ(plan.streamed_layers(), 3U);  // 130 - 100 - 2 slots = one more 10-byte layer
  EXPECT_EQ(plan.arena_bytes, 130U);
}

TEST(PagerPlan, LayersUsedMoreOftenStayResidentFirst) {
  // Layer 3 runs twice per step: keeping it saves two copies per step.
  const auto plan = plan_residency(uniform(4, 10), {0, 3, 1, 3, 2},
                                   {.budget_bytes = 30, .prefetch_depth = 1, .alignment = 1});
  EXPECT_TRUE(plan.resident[3]);
  EXPECT_EQ(plan.streamed_layers(), 3U);
  EXPECT_EQ(plan.streamed_bytes_per_step, 30U);
}

TEST(PagerPlan, DepthLoweredToWhatTheBudgetHoldsWithAWarning) {
  const auto plan =
      plan_residency(uniform(8, 1_MiB), {}, {.budget_bytes = 3_MiB, .prefetch_depth = 4});
  EXPECT_EQ(plan.prefetch_depth, 2U);
  EXPECT_EQ(plan.slot_count, 3U);
  EXPECT_EQ(plan.streamed_layers(), 8U);
  ASSERT_EQ(plan.warnings.size(), 1U);
  EXPECT_NE(plan.warnings[0].find("lowered from 4 to 2"), std::string::npos);
}

TEST(PagerPlan, OneSlotMeansNoPrefetchAndSaysSo) {
  const auto plan =
      plan_residency(uniform(4, 1_MiB), {}, {.budget_bytes = 1_MiB, .prefetch_depth = 1});
  EXPECT_EQ(plan.slot_count, 1U);
  EXPECT_EQ(plan.prefetch_depth, 0U);
  ASSERT_EQ(plan.warnings.size(), 2U);
  EXPECT_NE(plan.warnings[1].find("no prefetch"), std::string::npos);
}

TEST(PagerPlan, RunCheckWarnsOnlyWhenTheDepthCannotCoverTheRun) {
  PagerPlanOptions options{.budget_bytes = 5_MiB, .prefetch_depth = 1};
  // 8 layers, 5 fit: 3 resident + 2 slots; 5 consecutive streamed layers.
  options.copy_to_compute_ratio = 1.0;
  const auto covered = plan_residency(uniform(8, 1_MiB), {}, options);
  EXPECT_EQ(covered.longest_streamed_run, 5U);
  EXPECT_TRUE(covered.warnings.empty());
  options.copy_to_compute_ratio = 1.1;  // 5 * 0.1 = 0.5 <= depth 1
  EXPECT_TRUE(plan_residency(uniform(8, 1_MiB), {}, options).warnings.empty());
  options.copy_to_compute_ratio = 2.0;  // 5 * 1 = 5 > depth 1
  const auto short_depth = plan_residency(uniform(8, 1_MiB), {}, options);
  ASSERT_EQ(short_depth.warnings.size(), 1U);
  EXPECT_NE(short_depth.warnings[0].find("cannot cover a run of 5"), std::string::npos);
}

TEST(PagerPlan, BadInputIsRejected) {
  EXPECT_THROW(plan_residency({}, {}, {.budget_bytes = 1_MiB}), InvalidArgument);
  EXPECT_THROW(plan_residency(uniform(2, 1_MiB), {}, {.budget_bytes = 0}), InvalidArgument);
  EXPECT_THROW(plan_residency({1_MiB, 0}, {}, {.budget_bytes = 4_MiB}), InvalidArgument);
  EXPECT_THROW(plan_residency({1_MiB, 2_MiB}, {}, {.budget_bytes = 1_MiB}), InvalidArgument);
  EXPECT_THROW(plan_residency(uniform(2, 1_MiB), {0, 2}, {.budget_bytes = 1_MiB}), InvalidArgument);
  EXPECT_THROW(plan_residency({SIZE_MAX}, {}, {.budget_bytes = SIZE_MAX}), InvalidArgument);
}

// A layer whose rounding to the arena alignment overflows is refused, and the message
// never prints the wrapped rounded size ("18446744073709551605 bytes, 0 at the arena's
// 256-byte alignment").
TEST(PagerPlan, OverflowingAlignmentMessageDoesNotPrintAWrappedSize) {
  try {
    (void)plan_residency({SIZE_MAX - 10}, {}, {.budget_bytes = SIZE_MAX, .alignment = 256});
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& error) {
    const std::string what = error.what();
    EXPECT_EQ(what.find(", 0 at the arena"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace vram::testing
