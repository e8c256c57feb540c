// A segment tier's upstream and driver calls run outside its mutex: while one thread grows
// the tier (a map, its out-of-memory retry, the address reservation, or a new segment from
// the upstream, blocked here on a gate), records or waits for or queries stream markers,
// other threads allocate from and free to the memory the tier already holds; a request that
// needs more waits for the growth in progress and is then served; nothing overlaps and
// every byte goes back.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <set>

#include "test_upstreams.hpp"
#include "tier/segment_tier.hpp"
#include "vram/units.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;
using detail::kUntagged;
using detail::SegmentTier;
using std::chrono::seconds;

// Caller streams (stand-in handles: only compared, never used).
const detail::StreamKey s = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
const detail::StreamKey t = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
const detail::StreamKey u = detail::stream_key(reinterpret_cast<cudaStream_t>(0x30));

// Holds the next call that passes through it until open(); entered() waits for that call.
class Gate {
 public:
  // once: only the first call that passes is held; later ones go through.
  void arm(bool once = false) {
    std::lock_guard lock(mutex_);
    armed_ = true;
    once_ = once;
    entered_ = false;
  }
  void pass() {
    std::unique_lock lock(mutex_);
    if (!armed_ || (once_ && entered_)) return;
    entered_ = true;
    changed_.notify_all();
    changed_.wait(lock, [this] { return !armed_; });
  }
  bool entered(seconds limit) {
    std::unique_lock lock(mutex_);
    return changed_.wait_for(lock, limit, [this] { return entered_; });
  }
  void open() {
    std::lock_guard lock(mutex_);
    armed_ = false;
    changed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool armed_ = false;
  bool once_ = false;
  bool entered_ = false;
};

// Holds maps (or, with gate_reserve, the reservation) at the gate; the next fail_maps maps
// throw OutOfMemory instead.
class GatedVirtualMemory final : public VirtualMemory {
 public:
  GatedVirtualMemory(std::shared_ptr<Upstream> physical, Gate& gate, bool gate_reserve = false,
                     int fail_maps = 0)
      : inner_(std::move(physical)),
        gate_(gate),
        gate_reserve_(gate_reserve),
        fail_maps_(fail_maps) {}
  std::size_t granularity() const noexcept override { return inner_.granularity(); }
  char* reserve(std::size_t bytes) override {
    if (gate_reserve_) gate_.pass();
    return inner_.reserve(bytes);
  }
  void unreserve(char* base, std::size_t bytes) noexcept override { inner_.unreserve(base, bytes); }
  std::uint64_t map(char* address, std::size_t bytes) override {
    if (fail_maps_ > 0) {
      --fail_maps_;
      throw OutOfMemory(bytes, 0, 0, "no physical memory left (test)");
    }
    if (!gate_reserve_) gate_.pass();
    return inner_.map(address, bytes);
  }
  void unmap(char* address, std::size_t bytes, std::uint64_t handle) noexcept override {
    inner_.unmap(address, bytes, handle);
  }
  void fail_next_maps(int count) { fail_maps_ = count; }  // with no growth in progress

 private:
  HostVirtualMemory inner_;
  Gate& gate_;
  bool gate_reserve_;
  int fail_maps_;  // only the growth mutex holder maps
};

// Holds allocations (or, with gate_frees, frees) at the gate.
class GatedUpstream final : public Upstream {
 public:
  GatedUpstream(std::shared_ptr<Upstream> inner, Gate& gate, bool gate_frees = false)
      : inner_(std::move(inner)), gate_(gate), gate_frees_(gate_frees) {}
  void* allocate(std::size_t bytes) override {
    if (!gate_frees_) gate_.pass();
    return inner_->allocate(bytes);
  }
  void deallocate(void* block, std::size_t bytes) noexcept override {
    if (gate_frees_) gate_.pass();
    inner_->deallocate(block, bytes);
  }
  MemoryKind kind() const noexcept override { return inner_->kind(); }
  std::string_view name() const noexcept override { return "gated"; }

