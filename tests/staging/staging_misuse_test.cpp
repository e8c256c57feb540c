// Misuse and bad input against PinnedStagingPool, its CopyCompleted witness, the pinned
// host upstream, and WeightPager (plan, schedule, pageable staging): each test states the
// documented behaviour for one misuse. Crashes and undefined behaviour are run in a
// death-test child (EXPECT_EXIT) that exits 0 only when the documented error is thrown, so
// a crash stays in the child and the failure names what happened.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <sys/mman.h>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "gpu_test_policy.hpp"
#include "staging/pageable_stager.hpp"
#include "staging/parallel_copy.hpp"
#include "test_upstreams.hpp"
#include "vram/copy.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/pager_plan.hpp"
#include "vram/pinned_host_upstream.hpp"
#include "vram/pinned_staging_pool.hpp"
#include "vram/testing/witness.hpp"
#include "vram/units.hpp"
#include "vram/upstream.hpp"
#include "vram/weight_pager.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

std::shared_ptr<TestUpstream> counted_host() {
  return std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
}

// Run in a death-test child: exits 0 when `body` threw E, 3 when it threw something else,
// 4 when it returned. A crash (signal) also fails the EXPECT_EXIT around it, and so does a
// hang: the child is killed by SIGALRM after 10 s ("killed by signal 14").
template <class E, class Body>
[[noreturn]] void exit_zero_if_throws(Body&& body) {
  alarm(10);
  try {
    body();
  } catch (const std::exception& error) {
    const bool expected = dynamic_cast<const E*>(&error) != nullptr;
    std::fprintf(stderr, "threw %s: %s\n", expected ? "as expected" : "another type", error.what());
    std::_Exit(expected ? 0 : 3);
  }
  std::fprintf(stderr, "returned without an exception\n");
  std::_Exit(4);
}

#define MISUSE_EXPECT_THROWS_IN_CHILD(E, body_lambda) \
  EXPECT_EXIT(exit_zero_if_throws<E>(body_lambda), ::testing::ExitedWithCode(0), "")

// ==== PinnedStagingPool ==================================================================

// A moved-from PinnedStagingPool (its only member a shared_ptr, moved): the calls that
// need the pool throw InvalidArgument, release() leaving the buffer with the caller, and
// the rest do nothing; none dereferences the empty state.
TEST(PinnedStagingPoolMisuse, MovedFromPoolRefusesAndLosesNothing) {
  auto upstream = counted_host();
  PinnedStagingPool pool(upstream);
  auto staging = pool.acquire(4096);
  std::memset(staging.data(), 0x5A, 4096);
  PinnedStagingPool other = std::move(pool);
  // NOLINTBEGIN(bugprone-use-after-move): the point of the test
  EXPECT_THROW((void)pool.acquire(4096), InvalidArgument);
  EXPECT_THROW((void)pool.stats(), InvalidArgument);
  EXPECT_THROW(pool.reserve(1, 4096), InvalidArgument);
  pool.clear();
  pool.reset_counters();
  EXPECT_FALSE(pool.can_retain_concurrent(4096, 1));
  EXPECT_EQ(pool.options().max_buffers, PinnedStagingPool::Options{}.max_buffers);
  CopyCompleted witness = WitnessMint::completed_copy_of(staging);
  PinnedBuffer raw = staging.into_inner();
  try {
    pool.release(std::move(raw), std::move(witness));
    ADD_FAILURE() << "a moved-from pool took a buffer back";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("moved from"), std::string::npos) << error.what();
  }
  // NOLINTEND(bugprone-use-after-move)
  ASSERT_TRUE(raw) << "the refused buffer must stay with the caller";
  EXPECT_EQ(static_cast<unsigned char>(raw.data()[4095]), 0x5A);
  // The pool it was moved to takes it back with a witness minted for it.
  CopyCompleted fresh = WitnessMint::completed_copy_of(raw);
  other.release(std::move(raw), std::move(fresh));
  EXPECT_EQ(other.stats().free_buffers, 1U);
  EXPECT_EQ(other.stats().retired, 1U);
}

