// WeightPager: the plan and the schedule (pure host), the pager over a host-memory device
// (the CUDA seam replaced), and on a GPU the bytes delivered in pinned and pageable modes.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test_policy.hpp"
#include "staging/parallel_copy.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/units.hpp"
#include "vram/weight_pager.hpp"

#if defined(VRAM_HAVE_TEST_KERNELS)
#include "test_kernels.hpp"
#endif

namespace vram::testing {
namespace {

using namespace vram::literals;

std::vector<std::size_t> uniform(std::size_t count, std::size_t bytes) {
  return std::vector<std::size_t>(count, bytes);
}

// Page-ins issued by one step (one pass over the schedule) of a PagerSchedule.
std::size_t run_step(PagerSchedule& schedule) {
  // (The last acquire of a step may prefetch the next step's first layers.)
  std::size_t page_ins = 0;
  for (std::size_t layer : schedule.plan().schedule) {
    page_ins += schedule.acquire(layer).page_ins.size();
    schedule.release(layer);
  }
  return page_ins;
}

// ---- plan ---------------------------------------------------------------------------

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

// ---- schedule -----------------------------------------------------------------------

TEST(PagerSchedule, CyclicStepPagesInExactlyTheStreamedLayers) {
  for (std::size_t depth : {1U, 2U, 3U}) {
    const auto plan =
        plan_residency(uniform(48, 256_MiB), {}, {.budget_bytes = 4_GiB, .prefetch_depth = depth});
    PagerSchedule schedule(plan);
    for (int step = 0; step < 4; ++step) {
      EXPECT_EQ(run_step(schedule), plan.streamed_layers()) << "depth " << depth;
    }
    EXPECT_EQ(schedule.layers_acquired(), 0U);
  }
}

TEST(PagerSchedule, PrefetchesTheNextStreamedLayersSoAcquiresHit) {
  const auto plan =
      plan_residency(uniform(8, 1_MiB), {}, {.budget_bytes = 3_MiB, .prefetch_depth = 1});
  ASSERT_EQ(plan.slot_count, 2U);
  ASSERT_EQ(plan.streamed_layers(), 7U);
  PagerSchedule schedule(plan);
  (void)run_step(schedule);  // the first step starts cold
  std::size_t hits = 0;
  std::size_t prefetches = 0;
  std::size_t demand = 0;
  for (std::size_t layer : plan.schedule) {
    const auto acquired = schedule.acquire(layer);
    hits += acquired.hit ? 1 : 0;
    for (const auto& page_in : acquired.page_ins) (page_in.prefetch ? prefetches : demand) += 1;
    schedule.release(layer);
  }
  EXPECT_EQ(hits, 8U);  // every layer resident or prefetched a step ahead
  EXPECT_EQ(demand, 0U);
  EXPECT_EQ(prefetches, 7U);
}

TEST(PagerSchedule, BeladyBeatsLruOnACyclicSchedule) {
  // 8 layers streamed through 4 slots, one layer of look-ahead.
  PagerPlan plan = plan_residency(uniform(8, 64), {}, {.budget_bytes = 512, .alignment = 1});
  plan.resident.assign(8, false);
  plan.resident_bytes = 0;
  plan.slot_bytes = 64;
  plan.slot_count = 4;
  plan.prefetch_depth = 1;
  PagerSchedule belady(plan, EvictionPolicy::belady);
  PagerSchedule lru(plan, EvictionPolicy::lru);
  (void)run_step(belady);
  (void)run_step(lru);
  std::size_t belady_total = 0;
  for (int step = 0; step < 6; ++step) {
    const std::size_t with_belady = run_step(belady);
    const std::size_t with_lru = run_step(lru);
    EXPECT_EQ(with_lru, 8U);  // LRU evicts exactly the layer needed soonest: all miss
    // Belady keeps all slots but the one being refilled (n - C + 1 = 5 misses), give or
    // take the look-ahead's slot held by the prefetched layer: at most one more.
    EXPECT_GE(with_belady, 8U - 4U + 1U);
    EXPECT_LE(with_belady, 8U - 4U + 1U + 1U);
    belady_total += with_belady;
  }
  EXPECT_LT(belady_total, 6U * 6U);  // not stuck at the upper bound either
}

TEST(PagerSchedule, OutOfOrderAcquireAndOffScheduleLayers) {
  const auto plan = plan_residency(uniform(6, 10), {0, 1, 2, 3},
                                   {.budget_bytes = 30, .prefetch_depth = 1, .alignment = 1});
  PagerSchedule schedule(plan);
  // Layer 5 is not in the schedule: paged on demand, nothing prefetched after it.
  const auto off = schedule.acquire(5);
  EXPECT_FALSE(off.hit);
  schedule.release(5);
  // Jumping ahead in the schedule works; the cursor follows the acquire.
  (void)schedule.acquire(3);
  schedule.release(3);
  EXPECT_EQ(schedule.cursor(), 3U);
}

TEST(PagerSchedule, ReleaseOfANotAcquiredLayerThrowsAndChangesNothing) {
  const auto plan = plan_residency(uniform(4, 10), {}, {.budget_bytes = 20, .alignment = 1});
  PagerSchedule schedule(plan);
  EXPECT_THROW(schedule.release(1), InvalidArgument);
  EXPECT_THROW(schedule.release(99), InvalidArgument);
  EXPECT_THROW((void)schedule.acquire(99), InvalidArgument);
  (void)schedule.acquire(1);
  schedule.release(1);
  EXPECT_THROW(schedule.release(1), InvalidArgument);
  EXPECT_EQ(schedule.layers_acquired(), 0U);
}

TEST(PagerSchedule, AllSlotsAcquiredIsOutOfMemoryAndRecoverable) {
  const auto plan =
      plan_residency(uniform(8, 10), {}, {.budget_bytes = 30, .prefetch_depth = 1, .alignment = 1});
  ASSERT_EQ(plan.slot_count, 2U);
  PagerSchedule schedule(plan);
  std::vector<std::size_t> streamed;
  for (std::size_t i = 0; i < 8; ++i) {
    if (!plan.resident[i]) streamed.push_back(i);
  }
  (void)schedule.acquire(streamed[0]);
  (void)schedule.acquire(streamed[3]);
  EXPECT_THROW((void)schedule.acquire(streamed[5]), OutOfMemory);
  EXPECT_EQ(schedule.acquired_count(streamed[5]), 0U);
  schedule.release(streamed[0]);
  const auto acquired = schedule.acquire(streamed[5]);
  EXPECT_NE(acquired.slot, PagerSchedule::kNone);
}

// ---- the staged path's parallel host copy ------------------------------------------

void copies_every_byte(bool streaming);

TEST(ParallelCopy, CopiesEveryByteForManySizesBackToBack) {
  for (const bool streaming : {true, false}) {
    SCOPED_TRACE(streaming ? "non-temporal stores" : "memcpy");
    copies_every_byte(streaming);
  }
}

void copies_every_byte(bool streaming) {
  detail::ParallelCopy copy(4, streaming);
  std::vector<std::byte> source(9_MiB + 123);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = std::byte(i * 131 % 251);
  std::vector<std::byte> destination(source.size());
  for (std::size_t bytes : {std::size_t{1}, 4_KiB, 1_MiB - 1, 2_MiB + 7, 9_MiB + 123}) {
    for (int round = 0; round < 20; ++round) {
      std::fill(destination.begin(), destination.end(), std::byte{0});
      const std::size_t offset = static_cast<std::size_t>(round) % 3;
      const std::size_t length = std::min(bytes, source.size() - offset);
      copy.run(destination.data() + offset, source.data() + offset, length);
      ASSERT_EQ(std::memcmp(destination.data() + offset, source.data() + offset, length), 0)
          << bytes << " bytes, round " << round;
    }
  }
}

// The non-temporal copy: every alignment of source and destination, sizes around its
// 16-byte alignment head and 64-byte blocks, and not a byte outside the destination.
TEST(ParallelCopy, StreamingCopyMatchesMemcpyAtEveryAlignmentAndTouchesNothingElse) {
  std::vector<std::byte> source(4096 + 64);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = std::byte(i * 37 % 253 + 1);
  std::vector<std::byte> destination(source.size() + 64);
  for (std::size_t to = 0; to < 17; ++to) {
    for (std::size_t from = 0; from < 17; from += 3) {
      for (std::size_t bytes :
           {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{63},
            std::size_t{64}, std::size_t{79}, std::size_t{80}, std::size_t{127}, std::size_t{128},
            std::size_t{1000}, std::size_t{4096}}) {
        std::fill(destination.begin(), destination.end(), std::byte{0});
        detail::streaming_copy(destination.data() + to, source.data() + from, bytes);
        ASSERT_EQ(std::memcmp(destination.data() + to, source.data() + from, bytes), 0)
            << "to +" << to << ", from +" << from << ", " << bytes << " bytes";
        for (std::size_t i = 0; i < destination.size(); ++i) {
          if (i < to || i >= to + bytes) {
            ASSERT_EQ(destination[i], std::byte{0}) << "byte " << i << " outside the copy";
          }
        }
      }
    }
  }
}

// ---- the pager over host memory (the CUDA seam replaced) ------------------------------

struct FakeLog {
  std::size_t allocations = 0;
  std::size_t frees = 0;
  std::size_t shutdowns = 0;
  std::size_t page_ins = 0;
  std::size_t order_violations = 0;  // a page-in into a slot still acquired
  bool fail_pin = false;
  bool configured_staged = false;
};

class HostPagerDevice final : public PagerDevice {
 public:
  explicit HostPagerDevice(std::shared_ptr<FakeLog> log) : log_(std::move(log)) {}
  std::string pin_host(std::span<const HostRange> ranges, std::size_t,
                       WeightPagerLoad& load) override {
    if (log_->fail_pin) return "fake: pinning refused";
    for (const auto& range : ranges) load.pinned_bytes += range.bytes;
    load.register_calls = ranges.size();
    return {};
  }
  void* allocate_arena(std::size_t bytes) override {
    ++log_->allocations;
    arena_.assign(bytes, std::byte{0xEE});
    return arena_.data();
  }
  void upload(void* device, const void* host, std::size_t bytes) override {
    std::memcpy(device, host, bytes);
  }
  void configure(std::size_t slots, bool staged, const WeightPagerOptions&) override {
    outstanding_.assign(slots, 0);
    log_->configured_staged = staged;
  }
  void page_in(std::size_t slot, void* device, const void* host, std::size_t bytes) override {
    if (outstanding_[slot] != 0) ++log_->order_violations;
    ++log_->page_ins;
    std::memcpy(device, host, bytes);
  }
  void wait_ready(std::size_t slot, cudaStream_t) override { ++outstanding_[slot]; }
  void record_release(std::size_t slot, cudaStream_t) override { --outstanding_[slot]; }
  void collect(WeightPagerStats&) override {}
  void synchronize() override {}
  void shutdown(void* arena, std::size_t) noexcept override {
    ++log_->shutdowns;
    if (arena != nullptr) ++log_->frees;
  }

