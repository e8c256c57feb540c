// The copy layer's witness: single-use, bound to one lease and to every copy issued from
// it. Each misuse of the witness has a case here (CPU, host-fenced copies over host
// memory) and, for the copy cases, a GPU case holding a real copy in flight behind a long
// kernel. Compile-time misuses are in tests/compile_fail/.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <type_traits>
#include <vector>

#include "gpu_test_policy.hpp"
#include "test_fences.hpp"
#include "test_upstreams.hpp"
#include "vram/completion.hpp"
#include "vram/copy.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/event.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/pinned_host_upstream.hpp"
#include "vram/pinned_staging_pool.hpp"
#include "vram/testing/witness.hpp"
#include "vram/units.hpp"
#ifdef VRAM_HAVE_TEST_KERNELS
#include "test_kernels.hpp"
#endif

namespace vram::testing {
namespace {

using namespace vram::literals;

static_assert(!std::is_trivially_copyable_v<CopyCompleted>,
              "a trivially copyable witness could be duplicated with std::bit_cast/memcpy");
static_assert(!std::is_copy_constructible_v<CopyCompleted>);
static_assert(!std::is_copy_assignable_v<CopyCompleted>);
static_assert(std::is_nothrow_move_constructible_v<CopyCompleted>);
static_assert(!std::is_copy_constructible_v<PendingCopy>);
static_assert(!std::is_default_constructible_v<detail::MintKey>);
static_assert(!std::is_trivially_copyable_v<detail::MintKey>,
              "std::bit_cast could forge a trivially copyable passkey");
static_assert(Completion<cuda::Event>);

// A host fence fired by hand; counts waits. wait() spins until fired.
struct ManualFence {
  std::shared_ptr<std::atomic<bool>> fired = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<std::atomic<int>> waits = std::make_shared<std::atomic<int>>(0);
  bool ready() const { return fired->load(); }
  void wait() {
    waits->fetch_add(1);
    while (!fired->load()) std::this_thread::yield();
  }
  void fire() const { fired->store(true); }
};

static_assert(Completion<ManualFence> && Completion<FiresWhenWaited>);

// Hands out the same block every time (one live at a time): "a new pin at a reused address".
class SameAddressUpstream final : public Upstream {
 public:
  void* allocate(std::size_t bytes) override {
    if (bytes > sizeof(block_) || live_) throw OutOfMemory(bytes, 0, 0, "SameAddressUpstream");
    live_ = true;
    return block_;
  }
  void deallocate(void*, std::size_t) noexcept override { live_ = false; }
  MemoryKind kind() const noexcept override { return MemoryKind::host; }
  std::string_view name() const noexcept override { return "same-address"; }
  std::size_t alignment() const noexcept override { return 64; }

