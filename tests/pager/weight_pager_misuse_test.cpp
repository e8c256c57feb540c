// Misuse and bad input against WeightPager: its plan and schedule (pure host), the pager
// over a host-memory device, and the pageable stager's options. Each test states the
// documented behaviour for one misuse.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "staging/null_staged_copy_target.hpp"
#include "staging/pageable_stager.hpp"
#include "vram/cuda/error.hpp"
#include "vram/pager_plan.hpp"
#include "vram/units.hpp"
#include "vram/upstream.hpp"
#include "vram/weight_pager.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

// ==== WeightPager: plan and schedule (pure host) ===========================================

// plan_residency guards every sum of layer sizes against overflow: the total of the
// aligned sizes, the layers forced resident for a candidate slot size, and resident_bytes.
// Two layers of 2^63 bytes under a budget of SIZE_MAX are refused, never planned into a
// wrapped arena (absurd sizes, e.g. an uninitialised WeightLayer::bytes with an
// "unlimited" budget).
TEST(WeightPagerMisuse, PlanWithOverflowingResidentLayersIsRefused) {
  const std::size_t huge = std::size_t{1} << 63;
  try {
    const auto plan =
        plan_residency({huge, huge, 256}, {}, {.budget_bytes = SIZE_MAX, .prefetch_depth = 1});
    ADD_FAILURE() << "accepted: arena_bytes " << plan.arena_bytes << ", offsets " << plan.offset[0]
                  << " " << plan.offset[1] << " " << plan.offset[2];
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("address space"), std::string::npos) << error.what();
  }
  // Uses per step count too: one layer of 2^62 bytes used four times a step.
  EXPECT_THROW((void)plan_residency({std::size_t{1} << 62, 256}, {0, 0, 0, 0, 1},
                                    {.budget_bytes = SIZE_MAX}),
               InvalidArgument);
}

// copy_to_compute_ratio is validated: +inf and values past 2^64 (which would overflow the
// float-to-integer conversion of the plan check), NaN and negative ratios are refused.
TEST(WeightPagerMisuse, NonFiniteOrNegativeCopyToComputeRatioIsRefused) {
  for (const double ratio : {std::numeric_limits<double>::infinity(), 1e300,
                             std::numeric_limits<double>::quiet_NaN(), -2.0}) {
    SCOPED_TRACE("ratio " + std::to_string(ratio));
    try {
      const auto plan = plan_residency(
          std::vector<std::size_t>(8, 1_MiB), {},
          {.budget_bytes = 5_MiB, .prefetch_depth = 1, .copy_to_compute_ratio = ratio});
      std::string warnings;
      for (const auto& warning : plan.warnings) warnings += warning + "\n";
      ADD_FAILURE() << "accepted; warnings:\n" << warnings;
    } catch (const InvalidArgument&) {
    }
  }
}

// A layer exactly as large as the budget: the arena places layers at 256-byte alignment,
// so it is either accepted or refused with a message that names the alignment, never a
// false "larger than the VRAM budget".
TEST(WeightPagerMisuse, LayerAsLargeAsTheBudgetGetsATruthfulMessage) {
  try {
    const auto plan = plan_residency({1000}, {}, {.budget_bytes = 1000});
    EXPECT_LE(plan.arena_bytes, 1000U);
  } catch (const InvalidArgument& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("align"), std::string::npos)
        << "refused without naming the alignment: " << message;
  }
}