 private:
  std::shared_ptr<Upstream> inner_;
  Gate& gate_;
  bool gate_frees_;
};

// A free past max_free_bytes while another free gives a segment back (its upstream free held
// at the gate) gives nothing back itself; the other gives its memory back before it lets go.
TEST(SegmentTierGrowthOutsideLock, AGiveBackSkippedDuringAnotherIsMadeBeforeItEnds) {
  Gate gate;
  auto counted = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  GatedUpstream upstream(counted, gate, /*gate_frees=*/true);
  ManualFence fence;
  detail::ReservedGauge gauge;
  {
    SegmentTier tier(upstream, fence, gauge, {.granularity = 512, .max_free_bytes = 0});
    void* a = tier.allocate(16_MiB, kUntagged, true);  // a segment each
    void* b = tier.allocate(16_MiB, kUntagged, true);
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    gate.arm();
    auto first = std::async(std::launch::async, [&] { return tier.free(a, kUntagged); });
    ASSERT_TRUE(gate.entered(seconds(10))) << "the free did not give its segment back";
    auto second = std::async(std::launch::async, [&] { return tier.free(b, kUntagged); });
    const bool in_time = second.wait_for(seconds(10)) == std::future_status::ready;
    gate.open();
    EXPECT_TRUE(in_time) << "a free waited for another free's upstream call";
    EXPECT_TRUE(first.get());
    EXPECT_TRUE(second.get());
    EXPECT_EQ(tier.counters().free_bytes, 0U) << "the second free's give-back was lost";
    EXPECT_EQ(tier.counters().reserved, 0U);
  }
  EXPECT_EQ(counted->live_bytes(), 0U);
}

// A ManualFence whose wait() is held by a Gate, and which counts waits for a marker already
// released (the marker could then be another stream's: never allowed).
class GatedFence final : public StreamFence {
 public:
  // gate_queries: completed() passes the gate too (else only wait()); gate_records:
  // record() passes it (and neither of the others does); instant: every marker is complete.
  explicit GatedFence(Gate& gate, bool gate_queries = false, bool gate_records = false,
                      bool instant = false)
      : gate_(gate),
        gate_queries_(gate_queries && !gate_records),
        gate_records_(gate_records),
        instant_(instant) {}
  std::uint64_t record(cudaStream_t stream) override {
    if (gate_records_) gate_.pass();
    return inner_.record(stream);
  }
  bool completed(std::uint64_t marker) noexcept override {
    check_not_released(marker);
    if (gate_queries_) gate_.pass();
    const bool done = instant_ || inner_.completed(marker);
    check_not_released(marker);  // released during the query
    return done;
  }
  void wait(std::uint64_t marker) noexcept override {
    check_not_released(marker);
    if (!gate_queries_ && !gate_records_) gate_.pass();
    inner_.wait(marker);
    check_not_released(marker);  // released during the wait
  }
  void release(std::uint64_t marker) noexcept override {
    std::lock_guard lock(mutex_);
    released_.insert(marker);
  }
  void quiesce() noexcept override { inner_.quiesce(); }
  void complete_all() { inner_.complete_all(); }
  std::uint64_t recorded() const { return inner_.recorded(); }
  // Queries and waits that met a released marker.
  std::uint64_t waits_for_released() {
    std::lock_guard lock(mutex_);
    return waits_for_released_;
  }
  bool released(std::uint64_t marker) {
    std::lock_guard lock(mutex_);
    return released_.count(marker) != 0;
  }