// Destroying a PooledStaging or its PinnedBuffer without a witness frees the buffer and
// counts it in freed_without_witness, a buffer taken out with into_inner() too: the raw
// buffer still belongs to its pool's lease.
TEST(PinnedStagingPoolMisuse, RawBufferDroppedWithoutWitnessIsCounted) {
  auto upstream = counted_host();
  PinnedStagingPool pool(upstream);
  {
    auto staging = pool.acquire(4096);
    PinnedBuffer raw = staging.into_inner();
    EXPECT_NE(raw.lease_id(), 0U);
  }                                       // the raw buffer goes without a witness
  EXPECT_EQ(upstream->live_bytes(), 0U);  // freed, not reused
  EXPECT_EQ(pool.stats().free_buffers, 0U);
  EXPECT_EQ(pool.stats().freed_without_witness, 1U)
      << "a leased buffer dropped without a witness after into_inner() is not counted";
}

// An upstream of device memory as the staging pool's upstream: PooledStaging::data() would
// be a device pointer that the documented use (std::memcpy into it) dereferences on the
// host. The stand-in hands out host memory so the test itself cannot crash.
class DeviceKindUpstream final : public Upstream {
 public:
  void* allocate(std::size_t bytes) override { return inner_.allocate(bytes); }
  void deallocate(void* block, std::size_t bytes) noexcept override {
    inner_.deallocate(block, bytes);
  }
  MemoryKind kind() const noexcept override { return MemoryKind::device; }
  std::string_view name() const noexcept override { return "device (stand-in)"; }

 private:
  HostMemoryUpstream inner_;
};

// PinnedStagingPool(upstream) refuses an upstream of device memory (kind() device): the
// host fills staging buffers, so such memory would crash the first memcpy.
TEST(PinnedStagingPoolMisuse, DeviceMemoryUpstreamIsRefusedAtConstruction) {
  EXPECT_THROW(PinnedStagingPool(std::make_shared<DeviceKindUpstream>()), InvalidArgument)
      << "a staging pool over device memory was accepted";
}