// PagerSchedule (public) checks a hand-made plan before indexing with its schedule
// entries: an inconsistent plan is InvalidArgument, not a crash.
TEST(WeightPagerMisuse, ScheduleOverAnInconsistentHandMadePlanIsRefused) {
  const PagerPlan good = plan_residency({64, 64}, {}, {.budget_bytes = 64, .alignment = 1});
  {
    PagerPlan plan = good;
    plan.schedule = {0, 1, 100000, 7777777};  // layers that do not exist
    try {
      PagerSchedule schedule(plan);
      ADD_FAILURE() << "accepted";
    } catch (const InvalidArgument& error) {
      EXPECT_NE(std::string(error.what()).find("names layer 100000"), std::string::npos)
          << error.what();
    }
  }
  {
    PagerPlan plan = good;
    plan.resident.pop_back();
    EXPECT_THROW(PagerSchedule{plan}, InvalidArgument);
  }
  {
    PagerPlan plan = good;
    plan.slot_count = 0;  // streams layers through no slot
    EXPECT_THROW(PagerSchedule{plan}, InvalidArgument);
  }
  {
    PagerPlan plan = good;
    plan.schedule.clear();
    EXPECT_THROW(PagerSchedule{plan}, InvalidArgument);
  }
  PagerSchedule schedule(good);  // the plan as made still works
  (void)schedule.acquire(0);
  EXPECT_EQ(schedule.layers_acquired(), 1U);
}

// A schedule entry out of range, zero layers, a zero-byte layer and a budget below one
// layer are refused by plan_residency with a Fix.
TEST(WeightPagerMisuse, PlanBadInputMessagesCarryAFix) {
  const auto message = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const InvalidArgument& error) {
      return error.what();
    }
    return "(no exception)";
  };
  for (const std::string& text :
       {message([] { (void)plan_residency({}, {}, {.budget_bytes = 1_MiB}); }), message([] {
          (void)plan_residency({1_MiB, 0}, {}, {.budget_bytes = 4_MiB});
        }),
        message([] { (void)plan_residency({2_MiB}, {}, {.budget_bytes = 1_MiB}); }), message([] {
          (void)plan_residency({1_MiB}, {0, 1}, {.budget_bytes = 4_MiB});
        }),
        message([] { (void)plan_residency({1_MiB}, {}, {.budget_bytes = 0}); })}) {
    EXPECT_NE(text.find("Fix:"), std::string::npos) << text;
  }
}

// ==== WeightPager over a host-memory device ================================================

class HostDevice final : public PagerDevice {
 public:
  std::string pin_host(std::span<const HostRange> ranges, std::size_t,
                       WeightPagerLoad& load) override {
    for (const auto& range : ranges) load.pinned_bytes += range.bytes;
    return {};
  }
  void* allocate_arena(std::size_t bytes) override {
    arena_.assign(bytes, std::byte{0xEE});
    return arena_.data();
  }
  void upload(void* device, const void* host, std::size_t bytes) override {
    std::memcpy(device, host, bytes);
  }
  void configure(std::size_t, bool, const WeightPagerOptions&) override {}
  void page_in(std::size_t, void* device, const void* host, std::size_t bytes) override {
    std::memcpy(device, host, bytes);
  }
  void wait_ready(std::size_t, cudaStream_t) override {}
  void record_release(std::size_t, cudaStream_t) override {}
  void collect(WeightPagerStats&) override {}
  void synchronize() override {}
  void shutdown(void*, std::size_t) noexcept override {}

 private:
  std::vector<std::byte> arena_;
};

struct Weights {
  std::vector<std::vector<std::byte>> data;
  std::vector<WeightLayer> layers;
  Weights(std::size_t count, std::size_t bytes) {
    for (std::size_t i = 0; i < count; ++i) data.emplace_back(bytes, std::byte(i + 1));
    for (std::size_t i = 0; i < count; ++i) {
      layers.push_back({"w" + std::to_string(i), data[i].data(), bytes});
    }
  }
};

WeightPager host_pager(const Weights& weights, WeightPagerOptions options) {
  options.print_plan_warnings = false;
  return WeightPager(weights.layers, options, std::make_unique<HostDevice>());
}

