// Misuse and bad input against PinnedStagingPool, its leases and its CopyCompleted witness:
// each test states the documented behaviour for one misuse.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <utility>

#include "test_upstreams.hpp"
#include "vram/copy.hpp"
#include "vram/cuda/error.hpp"
#include "vram/pinned_staging_pool.hpp"
#include "vram/testing/witness.hpp"
#include "vram/upstream.hpp"

namespace vram::testing {
namespace {

std::shared_ptr<TestUpstream> counted_host() {
  return std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
}

// A moved-from PinnedStagingPool (its only member a shared_ptr, moved): the calls that
// need the pool throw InvalidArgument, retire(buffer, witness) leaving the buffer with the caller,
// and the rest do nothing; none dereferences the empty state.
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
    pool.retire(std::move(raw), std::move(witness));
    ADD_FAILURE() << "a moved-from pool took a buffer back";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("moved from"), std::string::npos) << error.what();
  }
  // NOLINTEND(bugprone-use-after-move)
  ASSERT_TRUE(raw) << "the refused buffer must stay with the caller";
  EXPECT_EQ(static_cast<unsigned char>(raw.data()[4095]), 0x5A);
  // The pool it was moved to takes it back with a witness minted for it.
  CopyCompleted fresh = WitnessMint::completed_copy_of(raw);
  other.retire(std::move(raw), std::move(fresh));
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
// accepted by the other's retire(buffer, witness), and clear() on either empties both.
TEST(PinnedStagingPoolMisuse, CopiedPoolIsAnAliasOfTheSamePool) {
  auto upstream = counted_host();
  PinnedStagingPool pool(upstream);
  PinnedStagingPool alias = pool;  // compiles
  auto staging = pool.acquire(4096);
  CopyCompleted witness = WitnessMint::completed_copy_of(staging);
  alias.retire(staging.into_inner(), std::move(witness));  // not "foreign"
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

// A witness of another pool's lease is refused by both retires (of the lease, of its raw
// buffer); both
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
    a.retire(std::move(raw), WitnessMint::completed_copy_of(from_b));
    FAIL() << "a witness of another pool's lease was accepted";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("Fix:"), std::string::npos) << error.what();
  }
  ASSERT_TRUE(raw);  // NOLINT(bugprone-use-after-move): refused, so left with the caller
  EXPECT_EQ(static_cast<unsigned char>(raw.data()[0]), 0x11);
  EXPECT_EQ(a.stats().witness_mismatches, 2U);
  CopyCompleted own = WitnessMint::completed_copy_of(raw);
  a.retire(std::move(raw), std::move(own));
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

}  // namespace
}  // namespace vram::testing