 private:
  void check_not_released(std::uint64_t marker) {
    std::lock_guard lock(mutex_);
    if (released_.count(marker) != 0) ++waits_for_released_;
  }
  ManualFence inner_;
  Gate& gate_;
  bool gate_queries_;
  bool gate_records_;
  bool instant_;
  std::mutex mutex_;
  std::set<std::uint64_t> released_;
  std::uint64_t waits_for_released_ = 0;
};

// A free 1 MiB range the tier holds (kept apart from the rest by the live block `post`) and
// a wholly free 32 MiB segment freed on `stream` (`streamed`); null on a failure.
struct HeldAndStreamed {
  void* post = nullptr;
  void* streamed = nullptr;
};
HeldAndStreamed held_and_streamed(SegmentTier& tier, detail::StreamKey stream) {
  void* kept_free = tier.allocate(1_MiB, kUntagged, true);
  HeldAndStreamed made{tier.allocate(1_MiB, kUntagged, true), tier.allocate(32_MiB, stream, true)};
  if (kept_free == nullptr || !tier.free(kept_free, kUntagged)) made.post = nullptr;
  if (made.streamed != nullptr && !tier.free(made.streamed, stream)) made.streamed = nullptr;
  return made;
}

// While `grower` is held in its upstream call, the tier serves what it holds and takes
// frees; a second growth waits for the first and is then served.
void check_growth_outside_the_mutex(SegmentTier& tier, Gate& gate, std::size_t held_block,
                                    std::size_t grown_block) {
  // A free range the tier holds (mapped), kept apart from the rest by a live block.
  void* kept_free = tier.allocate(held_block, kUntagged, true);
  void* fence_post = tier.allocate(held_block, kUntagged, true);
  ASSERT_NE(kept_free, nullptr);
  ASSERT_NE(fence_post, nullptr);
  ASSERT_TRUE(tier.free(kept_free, kUntagged));

  gate.arm();
  auto grower =
      std::async(std::launch::async, [&] { return tier.allocate(grown_block, kUntagged, true); });
  ASSERT_TRUE(gate.entered(seconds(10))) << "the growth never reached its upstream call";

  // The growth is inside its upstream call: the tier's mutex must be free.
  auto served = std::async(std::launch::async, [&] {
    void* block = tier.allocate(held_block / 2, kUntagged, false);
    if (block != nullptr) std::memset(block, 0x5a, held_block / 2);
    const bool freed = block != nullptr && tier.free(block, kUntagged);
    return freed && tier.owns(fence_post);
  });
  const bool in_time = served.wait_for(seconds(10)) == std::future_status::ready;
  // A second growth waits for the first (it would need the granules or upstream too).
  auto second =
      std::async(std::launch::async, [&] { return tier.allocate(grown_block, kUntagged, true); });
  gate.open();  // lets the first growth (and any later upstream call) through
  EXPECT_TRUE(in_time) << "an allocation from held memory waited for the growth's upstream call";
  if (!in_time) served.wait();
  EXPECT_TRUE(served.get()) << "held memory did not serve, or a free failed, during growth";

  void* grown = grower.get();
  void* grown_again = second.get();
  ASSERT_NE(grown, nullptr);
  ASSERT_NE(grown_again, nullptr);
  const auto a = reinterpret_cast<std::uintptr_t>(grown);
  const auto b = reinterpret_cast<std::uintptr_t>(grown_again);
  EXPECT_TRUE(a + grown_block <= b || b + grown_block <= a) << "two growths overlap";
  std::memset(grown, 1, grown_block);  // mapped (host emulation: a fault otherwise)
  std::memset(grown_again, 2, grown_block);
  EXPECT_TRUE(tier.free(grown, kUntagged));
  EXPECT_TRUE(tier.free(grown_again, kUntagged));
  EXPECT_TRUE(tier.free(fence_post, kUntagged));
  tier.trim(0, true);
  EXPECT_EQ(tier.counters().reserved, 0U);
}

TEST(SegmentTierGrowthOutsideLock, VirtualTierServesHeldMemoryWhileAMapIsInProgress) {
  Gate gate;
  auto physical = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  GatedVirtualMemory vm(physical, gate);
  ManualFence fence;
  detail::ReservedGauge gauge;
  {
    SegmentTier tier(*physical, fence, gauge,
                     {.granularity = 512, .virtual_memory = &vm, .reservation = 1_GiB});
    check_growth_outside_the_mutex(tier, gate, 4_MiB, 32_MiB);
  }
  EXPECT_EQ(physical->live_bytes(), 0U);
  EXPECT_EQ(physical->bad_frees(), 0U);
}

TEST(SegmentTierGrowthOutsideLock, SegmentTierServesHeldMemoryWhileANewSegmentIsAllocated) {
  Gate gate;
  auto counted = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  GatedUpstream upstream(counted, gate);
  ManualFence fence;
  detail::ReservedGauge gauge;
  {
    SegmentTier tier(upstream, fence, gauge, {.granularity = 512});
    check_growth_outside_the_mutex(tier, gate, 1_MiB, 32_MiB);
  }
  EXPECT_EQ(counted->live_bytes(), 0U);
  EXPECT_EQ(counted->bad_frees(), 0U);
}

// Frees past max_free_bytes during a growth give nothing back at once (the growth mutex is
// taken); the growth gives the excess back as it ends.
TEST(SegmentTierGrowthOutsideLock, FreesDuringAGrowthGiveBackWhenItEnds) {
  Gate gate;
  auto physical = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  GatedVirtualMemory vm(physical, gate);
  ManualFence fence;
  detail::ReservedGauge gauge;
  SegmentTier tier(
      *physical, fence, gauge,
      {.granularity = 512, .max_free_bytes = 8_MiB, .virtual_memory = &vm, .reservation = 1_GiB});
  void* big = tier.allocate(24_MiB, kUntagged, true);
  void* post = tier.allocate(2_MiB, kUntagged, true);
  ASSERT_NE(big, nullptr);
  ASSERT_NE(post, nullptr);
  gate.arm();
  auto grower =
      std::async(std::launch::async, [&] { return tier.allocate(16_MiB, kUntagged, true); });
  ASSERT_TRUE(gate.entered(seconds(10)));
  auto freed = std::async(std::launch::async, [&] { return tier.free(big, kUntagged); });
  const bool in_time = freed.wait_for(seconds(10)) == std::future_status::ready;
  gate.open();
  EXPECT_TRUE(in_time) << "a free waited for the growth's map";
  EXPECT_TRUE(freed.get());
  void* grown = grower.get();
  ASSERT_NE(grown, nullptr);
  EXPECT_LE(tier.counters().free_bytes, 8_MiB) << "the growth did not give back the excess";
  EXPECT_TRUE(tier.free(grown, kUntagged));
  EXPECT_TRUE(tier.free(post, kUntagged));
  tier.trim(0, true);
  EXPECT_EQ(tier.counters().reserved, 0U);
  EXPECT_EQ(physical->live_bytes(), 0U);
}

// Before growing, a segment tier waits for the marker of a wholly free segment another
// stream freed: with the tier's mutex released. Meanwhile the held memory serves, and the
// marker completes and another call's poll untags the segment: the marker is released only
// after the wait, which ends in the segment serving the request (no new segment).
TEST(SegmentTierGrowthOutsideLock, MarkerWaitsBeforeGrowingReleaseTheMutex) {
  Gate gate;
  GatedFence fence(gate);
  auto counted = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  detail::ReservedGauge gauge;
  {
    SegmentTier tier(*counted, fence, gauge, {.granularity = 512});
    const auto [post, streamed] = held_and_streamed(tier, s);
    ASSERT_NE(post, nullptr);
    ASSERT_NE(streamed, nullptr);
    const std::uint64_t segments_before = counted->allocations();

    gate.arm();
    auto grower = std::async(std::launch::async, [&] { return tier.allocate(32_MiB, t, true); });
    ASSERT_TRUE(gate.entered(seconds(10))) << "growing did not wait for stream s's marker";
    // The marker completes during the wait: the next call's poll untags s's segment, and
    // the release of the marker waits for the end of the wait.
    fence.complete_all();
    auto served = std::async(std::launch::async, [&] {
      void* block = tier.allocate(512_KiB, kUntagged, false);
      return block != nullptr && tier.free(block, kUntagged);
    });
    const bool in_time = served.wait_for(seconds(10)) == std::future_status::ready;
    gate.open();
    EXPECT_TRUE(in_time) << "an allocation from held memory waited for a marker wait";
    EXPECT_TRUE(served.get());
    void* grown = grower.get();
    EXPECT_EQ(grown, streamed) << "the waited-for segment did not serve the request";
    EXPECT_EQ(counted->allocations(), segments_before) << "the tier grew after the wait";
    EXPECT_EQ(fence.waits_for_released(), 0U);
    ASSERT_TRUE(tier.free(grown, t));
    ASSERT_TRUE(tier.free(post, kUntagged));
    tier.trim(0, true);  // waits for t's marker the same way (the gate is open)
    EXPECT_EQ(tier.counters().reserved, 0U);
  }
  EXPECT_EQ(counted->live_bytes(), 0U);
  EXPECT_EQ(fence.waits_for_released(), 0U);
}

// Pending markers are queried with the tier's mutex released: while one call's query is
// held, another call allocates from held memory, finds the marker completed and untags its
// ranges; the marker is released only after the held query is done with it.
TEST(SegmentTierGrowthOutsideLock, MarkerQueriesReleaseTheMutexAndKeepTheMarker) {
  Gate gate;
  GatedFence fence(gate, /*gate_queries=*/true);
  auto counted = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  detail::ReservedGauge gauge;
  {
    SegmentTier tier(*counted, fence, gauge, {.granularity = 512});
    void* post = tier.allocate(1_MiB, kUntagged, true);
    void* streamed = tier.allocate(32_MiB, s, true);
    ASSERT_NE(post, nullptr);
    ASSERT_NE(streamed, nullptr);
    ASSERT_TRUE(tier.free(streamed, s));
    // Stream t's request fits nowhere else: s's segment is fenced (marker 1), not served.
    EXPECT_EQ(tier.allocate(32_MiB, t, false), nullptr);
    ASSERT_EQ(fence.recorded(), 1U);

    gate.arm(/*once=*/true);
    auto held_query =
        std::async(std::launch::async, [&] { return tier.allocate(512_KiB, kUntagged, false); });
    ASSERT_TRUE(gate.entered(seconds(10))) << "the pending marker was not queried";
    fence.complete_all();
    auto other = std::async(std::launch::async, [&] {
      void* big = tier.allocate(32_MiB, t, false);  // its query untags s's segment
      return big;
    });
    const bool in_time = other.wait_for(seconds(10)) == std::future_status::ready;
    EXPECT_FALSE(fence.released(1)) << "a marker was released while a query held it";
    gate.open();
    EXPECT_TRUE(in_time) << "a call waited for another call's marker query";
    void* big = other.get();
    void* small = held_query.get();
    EXPECT_EQ(big, streamed) << "the completed marker did not untag s's segment";
    EXPECT_NE(small, nullptr);
    EXPECT_TRUE(fence.released(1)) << "the marker was never released";
    EXPECT_EQ(fence.waits_for_released(), 0U);
    EXPECT_TRUE(tier.free(big, t));
    if (small != nullptr) EXPECT_TRUE(tier.free(small, kUntagged));
    EXPECT_TRUE(tier.free(post, kUntagged));
    tier.trim(0, true);
    EXPECT_EQ(tier.counters().reserved, 0U);
  }
  EXPECT_EQ(counted->live_bytes(), 0U);
  EXPECT_EQ(fence.waits_for_released(), 0U);
}

// True when a call of `probe` returns within 10 s while `call` (run first, on another
// thread) is held at `gate`; then opens the gate and returns `call`'s result in *result.
template <class Call, class Probe, class Result>
bool runs_while_held(Gate& gate, Call call, Probe probe, Result* result) {
  gate.arm(/*once=*/true);
  auto held = std::async(std::launch::async, call);
  if (!gate.entered(seconds(10))) {
    gate.open();
    *result = held.get();
    ADD_FAILURE() << "the call never reached the gate";
    return false;
  }
  auto probed = std::async(std::launch::async, probe);
  const bool in_time = probed.wait_for(seconds(10)) == std::future_status::ready;
  gate.open();
  EXPECT_TRUE(probed.get()) << "the probe failed";
  *result = held.get();
  return in_time;
}

// A request that would grow while another stream holds free memory fences that stream:
// its marker is recorded with the tier's mutex released. Meanwhile held memory serves and
// frees go through; the marker then covers the other stream's segment.
TEST(SegmentTierGrowthOutsideLock, MarkerRecordsReleaseTheMutex) {
  Gate gate;
  GatedFence fence(gate, /*gate_queries=*/false, /*gate_records=*/true);
  auto counted = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  detail::ReservedGauge gauge;
  {
    SegmentTier tier(*counted, fence, gauge, {.granularity = 512});
    const auto [post, streamed] = held_and_streamed(tier, s);
    ASSERT_NE(post, nullptr);
    ASSERT_NE(streamed, nullptr);
    void* refused = nullptr;
    const bool in_time = runs_while_held(
        gate, [&] { return tier.allocate(32_MiB, t, false); },
        [&] {
          void* block = tier.allocate(512_KiB, kUntagged, false);
          return block != nullptr && tier.free(block, kUntagged);
        },
        &refused);
    EXPECT_TRUE(in_time) << "an allocation from held memory waited for a marker record";
    EXPECT_EQ(refused, nullptr) << "s's segment served t before its marker completed";
    ASSERT_EQ(fence.recorded(), 1U);
    fence.complete_all();
    void* big = tier.allocate(32_MiB, t, false);
    EXPECT_EQ(big, streamed) << "the marker did not cover s's segment";
    if (big != nullptr) EXPECT_TRUE(tier.free(big, t));
    if (refused != nullptr) EXPECT_TRUE(tier.free(refused, t));
    EXPECT_TRUE(tier.free(post, kUntagged));
    tier.trim(0, true);
    EXPECT_EQ(tier.counters().reserved, 0U);
  }
  EXPECT_EQ(counted->live_bytes(), 0U);
  EXPECT_EQ(fence.waits_for_released(), 0U);
}

// A range freed on s while s's marker is being recorded was freed after the record's mark:
// it keeps its stream (s may use it, t may not), the ranges freed before go under the marker.
TEST(SegmentTierGrowthOutsideLock, AFreeDuringTheRecordKeepsItsStream) {
  Gate gate;
  GatedFence fence(gate, /*gate_queries=*/false, /*gate_records=*/true);
  auto counted = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  detail::ReservedGauge gauge;
  {
    SegmentTier tier(*counted, fence, gauge, {.granularity = 512});
    void* post = tier.allocate(1_MiB, kUntagged, true);  // a 20 MiB segment, filled below
    void* late = tier.allocate(8_MiB, kUntagged, true);
    void* filler = tier.allocate(11_MiB, kUntagged, true);
    void* streamed = tier.allocate(32_MiB, s, true);  // a segment of its own
    ASSERT_EQ(static_cast<char*>(late), static_cast<char*>(post) + 1_MiB);
    ASSERT_TRUE(tier.free(streamed, s));
    void* refused = nullptr;
    const bool in_time = runs_while_held(
        gate, [&] { return tier.allocate(32_MiB, t, false); },
        [&] { return tier.free(late, s); },  // during the record
        &refused);
    EXPECT_TRUE(in_time);
    EXPECT_EQ(refused, nullptr);
    fence.complete_all();
    void* got = tier.allocate(8_MiB, t, false);
    EXPECT_EQ(got, streamed) << "t was not served from the range freed before the record";
    EXPECT_NE(got, late) << "a range freed on s after the record's mark served t";
    void* own = tier.allocate(8_MiB, s, false);
    EXPECT_EQ(own, late) << "s lost its own range freed during the record";
    for (void* block : {own, got}) {
      if (block != nullptr) EXPECT_TRUE(tier.free(block, kUntagged));
    }
    EXPECT_TRUE(tier.free(post, kUntagged));
    EXPECT_TRUE(tier.free(filler, kUntagged));
    tier.trim(0, true);
    EXPECT_EQ(tier.counters().reserved, 0U);
  }
  EXPECT_EQ(counted->live_bytes(), 0U);
}

// Before growing, a segment tier fences the streams of wholly free segments: a marker that
// completes at once untags its segment during the record, and that segment serves the
// request (no new segment), although no wait followed.
TEST(SegmentTierGrowthOutsideLock, ASegmentUntaggedByTheRecordBeforeGrowingServes) {
  Gate gate;
  GatedFence fence(gate, /*gate_queries=*/false, /*gate_records=*/true, /*instant=*/true);
  auto counted = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  detail::ReservedGauge gauge;
  {
    SegmentTier tier(*counted, fence, gauge, {.granularity = 512});
    void* post = tier.allocate(1_MiB, kUntagged, true);
    void* u_block = tier.allocate(32_MiB, u, true);  // a segment of its own
    void* s_block = tier.allocate(16_MiB, s, true);  // a 20 MiB segment
    ASSERT_TRUE(tier.free(s_block, s));
    const std::uint64_t segments_before = counted->allocations();
    void* grown = nullptr;
    // t's request fences s (the held record); meanwhile u's segment becomes wholly free,
    // so the wait before growing fences u: its marker completes at once.
    const bool in_time = runs_while_held(
        gate, [&] { return tier.allocate(32_MiB, t, true); }, [&] { return tier.free(u_block, u); },
        &grown);
    EXPECT_TRUE(in_time);
    EXPECT_EQ(grown, u_block) << "u's segment, untagged by its record, did not serve";
    EXPECT_EQ(counted->allocations(), segments_before) << "the tier grew instead";
    if (grown != nullptr) EXPECT_TRUE(tier.free(grown, t));
    EXPECT_TRUE(tier.free(post, kUntagged));
    tier.trim(0, true);
    EXPECT_EQ(tier.counters().reserved, 0U);
  }
  EXPECT_EQ(counted->live_bytes(), 0U);
}

// trim() fences every stream with the tier's mutex released.
TEST(SegmentTierGrowthOutsideLock, TrimRecordsItsMarkersWithTheMutexReleased) {
  Gate gate;
  GatedFence fence(gate, /*gate_queries=*/false, /*gate_records=*/true);
  auto counted = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  detail::ReservedGauge gauge;
  {
    SegmentTier tier(*counted, fence, gauge, {.granularity = 512});
    const auto [post, streamed] = held_and_streamed(tier, s);
    ASSERT_NE(post, nullptr);
    ASSERT_NE(streamed, nullptr);
    bool trimmed = false;
    const bool in_time = runs_while_held(
        gate,
        [&] {
          tier.trim(0, false);
          return true;
        },
        [&] {
          void* block = tier.allocate(512_KiB, kUntagged, false);
          return block != nullptr && tier.free(block, kUntagged);
        },
        &trimmed);
    EXPECT_TRUE(in_time) << "an allocation waited for trim's marker record";
    EXPECT_EQ(fence.recorded(), 1U);
    EXPECT_EQ(tier.counters().reserved, 32_MiB + 20_MiB) << "s's segment went back unfenced";
    fence.complete_all();
    EXPECT_TRUE(tier.free(post, kUntagged));
    tier.trim(0, false);
    EXPECT_EQ(tier.counters().reserved, 0U);
  }
  EXPECT_EQ(counted->live_bytes(), 0U);
}

// A map that finds no physical memory is tried again (after a reclaim) with the tier's
// mutex released too.
TEST(SegmentTierGrowthOutsideLock, TheOutOfMemoryRetryMapsWithTheMutexReleased) {
  Gate gate;
  auto physical = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  GatedVirtualMemory vm(physical, gate);
  ManualFence fence;
  detail::ReservedGauge gauge;
  {
    SegmentTier tier(*physical, fence, gauge,
                     {.granularity = 512, .virtual_memory = &vm, .reservation = 1_GiB});
    // One run of 8 MiB, 2 MiB of it used: its free 6 MiB stay mapped through a reclaim (a
    // live block after it keeps the growth away from them).
    void* run = tier.allocate(8_MiB, kUntagged, true);
    void* after = tier.allocate(2_MiB, kUntagged, true);
    ASSERT_NE(run, nullptr);
    ASSERT_NE(after, nullptr);
    ASSERT_TRUE(tier.free(run, kUntagged));
    void* post = tier.allocate(2_MiB, kUntagged, false);
    ASSERT_EQ(post, run);
    const std::uint64_t failed_before = tier.counters().failed_upstream_allocations;
    vm.fail_next_maps(1);
    void* grown = nullptr;
    const bool in_time = runs_while_held(
        gate, [&] { return tier.allocate(32_MiB, kUntagged, true); },
        [&] {
          void* block = tier.allocate(1_MiB, kUntagged, false);
          if (block != nullptr) std::memset(block, 0x5a, 1_MiB);
          return block != nullptr && tier.free(block, kUntagged);
        },
        &grown);
    EXPECT_TRUE(in_time) << "an allocation from held memory waited for the retried map";
    ASSERT_NE(grown, nullptr) << "the retry did not map the block";
    std::memset(grown, 1, 32_MiB);
    EXPECT_EQ(tier.counters().failed_upstream_allocations, failed_before + 1);
    EXPECT_TRUE(tier.free(grown, kUntagged));
    EXPECT_TRUE(tier.free(post, kUntagged));
    EXPECT_TRUE(tier.free(after, kUntagged));
    tier.trim(0, true);
    EXPECT_EQ(tier.counters().reserved, 0U);
  }
  EXPECT_EQ(physical->live_bytes(), 0U);
  EXPECT_EQ(physical->bad_frees(), 0U);
}

// A virtual tier takes its address range (once) with the mutex released: calls that need
// no growth go on meanwhile.
TEST(SegmentTierGrowthOutsideLock, TheAddressReservationIsTakenWithTheMutexReleased) {
  Gate gate;
  auto physical = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  GatedVirtualMemory vm(physical, gate, /*gate_reserve=*/true);
  ManualFence fence;
  detail::ReservedGauge gauge;
  int foreign = 0;
  {
    SegmentTier tier(*physical, fence, gauge,
                     {.granularity = 512, .virtual_memory = &vm, .reservation = 1_GiB});
    void* first = nullptr;
    const bool in_time = runs_while_held(
        gate, [&] { return tier.allocate(4_MiB, kUntagged, true); },
        [&] {
          return tier.allocate(4_MiB, kUntagged, false) == nullptr && !tier.owns(&foreign) &&
                 !tier.free(&foreign, kUntagged) && tier.counters().reserved == 0;
        },
        &first);
    EXPECT_TRUE(in_time) << "a call waited for the address reservation";
    ASSERT_NE(first, nullptr);
    std::memset(first, 1, 4_MiB);
    EXPECT_TRUE(tier.free(first, kUntagged));
    tier.trim(0, true);
    EXPECT_EQ(tier.counters().reserved, 0U);
  }
  EXPECT_EQ(physical->live_bytes(), 0U);
}

}  // namespace
}  // namespace vram::testing