// Every slot held is OutOfMemory (a std::bad_alloc) naming the slots, nothing changes,
// and after a release the pager serves the layer with its own bytes. Acquiring one layer
// twice needs two releases; a third is refused.
TEST(WeightPagerMisuse, InUseLayersAreNeverEvictedAndTheErrorIsRecoverable) {
  Weights weights(6, 1024);
  auto pager = host_pager(weights, {.plan = {.budget_bytes = 2048, .prefetch_depth = 1}});
  ASSERT_EQ(pager.plan().slot_count, 2U);
  const void* a = pager.acquire(0, nullptr);
  const void* b = pager.acquire(1, nullptr);
  try {
    (void)pager.acquire(2, nullptr);
    FAIL() << "a third layer was paged into a slot still in use";
  } catch (const std::bad_alloc& error) {
    EXPECT_NE(std::string(error.what()).find("Fix:"), std::string::npos) << error.what();
  }
  EXPECT_EQ(std::memcmp(a, weights.data[0].data(), 1024), 0);
  EXPECT_EQ(std::memcmp(b, weights.data[1].data(), 1024), 0);
  const void* a_again = pager.acquire(0, nullptr);  // a second hold of layer 0
  EXPECT_EQ(a_again, a);
  pager.release(0, nullptr);
  EXPECT_THROW((void)pager.acquire(2, nullptr), OutOfMemory);  // layer 0 is still held once
  pager.release(0, nullptr);
  const void* c = pager.acquire(2, nullptr);
  EXPECT_EQ(std::memcmp(c, weights.data[2].data(), 1024), 0);
  EXPECT_EQ(std::memcmp(b, weights.data[1].data(), 1024), 0);  // in use: untouched
  EXPECT_THROW(pager.release(0, nullptr), InvalidArgument);
  pager.release(1, nullptr);
  pager.release(2, nullptr);
}

// Unnamed layers may repeat (no name, nothing to look up); a lookup of the empty name is
// an unknown name; a moved-from pager refuses every call, its handle says "pager
// destroyed".
TEST(WeightPagerMisuse, UnnamedLayersAndMovedFromPagerCalls) {
  Weights weights(3, 512);
  for (auto& layer : weights.layers) layer.name.clear();
  auto pager = host_pager(weights, {.plan = {.budget_bytes = 4_KiB}});
  EXPECT_THROW((void)pager.index_of(""), InvalidArgument);
  EXPECT_THROW((void)pager.acquire(std::string_view(""), nullptr), InvalidArgument);
  WeightPager other = std::move(pager);
  EXPECT_THROW(pager.release(0, nullptr), InvalidArgument);  // NOLINT(bugprone-use-after-move)
  EXPECT_THROW((void)pager.stats(), InvalidArgument);
  EXPECT_THROW((void)pager.plan(), InvalidArgument);
  EXPECT_THROW(pager.synchronize(), InvalidArgument);
  EXPECT_FALSE(pager.handle().alive());
  EXPECT_THROW((void)pager.handle().acquire(0, nullptr), InvalidArgument);
  (void)other.acquire(2, nullptr);
  other.release(2, nullptr);
}

// ==== The pageable stager's options =======================================================

TEST(WeightPagerMisuse, AbsurdFillThreadCountIsInvalidArgument) {
  NullTarget target;
  auto upstream = std::make_shared<HostMemoryUpstream>();
  try {
    detail::PageableStager stager(target, {.slot_count = 2,
                                           .chunk_bytes = 4096,
                                           .staging_buffers = 2,
                                           .fill_threads = 100000,
                                           .staging_upstream = upstream});
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("fill_threads"), std::string::npos) << error.what();
  }
}

// An absurd staging_buffers (WeightPagerOptions::staging_buffers, passed to the stager)
// is an InvalidArgument naming the option, never std::length_error from std::vector, and
// staging_buffers * chunk_bytes cannot overflow into the pool's bound.
TEST(WeightPagerMisuse, AbsurdStagingBufferCountIsInvalidArgument) {
  NullTarget target;
  auto upstream = std::make_shared<HostMemoryUpstream>();
  try {
    detail::PageableStager stager(target, {.slot_count = 2,
                                           .chunk_bytes = 4096,
                                           .staging_buffers = SIZE_MAX,
                                           .fill_threads = 1,
                                           .staging_upstream = upstream});
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument&) {
  } catch (const std::exception& error) {
    ADD_FAILURE() << "wrong error type: " << error.what();
  }
}

}  // namespace
}  // namespace vram::testing