 private:
  std::shared_ptr<FakeLog> log_;
  std::vector<std::byte> arena_;
  std::vector<long> outstanding_;
};

struct HostLayers {
  std::vector<std::vector<std::uint32_t>> data;
  std::vector<WeightLayer> layers;
  HostLayers(std::size_t count, std::size_t words) {
    for (std::size_t i = 0; i < count; ++i) {
      data.emplace_back(words + i, static_cast<std::uint32_t>(0xA5000000U + i));
    }
    for (std::size_t i = 0; i < count; ++i) {
      layers.push_back(
          {"layer." + std::to_string(i), data[i].data(), data[i].size() * sizeof(std::uint32_t)});
    }
  }
};

WeightPager make_host_pager(const HostLayers& host, WeightPagerOptions options,
                            const std::shared_ptr<FakeLog>& log) {
  options.print_plan_warnings = false;
  return WeightPager(host.layers, options, std::make_unique<HostPagerDevice>(log));
}

TEST(WeightPagerHost, DeliversEachLayersBytesUnderABudgetOfThreeLayers) {
  HostLayers host(8, 1024);  // 4 KiB + i words each
  auto log = std::make_shared<FakeLog>();
  auto pager =
      make_host_pager(host, {.plan = {.budget_bytes = 3 * 5_KiB, .prefetch_depth = 1}}, log);
  const std::size_t streamed = pager.plan().streamed_layers();
  ASSERT_GT(streamed, 0U);
  for (int step = 0; step < 3; ++step) {
    for (std::size_t i = 0; i < 8; ++i) {
      const void* device = pager.acquire(i, nullptr);
      EXPECT_EQ(std::memcmp(device, host.data[i].data(), host.layers[i].bytes), 0)
          << "layer " << i << " step " << step;
      pager.release(i, nullptr);
    }
  }
  EXPECT_EQ(log->order_violations, 0U);
  const auto stats = pager.stats();
  EXPECT_EQ(stats.acquires, 24U);
  EXPECT_EQ(log->page_ins, stats.page_ins);
  // Every streamed layer once a step, plus layer 0 (streamed here) prefetched for step 4
  // by the last acquire.
  ASSERT_FALSE(pager.plan().resident[0]);
  EXPECT_EQ(stats.page_ins, 3 * streamed + 1);
  EXPECT_GE(stats.hits, 24U - streamed);  // only the first step's first streamed acquire misses
  std::size_t streamed_bytes = 0;
  for (std::size_t i = 0; i < 8; ++i) {
    if (!pager.plan().resident[i]) streamed_bytes += host.layers[i].bytes;
  }
  EXPECT_EQ(stats.bytes_paged_in, 3 * streamed_bytes + host.layers[0].bytes);
  EXPECT_TRUE(pager.load().pinned);
}

TEST(WeightPagerHost, EverythingResidentMeansNoPageInsAndNoPin) {
  HostLayers host(4, 256);
  auto log = std::make_shared<FakeLog>();
  auto pager =
      make_host_pager(host, {.plan = {.budget_bytes = 1_MiB}, .host = HostWeights::pinned}, log);
  EXPECT_EQ(pager.plan().slot_count, 0U);
  for (int step = 0; step < 2; ++step) {
    for (std::size_t i = 0; i < 4; ++i) {
      const void* device = pager.acquire(i, nullptr);
      EXPECT_EQ(std::memcmp(device, host.data[i].data(), host.layers[i].bytes), 0);
      pager.release(i, nullptr);
    }
  }
  EXPECT_EQ(pager.stats().page_ins, 0U);
  EXPECT_EQ(pager.stats().hits, 8U);
  EXPECT_EQ(pager.load().register_calls, 0U);  // resident layers are copied once, not pinned
  EXPECT_FALSE(pager.load().pinned);
}

TEST(WeightPagerHost, AcquireByNameAndUnknownNames) {
  HostLayers host(4, 256);
  auto log = std::make_shared<FakeLog>();
  auto pager = make_host_pager(host, {.plan = {.budget_bytes = 2_KiB + 1024}}, log);
  EXPECT_EQ(pager.index_of("layer.2"), 2U);
  const void* device = pager.acquire("layer.2", nullptr);
  EXPECT_EQ(std::memcmp(device, host.data[2].data(), host.layers[2].bytes), 0);
  pager.release("layer.2", nullptr);
  EXPECT_THROW((void)pager.acquire("nope", nullptr), InvalidArgument);
  EXPECT_THROW(pager.release("nope", nullptr), InvalidArgument);
}

TEST(WeightPagerHost, ReleasingALayerNotAcquiredIsAnErrorAndChangesNothing) {
  HostLayers host(4, 256);
  auto log = std::make_shared<FakeLog>();
  auto pager = make_host_pager(host, {.plan = {.budget_bytes = 3_KiB}}, log);
  EXPECT_THROW(pager.release(1, nullptr), InvalidArgument);
  EXPECT_THROW(pager.release(9, nullptr), InvalidArgument);
  (void)pager.acquire(1, nullptr);
  pager.release(1, nullptr);
  EXPECT_THROW(pager.release(1, nullptr), InvalidArgument);
  EXPECT_EQ(pager.stats().acquires, 1U);
  (void)pager.acquire(1, nullptr);  // still usable
  pager.release(1, nullptr);
}

TEST(WeightPagerHost, BadConstructionInputAllocatesNothing) {
  HostLayers host(3, 256);
  auto log = std::make_shared<FakeLog>();
  EXPECT_THROW(make_host_pager(host, {.plan = {.budget_bytes = 0}}, log), InvalidArgument);
  EXPECT_THROW(make_host_pager(host, {.plan = {.budget_bytes = 512}}, log),
               InvalidArgument);  // < layer
  auto duplicate = host;
  duplicate.layers[1].name = "layer.0";
  EXPECT_THROW(make_host_pager(duplicate, {.plan = {.budget_bytes = 1_MiB}}, log), InvalidArgument);
  auto null_layer = host;
  null_layer.layers[2].host = nullptr;
  EXPECT_THROW(make_host_pager(null_layer, {.plan = {.budget_bytes = 1_MiB}}, log),
               InvalidArgument);
  EXPECT_THROW(make_host_pager(HostLayers(0, 1), {.plan = {.budget_bytes = 1_MiB}}, log),
               InvalidArgument);
  EXPECT_EQ(log->allocations, 0U);
}

TEST(WeightPagerHost, HandleSaysPagerDestroyed) {
  HostLayers host(4, 256);
  auto log = std::make_shared<FakeLog>();
  std::optional<WeightPager::Handle> handle;
  {
    auto pager = make_host_pager(host, {.plan = {.budget_bytes = 3_KiB}}, log);
    handle.emplace(pager.handle());
    EXPECT_TRUE(handle->alive());
    (void)handle->acquire(0, nullptr);
    handle->release(0, nullptr);
  }
  EXPECT_FALSE(handle->alive());
  try {
    (void)handle->acquire(0, nullptr);
    FAIL() << "acquire on a destroyed pager did not throw";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("pager destroyed"), std::string::npos);
  }
  EXPECT_THROW(handle->release(0, nullptr), InvalidArgument);
  EXPECT_EQ(log->shutdowns, 1U);
  EXPECT_EQ(log->frees, 1U);  // the arena went back exactly once
}

TEST(WeightPagerHost, PinFailureFallsBackWithOneWarningOrThrowsWhenPinnedWasAsked) {
  HostLayers host(8, 256);
  auto log = std::make_shared<FakeLog>();
  log->fail_pin = true;
  ::testing::internal::CaptureStderr();
  {
    auto pager = make_host_pager(
        host, {.plan = {.budget_bytes = 3_KiB}, .host = HostWeights::automatic}, log);
    EXPECT_FALSE(pager.load().pinned);
    EXPECT_NE(pager.load().fallback_reason.find("refused"), std::string::npos);
    EXPECT_TRUE(log->configured_staged);
    for (std::size_t i = 0; i < 8; ++i) {
      (void)pager.acquire(i, nullptr);
      pager.release(i, nullptr);
    }
  }
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  std::size_t count = 0;
  for (std::size_t at = warnings.find("WARNING"); at != std::string::npos;
       at = warnings.find("WARNING", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1U) << warnings;
  const std::size_t allocations = log->allocations;
  EXPECT_THROW(
      make_host_pager(host, {.plan = {.budget_bytes = 3_KiB}, .host = HostWeights::pinned}, log),
      PinningError);
  EXPECT_EQ(log->allocations, allocations);  // nothing allocated for the failed pager
}

TEST(WeightPagerHost, MovedFromPagerThrows) {
  HostLayers host(2, 256);
  auto log = std::make_shared<FakeLog>();
  auto pager = make_host_pager(host, {.plan = {.budget_bytes = 4_KiB}}, log);
  WeightPager other = std::move(pager);
  EXPECT_THROW((void)pager.acquire(0, nullptr),
               InvalidArgument);  // NOLINT(bugprone-use-after-move)
  (void)other.acquire(0, nullptr);
  other.release(0, nullptr);
}

// ---- a Handle used from other threads while the owner destroys the pager -------------

// Threads hammer Handle::acquire/release while the owner destroys the pager and then frees
// the host weights. Each call either completes on the live pager or throws "pager
// destroyed"; the teardown runs in the owner's destructor (the device is shut down when
// it returns), and no call reads the weights or the arena after it.
TEST(WeightPagerThreads, HandleCallsRacingThePagersDestructionCompleteOrThrow) {
  constexpr int kIterations = 150;
  constexpr std::size_t kThreads = 4;
  constexpr std::size_t kLayers = 2 * kThreads;
  std::uint64_t completed_total = 0;
  ::testing::internal::CaptureStderr();  // the destructor warns about layers still acquired
  for (int iteration = 0; iteration < kIterations; ++iteration) {
    auto host = std::make_unique<HostLayers>(kLayers, 8192);  // 32 KiB + i words a layer
    auto log = std::make_shared<FakeLog>();
    std::optional<WeightPager> pager(
        make_host_pager(*host, {.plan = {.budget_bytes = 4 * 33_KiB, .prefetch_depth = 2}}, log));
    const WeightPager::Handle handle = pager->handle();
    std::atomic<std::size_t> running{0};
    std::atomic<std::uint64_t> completed{0};
    std::atomic<std::uint64_t> refused{0};
    std::atomic<std::uint64_t> unexpected{0};
    auto count_refusal = [&](const InvalidArgument& error) {
      const bool destroyed = std::string(error.what()).find("pager destroyed") != std::string::npos;
      (destroyed ? refused : unexpected).fetch_add(1);
    };
    std::vector<std::thread> threads;
    for (std::size_t t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        running.fetch_add(1);
        for (std::size_t call = 0;; ++call) {
          const std::size_t layer = t + kThreads * (call % 2);
          try {
            (void)handle.acquire(layer, nullptr);
          } catch (const OutOfMemory&) {
            std::this_thread::yield();  // every slot acquired by the other threads
            continue;
          } catch (const InvalidArgument& error) {
            count_refusal(error);
            return;
          }
          try {
            handle.release(layer, nullptr);
          } catch (const InvalidArgument& error) {
            count_refusal(error);
            return;
          }
          completed.fetch_add(1);
        }
      });
    }
    while (running.load() < kThreads || completed.load() < 8) std::this_thread::yield();
    pager.reset();  // the owner destroys the pager while the threads are calling
    EXPECT_EQ(log->shutdowns, 1U) << "the teardown must be done when the destructor returns";
    EXPECT_EQ(log->frees, 1U);
    EXPECT_FALSE(handle.alive());
    host.reset();  // the weights are gone: no call may read them any more
    for (auto& thread : threads) thread.join();
    EXPECT_EQ(refused.load(), kThreads);
    EXPECT_EQ(unexpected.load(), 0U);
    completed_total += completed.load();
  }
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  for (std::size_t at = 0; at < warnings.size();) {
    const std::size_t end = std::min(warnings.find('\n', at), warnings.size());
    EXPECT_NE(warnings.substr(at, end - at).find("still acquired"), std::string::npos)
        << warnings.substr(at, end - at);
    at = end + 1;
  }
  EXPECT_GE(completed_total, 8U * kIterations);
}