// Copies of a PinnedStagingPool are handles of ONE pool (shared state): a lease of one is
// accepted by the other's release(), and clear() on either empties both.
TEST(PinnedStagingPoolMisuse, CopiedPoolIsAnAliasOfTheSamePool) {
  auto upstream = counted_host();
  PinnedStagingPool pool(upstream);
  PinnedStagingPool alias = pool;  // compiles
  auto staging = pool.acquire(4096);
  CopyCompleted witness = WitnessMint::completed_copy_of(staging);
  alias.release(staging.into_inner(), std::move(witness));  // not "foreign"
  EXPECT_EQ(pool.stats().free_buffers, 1U);
  EXPECT_EQ(pool.stats().foreign_buffers, 0U);
  alias.clear();
  EXPECT_EQ(pool.stats().free_buffers, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// A lease moved between PooledStaging objects keeps its identity; the witness retires it
// from the new owner only; the moved-from owner is empty and refuses.
TEST(PinnedStagingPoolMisuse, WitnessFollowsAMovedLeaseAndTheSourceRefuses) {
  auto upstream = counted_host();
  PinnedStagingPool pool(upstream);
  auto first = pool.acquire(4096);
  const auto lease = first.lease_id();
  PooledStaging second = std::move(first);
  EXPECT_EQ(second.lease_id(), lease);
  EXPECT_FALSE(first);  // NOLINT(bugprone-use-after-move)
  EXPECT_THROW(first.retire(WitnessMint::completed_copy_of_lease(lease)), InvalidArgument);
  second = std::move(second);  // self-move keeps the lease
  EXPECT_EQ(second.lease_id(), lease);
  CopyCompleted witness = WitnessMint::completed_copy_of(second);
  witness = std::move(witness);  // self-move keeps the witness
  EXPECT_EQ(witness.lease(), lease);
  second.retire(std::move(witness));
  EXPECT_EQ(pool.stats().retired, 1U);
  EXPECT_EQ(pool.stats().freed_without_witness, 0U);
}

// A witness of another pool's lease is refused by both retire() and release(); both
// leases stay intact and retire later with their own witnesses.
TEST(PinnedStagingPoolMisuse, WitnessOfAnotherPoolsLeaseIsRefusedByRetireAndRelease) {
  auto upstream = counted_host();
  PinnedStagingPool a(upstream);
  PinnedStagingPool b(upstream);
  auto from_a = a.acquire(4096);
  auto from_b = b.acquire(4096);
  std::memset(from_a.data(), 0x11, from_a.len());
  EXPECT_THROW(from_a.retire(WitnessMint::completed_copy_of(from_b)), InvalidArgument);
  PinnedBuffer raw = from_a.into_inner();
  try {
    a.release(std::move(raw), WitnessMint::completed_copy_of(from_b));
    FAIL() << "a witness of another pool's lease was accepted";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("Fix:"), std::string::npos) << error.what();
  }
  ASSERT_TRUE(raw);  // NOLINT(bugprone-use-after-move): refused, so left with the caller
  EXPECT_EQ(static_cast<unsigned char>(raw.data()[0]), 0x11);
  EXPECT_EQ(a.stats().witness_mismatches, 2U);
  CopyCompleted own = WitnessMint::completed_copy_of(raw);
  a.release(std::move(raw), std::move(own));
  from_b.retire(WitnessMint::completed_copy_of(from_b));
  EXPECT_EQ(a.stats().retired + b.stats().retired, 2U);
}

// A witness refused because a copy is still in flight is consumed (it was passed by
// value), but the lease survives; once the copy is observed, the witness of that copy
// retires it. A witness minted before the copy was issued does not count.
TEST(PinnedStagingPoolMisuse, WitnessMintedBeforeALaterCopyIsRefusedUntilThatCopyIsObserved) {
  struct Fence {
    std::shared_ptr<bool> fired = std::make_shared<bool>(false);
    bool ready() const { return *fired; }
    void wait() { *fired = true; }
  };
  auto upstream = counted_host();
  PinnedStagingPool pool(upstream);
  auto staging = pool.acquire(4096);
  CopyCompleted early = WitnessMint::completed_copy_of(staging);  // before any copy
  PendingCopy copy = WitnessMint::host_copy(staging, Fence{});
  EXPECT_EQ(staging.copies_in_flight(), 1U);
  EXPECT_THROW(staging.retire(std::move(early)), InvalidArgument);
  EXPECT_TRUE(staging);
  CopyCompleted done = std::move(copy).wait();
  EXPECT_EQ(done.sequence(), 1U);
  staging.retire(std::move(done));
  EXPECT_EQ(pool.stats().retired, 1U);
}

// Zero and absurd sizes of every sizing call, and bounds of zero.
TEST(PinnedStagingPoolMisuse, ZeroAndAbsurdSizesEverywhere) {
  auto upstream = counted_host();
  PinnedStagingPool pool(upstream, {.max_buffers = 0, .max_bytes = 0});
  EXPECT_THROW((void)pool.acquire(0), InvalidArgument);
  EXPECT_THROW(pool.reserve(1, 0), InvalidArgument);
  pool.reserve(0, 4096);         // nothing
  pool.reserve(SIZE_MAX, 4096);  // nothing fits the zero bounds: no pin at all
  EXPECT_EQ(pool.stats().pin_calls, 0U);
  EXPECT_THROW((void)pool.acquire(SIZE_MAX), std::bad_alloc);
  EXPECT_THROW(PinnedBuffer(upstream, 0), InvalidArgument);
  EXPECT_THROW(PinnedBuffer(nullptr, 1), InvalidArgument);
  EXPECT_THROW(PinnedStagingPool(nullptr), InvalidArgument);
  auto staging = pool.acquire(4096);
  staging.retire(WitnessMint::completed_copy_of(staging));  // over bounds: freed
  EXPECT_EQ(pool.stats().freed_over_bounds, 1U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

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

// ==== Thread creation failing (memory pressure) ============================================

// Caps the address space of this (death-test child) process at what it maps now plus
// `headroom`, so the next thread stacks (8 MiB each by default) cannot be mapped.
void cap_address_space(std::size_t headroom) {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0;
  statm >> pages;
  const auto limit =
      static_cast<rlim_t>(pages * static_cast<std::size_t>(sysconf(_SC_PAGESIZE)) + headroom);
  const rlimit cap{limit, limit};
  if (setrlimit(RLIMIT_AS, &cap) != 0) std::_Exit(5);
}

// ParallelCopy (the pager's fill threads) and touch_pages_in_parallel (every pinned
// staging buffer of 64 KiB and more) run the work on the threads that started (at least
// the caller's) when the system cannot start one (under memory pressure: exactly when
// HostWeights::automatic falls back to staging); neither hangs nor terminates. The
// children cap their address space, which a sanitizer's shadow memory cannot live with:
// these tests are the plain build's.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MISUSE_SKIP_UNDER_SANITIZERS() \
  GTEST_SKIP() << "caps the address space, which the sanitizer's shadow memory cannot live with"
#else
#define MISUSE_SKIP_UNDER_SANITIZERS() (void)0
#endif

// Runs in a death-test child: exits 0 when `body` returns true, 3 when it throws, 4 when it
// returns false; killed by SIGALRM after 10 s if it hangs.
template <class Body>
[[noreturn]] void exit_zero_if_done(Body&& body) {
  alarm(10);
  try {
    std::_Exit(body() ? 0 : 4);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "threw: %s\n", error.what());
    std::_Exit(3);
  }
}

TEST(StagingThreadsMisuseDeathTest, FillThreadsThatCannotStartLeaveTheCopyToThoseThatDid) {
  MISUSE_SKIP_UNDER_SANITIZERS();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_zero_if_done([] {
                std::vector<std::byte> from(64_MiB, std::byte{0x3C});
                std::vector<std::byte> to(64_MiB);
                cap_address_space(20_MiB);  // room for about two thread stacks
                detail::ParallelCopy copy(64);
                copy.run(to.data(), from.data(), to.size());
                return to.front() == std::byte{0x3C} && to.back() == std::byte{0x3C} &&
                       to[to.size() / 2 + 12345] == std::byte{0x3C};
              }),
              ::testing::ExitedWithCode(0), "");
}

// The same through the pager's stager (the object WeightPager's pageable path builds).
class NullTarget final : public detail::StagedCopyTarget {
 public:
  void bind_thread() override {}
  void begin(const detail::StagerJob&) override {}
  PendingCopy copy(std::byte*, PooledStaging& staging) override {
    struct Done {
      bool ready() const { return true; }
      void wait() {}
    };
    return WitnessMint::host_copy(staging, Done{});
  }
  void end(const detail::StagerJob&) override {}
};

// The stager's own thread (the one that issues the copies) must start: when the fill
// threads took the last room, the constructor throws std::system_error, with every thread
// it started joined.
TEST(StagingThreadsMisuseDeathTest, StagerWhoseThreadsCannotAllStartThrowsAndJoins) {
  MISUSE_SKIP_UNDER_SANITIZERS();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_zero_if_done([] {
                NullTarget target;
                auto upstream = std::make_shared<HostMemoryUpstream>();
                cap_address_space(20_MiB);
                try {
                  detail::PageableStager stager(target, {.slot_count = 2,
                                                         .chunk_bytes = 4096,
                                                         .staging_buffers = 2,
                                                         .fill_threads = 64,
                                                         .staging_upstream = upstream});
                  stager.drain();
                  return stager.pool_stats().free_buffers == 2;  // enough room after all
                } catch (const std::system_error& error) {
                  std::fprintf(stderr, "threw as expected: %s\n", error.what());
                  return true;
                }
              }),
              ::testing::ExitedWithCode(0), "");
}