 private:
  alignas(64) std::byte block_[64 * 1024];
  bool live_ = false;
};

std::shared_ptr<TestUpstream> host_upstream() {
  return std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
}

TEST(CopyWitness, MovedFromWitnessProvesNothing) {
  PinnedStagingPool pool(host_upstream());
  auto staging = pool.acquire(4096);
  CopyCompleted witness = WitnessMint::completed_copy_of(staging);
  ASSERT_TRUE(witness);
  CopyCompleted moved = std::move(witness);
  EXPECT_FALSE(witness);  // NOLINT(bugprone-use-after-move): the point of the test
  EXPECT_EQ(witness.lease(), 0U);
  EXPECT_EQ(moved.lease(), staging.lease_id());
  EXPECT_THROW(staging.retire(std::move(witness)), InvalidArgument);
  EXPECT_TRUE(staging) << "a refused retire must leave the lease intact";
  EXPECT_EQ(pool.stats().free_buffers, 0U);
  EXPECT_EQ(pool.stats().witness_mismatches, 1U);
  staging.retire(std::move(moved));
  EXPECT_EQ(pool.stats().free_buffers, 1U);
  EXPECT_FALSE(staging);
  EXPECT_THROW(staging.retire(WitnessMint::completed_copy_of_lease(1)), InvalidArgument)
      << "a returned lease cannot be retired twice";
}

// A buffer retired with one completed copy's witness, reacquired, a new copy queued from
// it, and the moved-from witness presented again: refused while the copy is in flight.
TEST(CopyWitness, MovedFromWitnessCannotRetireTheReacquiredBufferWithACopyInFlight) {
  PinnedStagingPool pool(host_upstream());
  auto first = pool.acquire(4096);
  const std::byte* address = first.data();
  ManualFence done;
  done.fire();
  CopyCompleted witness = WitnessMint::host_copy(first, done).wait_timed().completed;
  CopyCompleted kept = std::move(witness);
  first.retire(std::move(kept));
  auto again = pool.acquire(4096);
  ASSERT_EQ(again.data(), address) << "precondition: the same buffer is reused";
  ManualFence in_flight;
  PendingCopy copy = WitnessMint::host_copy(again, in_flight);
  EXPECT_THROW(again.retire(std::move(witness)), InvalidArgument);
  auto meanwhile = pool.acquire(4096);
  EXPECT_NE(meanwhile.data(), address) << "a buffer with a copy in flight was handed out";
  in_flight.fire();
  again.retire(std::move(copy).wait());
  EXPECT_EQ(pool.stats().free_buffers, 1U);
}

TEST(CopyWitness, WaitConsumesThePendingCopy) {
  PinnedStagingPool pool(host_upstream());
  auto staging = pool.acquire(4096);
  ManualFence fence;
  fence.fire();
  PendingCopy copy = WitnessMint::host_copy(staging, fence);
  EXPECT_TRUE(copy.pending());
  CopyCompleted first = std::move(copy).wait();
  EXPECT_TRUE(first);
  EXPECT_EQ(first.lease(), staging.lease_id());
  EXPECT_EQ(first.sequence(), 1U);
  EXPECT_FALSE(copy.pending());  // NOLINT(bugprone-use-after-move)
  EXPECT_TRUE(copy.ready());
  EXPECT_THROW((void)std::move(copy).wait(), InvalidArgument) << "two witnesses from one copy";
  EXPECT_THROW((void)std::move(copy).wait_timed(), InvalidArgument);
  PendingCopy source = WitnessMint::host_copy(staging, fence);
  PendingCopy target = std::move(source);
  EXPECT_THROW((void)std::move(source).wait(), InvalidArgument) << "wait on a moved-from copy";
  staging.retire(std::move(target).wait());
  EXPECT_EQ(fence.waits->load(), 2);
}

TEST(CopyWitness, WitnessOfOneCopyDoesNotRetireWhileAnotherCopyFromTheBufferIsInFlight) {
  PinnedStagingPool pool(host_upstream());
  auto staging = pool.acquire(8192);
  const std::byte* address = staging.data();
  ManualFence first_fence;
  ManualFence second_fence;
  PendingCopy first = WitnessMint::host_copy(staging, first_fence);
  PendingCopy second = WitnessMint::host_copy(staging, second_fence);
  EXPECT_EQ(staging.copies_in_flight(), 2U);
  first_fence.fire();
  CopyCompleted partial = std::move(first).wait();
  EXPECT_EQ(partial.sequence(), 1U);
  EXPECT_EQ(staging.copies_in_flight(), 1U);
  EXPECT_THROW(staging.retire(std::move(partial)), InvalidArgument);
  // Even the test minter's witness cannot override the lease's own count.
  EXPECT_THROW(staging.retire(WitnessMint::completed_copy_of(staging)), InvalidArgument);
  EXPECT_TRUE(staging);
  EXPECT_EQ(pool.stats().witness_mismatches, 2U);
  auto other = pool.acquire(8192);
  EXPECT_NE(other.data(), address) << "the buffer went back while a copy still read it";
  second_fence.fire();
  CopyCompleted all = std::move(second).wait();
  EXPECT_EQ(all.sequence(), 2U);
  staging.retire(std::move(all));
  EXPECT_EQ(pool.stats().free_buffers, 1U);
}

TEST(CopyWitness, StaleWitnessOfAnEarlierPinAtTheSameAddressIsRefused) {
  auto upstream = std::make_shared<SameAddressUpstream>();
  PinnedStagingPool pool(upstream, {.max_buffers = 0, .max_bytes = 0});  // retains nothing
  std::optional<PooledStaging> first(pool.acquire(4096));
  const std::byte* address = first->data();
  CopyCompleted stale = WitnessMint::completed_copy_of(*first);
  first.reset();                     // dropped without a witness: unpinned
  auto second = pool.acquire(4096);  // a new pin
  ASSERT_EQ(second.data(), address) << "precondition: the new pin reuses the address";
  EXPECT_EQ(pool.stats().pin_calls, 2U);
  EXPECT_NE(second.lease_id(), stale.lease());
  EXPECT_THROW(second.retire(std::move(stale)), InvalidArgument);
  EXPECT_TRUE(second);
}

TEST(CopyWitness, WitnessOfAnEarlierLoanOfTheSameBufferIsRefused) {
  PinnedStagingPool pool(host_upstream());
  auto first = pool.acquire(4096);
  const std::byte* address = first.data();
  ManualFence fence;
  fence.fire();
  PendingCopy a = WitnessMint::host_copy(first, fence);
  PendingCopy b = WitnessMint::host_copy(first, fence);
  CopyCompleted witness_a = std::move(a).wait();
  CopyCompleted witness_b = std::move(b).wait();  // genuine, of the first loan
  first.retire(std::move(witness_a));
  auto again = pool.acquire(4096);
  ASSERT_EQ(again.data(), address);
  EXPECT_THROW(again.retire(std::move(witness_b)), InvalidArgument);
  EXPECT_TRUE(again);
  EXPECT_EQ(pool.stats().free_buffers, 0U);
}

TEST(CopyWitness, ForeignBuffersAreRefusedAndLeftIntact) {
  auto upstream = host_upstream();
  PinnedStagingPool pool(upstream);
  PinnedStagingPool other_pool(host_upstream());
  // Made by hand over a pageable upstream: no pool's lease.
  PinnedBuffer by_hand(std::make_shared<HostMemoryUpstream>(), 4096);
  EXPECT_EQ(by_hand.lease_id(), 0U);
  EXPECT_THROW(pool.retire(std::move(by_hand), WitnessMint::completed_copy_of(by_hand)),
               InvalidArgument);
  ASSERT_TRUE(by_hand) << "a refused release must leave the buffer with the caller";
  std::memset(by_hand.data(), 0x3C, by_hand.capacity());  // still ours, still valid
  // Another pool's lease, with a witness of that very lease.
  PinnedBuffer theirs = other_pool.acquire(4096).into_inner();
  EXPECT_THROW(pool.retire(std::move(theirs), WitnessMint::completed_copy_of(theirs)),
               InvalidArgument);
  ASSERT_TRUE(theirs);
  EXPECT_EQ(pool.stats().foreign_buffers, 2U);
  EXPECT_EQ(pool.stats().free_buffers, 0U);
  EXPECT_EQ(upstream->allocations(), 0U);
  other_pool.retire(std::move(theirs), WitnessMint::completed_copy_of(theirs));
  EXPECT_EQ(other_pool.stats().free_buffers, 1U);
  // A witness of another buffer of this pool proves nothing about this one.
  auto mine = pool.acquire(4096);
  auto also_mine = pool.acquire(4096);
  EXPECT_THROW(mine.retire(WitnessMint::completed_copy_of(also_mine)), InvalidArgument);
  EXPECT_TRUE(mine);
}

TEST(CopyWitness, IntoInnerKeepsTheLeaseAndItsCopies) {
  PinnedStagingPool pool(host_upstream());
  auto staging = pool.acquire(4096);
  const auto lease = staging.lease_id();
  ManualFence fence;
  PendingCopy copy = WitnessMint::host_copy(staging, fence);
  PinnedBuffer raw = staging.into_inner();
  EXPECT_EQ(raw.lease_id(), lease);
  EXPECT_EQ(raw.copies_in_flight(), 1U);
  EXPECT_THROW(pool.retire(std::move(raw), WitnessMint::completed_copy_of(raw)), InvalidArgument);
  ASSERT_TRUE(raw);
  fence.fire();
  pool.retire(std::move(raw), std::move(copy).wait());
  EXPECT_FALSE(raw);
  EXPECT_EQ(pool.stats().free_buffers, 1U);
}

TEST(CopyWitness, DroppedLeaseIsFreedOnlyAfterItsCopiesAreObserved) {
  auto upstream = host_upstream();
  PinnedStagingPool pool(upstream);
  ManualFence fence;
  std::optional<PendingCopy> copy;
  {
    auto staging = pool.acquire(1_MiB);
    copy.emplace(WitnessMint::host_copy(staging, fence));
  }  // dropped without a witness while its copy is in flight
  EXPECT_EQ(pool.stats().freed_without_witness, 1U);
  EXPECT_EQ(upstream->live_bytes(), 1_MiB) << "freed while a copy may still read it";
  fence.fire();
  CopyCompleted witness = std::move(*copy).wait();
  EXPECT_EQ(upstream->live_bytes(), 0U) << "freed once the copy was observed";
  copy.reset();
  EXPECT_EQ(pool.stats().free_buffers, 0U);
}

TEST(CopyWitness, DestroyingAPendingCopyWaitsAndCountsItObserved) {
  PinnedStagingPool pool(host_upstream());
  auto staging = pool.acquire(4096);
  FiresWhenWaited fence;
  { PendingCopy abandoned = WitnessMint::host_copy(staging, fence); }
  EXPECT_EQ(fence.waits->load(), 1);
  EXPECT_EQ(staging.copies_in_flight(), 0U);
  staging.retire(WitnessMint::completed_copy_of(staging));  // no witness came out of it
  EXPECT_EQ(pool.stats().free_buffers, 1U);
}

TEST(CopyWitness, MoveAssigningOverAPendingCopyWaitsForItFirst) {
  PinnedStagingPool pool(host_upstream());
  auto first = pool.acquire(4096);
  auto second = pool.acquire(4096);
  FiresWhenWaited old_fence;
  FiresWhenWaited new_fence;
  PendingCopy copy = WitnessMint::host_copy(first, old_fence);
  PendingCopy replacement = WitnessMint::host_copy(second, new_fence);
  copy = std::move(replacement);
  EXPECT_EQ(old_fence.waits->load(), 1) << "the overwritten copy was dropped without a wait";
  EXPECT_EQ(first.copies_in_flight(), 0U);
  EXPECT_EQ(new_fence.waits->load(), 0);
  EXPECT_EQ(second.copies_in_flight(), 1U);
  second.retire(std::move(copy).wait());
  EXPECT_EQ(new_fence.waits->load(), 1);
}

// For TSan: copies observed on other threads while the owner drops or retires the lease.
TEST(CopyWitness, CopiesWaitedOnOtherThreadsWhileTheOwnerDropsOrRetiresLoseNothing) {
  auto upstream = host_upstream();
  PinnedStagingPool pool(upstream, {.max_buffers = 2, .max_bytes = 1_MiB});
  for (int round = 0; round < 2000; ++round) {
    auto staging = pool.acquire(4096 + 64 * static_cast<std::size_t>(round % 3));
    ManualFence fence;
    PendingCopy copy = WitnessMint::host_copy(staging, fence);
    std::optional<CopyCompleted> witness;
    std::thread waiter([&] {
      fence.fire();
      witness.emplace(std::move(copy).wait());
    });
    if (round % 2 == 0) {
      PooledStaging dropped = std::move(staging);  // dropped while the copy may be in flight
    }
    waiter.join();
    if (round % 2 == 1) staging.retire(std::move(*witness));
  }
  const auto s = pool.stats();
  EXPECT_EQ(s.freed_without_witness, 1000U);
  EXPECT_EQ(s.retired + s.freed_over_bounds, 1000U);
  EXPECT_EQ(upstream->live_bytes(), s.free_bytes) << "a buffer was lost or freed twice";
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(CopyWitness, HandMadePinnedBufferRejectsANullUpstreamOrZeroBytes) {
  EXPECT_THROW(PinnedBuffer(nullptr, 4096), InvalidArgument);
  auto upstream = host_upstream();
  EXPECT_THROW(PinnedBuffer(upstream, 0), InvalidArgument);
  EXPECT_EQ(upstream->allocations(), 0U);
  PinnedBuffer fine(upstream, 4096);
  EXPECT_TRUE(fine);
}

TEST(CopyWitness, EveryAcquireIsANewLease) {
  PinnedStagingPool pool(host_upstream());
  auto staging = pool.acquire(4096);
  EXPECT_EQ(staging.copies_in_flight(), 0U);
  EXPECT_NE(staging.lease_id(), 0U);
  auto next = pool.acquire(4096);
  EXPECT_NE(next.lease_id(), staging.lease_id());
  EXPECT_EQ(PinnedBuffer().lease_id(), 0U);
}

TEST(CopyToDevice, RejectsBadInputBeforeAnyCudaCall) {
  char host[16];
  EXPECT_THROW((void)copy_to_device_async(host, host, 0, nullptr), InvalidArgument);
  EXPECT_THROW((void)copy_to_device_async(nullptr, host, 16, nullptr), InvalidArgument);
  EXPECT_THROW((void)copy_to_device(host, nullptr, 16, nullptr), InvalidArgument);
  PinnedStagingPool pool(host_upstream());
  auto staging = pool.acquire(4096);
  EXPECT_THROW((void)copy_to_device_async(host, staging, 4000, 97, nullptr), InvalidArgument);
  EXPECT_THROW((void)copy_to_device_async(host, staging, 4097, 0, nullptr), InvalidArgument);
  EXPECT_THROW((void)copy_to_device_async(host, staging, 0, 0, nullptr), InvalidArgument);
  EXPECT_THROW((void)copy_to_device_async(nullptr, staging, nullptr), InvalidArgument);
  PooledStaging moved = std::move(staging);
  EXPECT_THROW((void)copy_to_device_async(host, staging, nullptr), InvalidArgument);
  EXPECT_EQ(moved.copies_in_flight(), 0U) << "a rejected copy must not count";
}

// --- On the GPU: real copies held in flight behind a long kernel ----------------------

#ifdef VRAM_HAVE_TEST_KERNELS
class DeviceBytes {
 public:
  explicit DeviceBytes(std::size_t bytes) : bytes_(bytes) {
    cuda::check(cudaMalloc(&data_, bytes), "cudaMalloc");
  }
  ~DeviceBytes() { (void)cudaFree(data_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  std::byte* data() const { return static_cast<std::byte*>(data_); }
  // Whether every byte equals `value`.
  bool holds(unsigned char value) const {
    std::vector<unsigned char> host(bytes_);
    cuda::check(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy");
    for (unsigned char byte : host) {
      if (byte != value) return false;
    }
    return true;
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_;
};

constexpr std::uint64_t kSpinNs = 300'000'000;  // keeps the copy behind it queued

TEST(CopyWitnessGpu, WitnessOfOneCopyDoesNotRetireWhileAnotherCopyIsInFlight) {
  VRAM_GPU_TEST_OR_SKIP();
  PinnedStagingPool pool;
  cuda::Stream fast;
  cuda::Stream slow;
  const std::size_t bytes = 64_MiB;
  const std::size_t half = bytes / 2;
  DeviceBytes destination(bytes);
  DeviceBytes scratch(4);
  auto staging = pool.acquire(bytes);
  std::memset(staging.data(), 0x5A, bytes);
  launch_spin_then_fill(scratch.data(), 1, 0, kSpinNs, slow.get());
  PendingCopy second =
      copy_to_device_async(destination.data() + half, staging, half, half, slow.get());
  PendingCopy first = copy_to_device_async(destination.data(), staging, 0, half, fast.get());
  CopyCompleted partial = std::move(first).wait();
  EXPECT_EQ(staging.copies_in_flight(), 1U);
  EXPECT_THROW(staging.retire(std::move(partial)), InvalidArgument);
  auto meanwhile = pool.acquire(bytes);
  EXPECT_NE(meanwhile.data(), staging.data()) << "handed out while a copy still reads it";
  std::memset(meanwhile.data(), 0xEE, bytes);
  CopyCompleted all = std::move(second).wait();
  staging.retire(std::move(all));
  EXPECT_EQ(pool.stats().free_buffers, 1U);
  EXPECT_TRUE(destination.holds(0x5A)) << "the bytes that reached the device are not the copy's";
}

TEST(CopyWitnessGpu, MovedFromOrStaleWitnessCannotRetireAReacquiredBufferWithACopyInFlight) {
  VRAM_GPU_TEST_OR_SKIP();
  PinnedStagingPool pool;
  cuda::Stream stream;
  const std::size_t bytes = 64_MiB;
  DeviceBytes destination(bytes);
  DeviceBytes scratch(4);
  auto first = pool.acquire(bytes);
  std::memset(first.data(), 0x11, bytes);
  CopyCompleted stale = copy_to_device(destination.data(), first, stream.get()).completed;
  CopyCompleted witness = copy_to_device(destination.data(), first, stream.get()).completed;
  CopyCompleted moved = std::move(witness);
  const std::byte* address = first.data();
  first.retire(std::move(moved));
  auto again = pool.acquire(bytes);
  ASSERT_EQ(again.data(), address) << "precondition: the same buffer is handed out again";
  std::memset(again.data(), 0x77, bytes);
  launch_spin_then_fill(scratch.data(), 1, 0, kSpinNs, stream.get());
  PendingCopy copy = copy_to_device_async(destination.data(), again, stream.get());
  EXPECT_THROW(again.retire(std::move(witness)), InvalidArgument) << "moved-from witness";
  EXPECT_THROW(again.retire(std::move(stale)), InvalidArgument) << "witness of the last loan";
  auto meanwhile = pool.acquire(bytes);
  EXPECT_NE(meanwhile.data(), again.data()) << "handed out while its copy was queued";
  std::memset(meanwhile.data(), 0xEE, bytes);
  again.retire(std::move(copy).wait());
  EXPECT_TRUE(destination.holds(0x77)) << "the bytes that reached the device are not the copy's";
}

TEST(CopyWitnessGpu, SecondWaitOnARealCopyThrows) {
  VRAM_GPU_TEST_OR_SKIP();
  PinnedStagingPool pool;
  cuda::Stream stream;
  const std::size_t bytes = 16_MiB;
  DeviceBytes destination(bytes);
  DeviceBytes scratch(4);
  auto staging = pool.acquire(bytes);
  std::memset(staging.data(), 0x42, bytes);
  launch_spin_then_fill(scratch.data(), 1, 0, kSpinNs, stream.get());
  PendingCopy copy = copy_to_device_async(destination.data(), staging, stream.get());
  CopyResult result = std::move(copy).wait_timed();
  EXPECT_GT(result.elapsed_ms, 0.0F);
  EXPECT_TRUE(stream.ready());
  EXPECT_THROW((void)std::move(copy).wait(), InvalidArgument);
  staging.retire(std::move(result.completed));
  EXPECT_TRUE(destination.holds(0x42));
}

TEST(CopyWitnessGpu, DroppedLeaseIsUnpinnedOnlyAfterItsCopy) {
  VRAM_GPU_TEST_OR_SKIP();
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<PinnedHostUpstream>());
  PinnedStagingPool pool(upstream);
  cuda::Stream stream;
  const std::size_t bytes = 64_MiB;
  DeviceBytes destination(bytes);
  DeviceBytes scratch(4);
  std::optional<PendingCopy> copy;
  {
    auto staging = pool.acquire(bytes);
    std::memset(staging.data(), 0x24, bytes);
    launch_spin_then_fill(scratch.data(), 1, 0, kSpinNs, stream.get());
    copy.emplace(copy_to_device_async(destination.data(), staging, stream.get()));
  }
  EXPECT_EQ(upstream->live_bytes(), bytes) << "unpinned while the copy was queued";
  (void)std::move(*copy).wait();
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_TRUE(destination.holds(0x24));
}

TEST(CopyWitnessGpu, ForeignPinnedBufferIsRefused) {
  VRAM_GPU_TEST_OR_SKIP();
  PinnedStagingPool pool;
  PinnedBuffer by_hand(std::make_shared<PinnedHostUpstream>(), 1_MiB);
  EXPECT_THROW(pool.retire(std::move(by_hand), WitnessMint::completed_copy_of(by_hand)),
               InvalidArgument);
  EXPECT_TRUE(by_hand);
  EXPECT_EQ(pool.stats().free_buffers, 0U);
}
#endif

}  // namespace
}  // namespace vram::testing