// ---- on a GPU ---------------------------------------------------------------------------

#if defined(VRAM_HAVE_TEST_KERNELS)

struct GpuLayers {
  std::vector<std::vector<std::uint32_t>> data;
  std::vector<WeightLayer> layers;
  GpuLayers(std::size_t count, std::size_t words) {
    for (std::size_t i = 0; i < count; ++i) {
      data.emplace_back(words, pattern(i));
      layers.push_back({"layer." + std::to_string(i), nullptr, words * sizeof(std::uint32_t)});
    }
    for (std::size_t i = 0; i < count; ++i) layers[i].host = data[i].data();
  }
  static std::uint32_t pattern(std::size_t i) {
    return 0x5EED0000U + static_cast<std::uint32_t>(i) * 7919U;
  }
};

// 8 layers cycling 3 steps under a budget of 3 layers: checks every word on the device.
void run_and_verify(WeightPagerOptions options, std::size_t words) {
  GpuLayers host(8, words);
  options.plan.budget_bytes = 3 * words * sizeof(std::uint32_t);
  options.print_plan_warnings = false;
  WeightPager pager(host.layers, options);
  ASSERT_GT(pager.plan().streamed_layers(), 0U);
  cuda::Stream stream;
  unsigned long long* mismatches = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches), cudaSuccess);
  // Zeroed on the test's own (non-blocking) stream, which does not wait for the legacy one.
  ASSERT_EQ(cudaMemsetAsync(mismatches, 0, sizeof *mismatches, stream.get()), cudaSuccess);
  for (int step = 0; step < 3; ++step) {
    for (std::size_t i = 0; i < 8; ++i) {
      const void* device = pager.acquire(i, stream.get());
      launch_count_mismatches(device, words, GpuLayers::pattern(i), mismatches, stream.get());
      pager.release(i, stream.get());
    }
  }
  stream.synchronize();
  unsigned long long found = 1;
  ASSERT_EQ(cudaMemcpy(&found, mismatches, sizeof found, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(mismatches);
  EXPECT_EQ(found, 0U);
  const auto stats = pager.stats();
  EXPECT_EQ(stats.acquires, 24U);
  // The same decisions, replayed on the host: the page-ins the pager had to issue.
  PagerSchedule replay(pager.plan());
  std::size_t expected_page_ins = 0;
  for (int step = 0; step < 3; ++step) {
    for (std::size_t i = 0; i < 8; ++i) {
      expected_page_ins += replay.acquire(i).page_ins.size();
      replay.release(i);
    }
  }
  EXPECT_GE(expected_page_ins, 3 * pager.plan().streamed_layers());
  EXPECT_EQ(stats.page_ins, expected_page_ins);
  EXPECT_GT(stats.timed_page_ins, 0U);  // sampled every page-in, read after the sync
  EXPECT_GT(stats.effective_gbps, 0.0);
  EXPECT_EQ(stats.staging_pin_calls, 0U);
}

TEST(WeightPagerGpu, PinnedWeightsDeliverEveryByte) {
  VRAM_GPU_TEST_OR_SKIP();
  run_and_verify(
      {.plan = {.prefetch_depth = 1}, .host = HostWeights::pinned, .stall_sample_period = 1},
      (1_MiB + 4096) / 4);
}

TEST(WeightPagerGpu, PageableWeightsDeliverEveryByteThroughStaging) {
  VRAM_GPU_TEST_OR_SKIP();
  // Chunks smaller than a layer and a layer that is not a multiple of the chunk.
  run_and_verify({.plan = {.prefetch_depth = 1},
                  .host = HostWeights::pageable,
                  .staging_chunk_bytes = 256_KiB,
                  .staging_buffers = 3,
                  .fill_threads = 3,
                  .stall_sample_period = 1},
                 (1_MiB + 4096) / 4);
}

TEST(WeightPagerGpu, DeeperPrefetchAndAutomaticPinning) {
  VRAM_GPU_TEST_OR_SKIP();
  run_and_verify(
      {.plan = {.prefetch_depth = 2}, .host = HostWeights::automatic, .stall_sample_period = 1},
      256_KiB / 4);
}

TEST(WeightPagerGpu, StepsAlternatingBetweenTwoStreamsSeeTheRightBytes) {
  VRAM_GPU_TEST_OR_SKIP();
  // Eviction after a release on stream A must wait for A even when the next user is B.
  const std::size_t words = 512_KiB / 4;
  GpuLayers host(8, words);
  WeightPager pager(host.layers, {.plan = {.budget_bytes = 3 * 512_KiB, .prefetch_depth = 1},
                                  .host = HostWeights::pinned,
                                  .print_plan_warnings = false});
  cuda::Stream streams[2];
  unsigned long long* mismatches = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches), cudaSuccess);
  ASSERT_EQ(cudaMemset(mismatches, 0, sizeof *mismatches), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the streams do not wait for the legacy one
  for (int step = 0; step < 4; ++step) {
    const cudaStream_t stream = streams[step % 2].get();
    for (std::size_t i = 0; i < 8; ++i) {
      const void* device = pager.acquire(i, stream);
      // A slow reader: a later page-in into its slot must not overwrite it early.
      launch_spin_then_fill(nullptr, 0, 0, 20000, stream);  // spins 20 us, writes nothing
      launch_count_mismatches(device, words, GpuLayers::pattern(i), mismatches, stream);
      pager.release(i, stream);
    }
  }
  streams[0].synchronize();
  streams[1].synchronize();
  unsigned long long found = 1;
  ASSERT_EQ(cudaMemcpy(&found, mismatches, sizeof found, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(mismatches);
  EXPECT_EQ(found, 0U);
}

TEST(WeightPagerGpu, PinsOnlyTheStreamedLayersAndReportsIt) {
  VRAM_GPU_TEST_OR_SKIP();
  GpuLayers host(8, 1_MiB / 4);
  WeightPager pager(host.layers, {.plan = {.budget_bytes = 3_MiB, .prefetch_depth = 1},
                                  .host = HostWeights::pinned,
                                  .print_plan_warnings = false});
  const auto& load = pager.load();
  EXPECT_TRUE(load.pinned);
  EXPECT_GE(load.pinned_bytes, pager.plan().streamed_layers() * 1_MiB);
  EXPECT_GE(load.register_calls, 1U);
  EXPECT_GT(load.pin_seconds, 0.0);
}

// Layers packed in one host buffer at offsets that are not page-aligned: a resident layer
// shares its first and last pages with streamed (pinned) ones, so its upload and their
// page-ins each cross the edge of a registration.
TEST(WeightPagerGpu, PackedLayersSharingPagesUploadAndStreamEveryByte) {
  VRAM_GPU_TEST_OR_SKIP();
  constexpr std::size_t kLayers = 8;
  const std::size_t words = (1_MiB + 100) / 4;
  std::vector<std::uint32_t> packed(kLayers * words + 64);
  std::vector<WeightLayer> layers;
  for (std::size_t i = 0; i < kLayers; ++i) {
    std::uint32_t* at = packed.data() + 25 + i * words;  // 100 bytes in: never page-aligned
    std::fill(at, at + words, GpuLayers::pattern(i));
    layers.push_back({"layer." + std::to_string(i), at, words * sizeof(std::uint32_t)});
  }
  WeightPager pager(
      layers, {.plan = {.budget_bytes = 5 * words * sizeof(std::uint32_t), .prefetch_depth = 1},
               .host = HostWeights::pinned,
               .print_plan_warnings = false});
  ASSERT_GT(pager.plan().streamed_layers(), 0U);
  ASSERT_LT(pager.plan().streamed_layers(), kLayers);
  cuda::Stream stream;
  unsigned long long* mismatches = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(mismatches, 0, sizeof *mismatches, stream.get()), cudaSuccess);
  for (int step = 0; step < 2; ++step) {
    for (std::size_t i = 0; i < kLayers; ++i) {
      const void* device = pager.acquire(i, stream.get());
      launch_count_mismatches(device, words, GpuLayers::pattern(i), mismatches, stream.get());
      pager.release(i, stream.get());
    }
  }
  stream.synchronize();
  unsigned long long found = 1;
  ASSERT_EQ(cudaMemcpy(&found, mismatches, sizeof found, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(mismatches);
  EXPECT_EQ(found, 0U);
}

#endif  // VRAM_HAVE_TEST_KERNELS

}  // namespace
}  // namespace vram::testing