TEST(StagingThreadsMisuseDeathTest, TouchThreadsThatCannotStartLeaveThePagesToTheCaller) {
  MISUSE_SKIP_UNDER_SANITIZERS();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_zero_if_done([] {
                const std::size_t bytes = 512_MiB;  // 16 parts of 32 MiB: 15 threads wanted
                void* block = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
                if (block == MAP_FAILED) std::_Exit(6);
                std::memset(block, 0x7F, bytes);  // touched pages must be written 0
                cap_address_space(20_MiB);
                touch_pages_in_parallel(block, bytes, 16);
                const auto* bytes_at = static_cast<const unsigned char*>(block);
                for (std::size_t offset = 0; offset < bytes; offset += 4096) {
                  if (bytes_at[offset] != 0) return false;  // a page nobody touched
                }
                return true;
              }),
              ::testing::ExitedWithCode(0), "");
}

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

// ==== On a GPU (skip without one) =========================================================

// GPU-only. A WeightLayer whose host pointer is device memory (a cudaMalloc pointer) is
// an InvalidArgument naming the layer in pinned mode, not a PinningError advising to
// raise RLIMIT_MEMLOCK.
TEST(StagingMisuseGpu, DevicePointerAsHostWeightIsInvalidArgumentInPinnedMode) {
  VRAM_GPU_TEST_OR_SKIP();
  void* device_weights = nullptr;
  ASSERT_EQ(cudaMalloc(&device_weights, 4 * 64_KiB), cudaSuccess);
  std::vector<WeightLayer> layers;
  for (int i = 0; i < 4; ++i) {
    layers.push_back(
        {"d" + std::to_string(i),
         static_cast<std::byte*>(device_weights) + static_cast<std::size_t>(i) * 64_KiB, 64_KiB});
  }
  try {
    WeightPager pager(layers, {.plan = {.budget_bytes = 2 * 64_KiB},
                               .host = HostWeights::pinned,
                               .print_plan_warnings = false});
    ADD_FAILURE() << "device memory accepted as host weights";
  } catch (const InvalidArgument&) {
  } catch (const std::exception& error) {
    ADD_FAILURE() << "wrong error type: " << error.what();
  }
  (void)cudaFree(device_weights);
}

// GPU-only. The automatic and pageable modes refuse device memory as "host" weights at
// construction too, naming the layer: their fill threads would memcpy from a device
// address on the host.
TEST(StagingMisuseGpu, DevicePointerAsHostWeightIsRefusedInEveryMode) {
  VRAM_GPU_TEST_OR_SKIP();
  void* device_weights = nullptr;
  ASSERT_EQ(cudaMalloc(&device_weights, 4 * 64_KiB), cudaSuccess);
  std::vector<std::vector<std::byte>> host(3, std::vector<std::byte>(64_KiB, std::byte{1}));
  std::vector<WeightLayer> layers;
  for (std::size_t i = 0; i < 3; ++i)
    layers.push_back({"h" + std::to_string(i), host[i].data(), 64_KiB});
  layers.push_back({"on-device", device_weights, 64_KiB});  // the last one only
  for (const auto mode : {HostWeights::automatic, HostWeights::pageable, HostWeights::pinned}) {
    try {
      WeightPager pager(
          layers,
          {.plan = {.budget_bytes = 2 * 64_KiB}, .host = mode, .print_plan_warnings = false});
      ADD_FAILURE() << "device memory accepted as host weights";
    } catch (const InvalidArgument& error) {
      EXPECT_NE(std::string(error.what()).find("'on-device'"), std::string::npos) << error.what();
    }
  }
  EXPECT_EQ(cudaFree(device_weights), cudaSuccess);
}

// GPU-only: the absurd staging_buffers through the public option (see the CPU case).
TEST(StagingMisuseGpu, AbsurdStagingBufferCountIsInvalidArgumentFromThePager) {
  VRAM_GPU_TEST_OR_SKIP();
  std::vector<std::vector<std::byte>> data(4, std::vector<std::byte>(64_KiB, std::byte{1}));
  std::vector<WeightLayer> layers;
  for (std::size_t i = 0; i < 4; ++i)
    layers.push_back({"p" + std::to_string(i), data[i].data(), 64_KiB});
  try {
    WeightPager pager(layers, {.plan = {.budget_bytes = 2 * 64_KiB},
                               .host = HostWeights::pageable,
                               .staging_buffers = SIZE_MAX,
                               .print_plan_warnings = false});
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument&) {
  } catch (const std::exception& error) {
    ADD_FAILURE() << "wrong error type: " << error.what();
  }
}

// GPU-only: a bad device ordinal is a CudaError naming the call with a Fix, and nothing
// is pinned or leaked.
TEST(StagingMisuseGpu, BadDeviceOrdinalIsACudaErrorWithAFix) {
  VRAM_GPU_TEST_OR_SKIP();
  std::vector<std::byte> data(64_KiB, std::byte{1});
  try {
    WeightPager pager(
        {{"x", data.data(), data.size()}},
        {.plan = {.budget_bytes = 1_MiB}, .device = 4096, .print_plan_warnings = false});
    ADD_FAILURE() << "device 4096 accepted";
  } catch (const CudaError& error) {
    EXPECT_NE(std::string(error.what()).find("Fix:"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace vram::testing
