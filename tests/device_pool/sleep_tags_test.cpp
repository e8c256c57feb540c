// Sleep tags (vram/sleep_tag.hpp; src/device_pool/sleep_tags.hpp, tag_arena.hpp): the tag
// bookkeeping, every misuse, and the sleep/wake round trip of contents over the host
// emulation of virtual memory (HostVirtualMemory charges a TestUpstream for each granule
// mapped, so "physical" memory given back is seen there). The Gpu cases repeat the round
// trip over CUDA virtual memory.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "bench/child_process.hpp"
#include "device_pool/sleep_copier.hpp"
#include "gpu_test_policy.hpp"
#include "test_kernels.hpp"
#include "test_upstreams.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/device_pool.hpp"
#include "vram/pinned_host_upstream.hpp"

namespace vram::testing {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

struct HostPool {
  explicit HostPool(std::size_t capacity = SIZE_MAX)
      : physical(std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(),
                                                TestUpstream::Options{.capacity_bytes = capacity})),
        pool(physical, options()) {}
  static DevicePool::Options options() {
    DevicePool::Options o;
    o.large_tier.memory = LargeTierMemory::virtual_memory;
    o.large_tier.virtual_reservation_bytes = std::size_t{1} << 30;
    return o;
  }
  std::shared_ptr<TestUpstream> physical;
  DevicePool pool;
};

SleepTagOptions small_tag(bool discardable = false, std::shared_ptr<Upstream> backup = nullptr) {
  return {.discardable = discardable,
          .reservation_bytes = std::size_t{512} << 20,
          .backup = std::move(backup),
          .backup_chunk_bytes = 4 * kMiB,
          .map_ahead_bytes = 4 * kMiB};
}

void fill(void* block, std::size_t bytes, std::uint32_t seed) {
  auto* words = static_cast<std::uint32_t*>(block);
  for (std::size_t i = 0; i < bytes / 4; ++i) words[i] = seed * 2654435761u + std::uint32_t(i);
}

std::size_t mismatches(const void* block, std::size_t bytes, std::uint32_t seed) {
  const auto* words = static_cast<const std::uint32_t*>(block);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < bytes / 4; ++i) {
    bad += words[i] != seed * 2654435761u + std::uint32_t(i) ? 1 : 0;
  }
  return bad;
}

bool inside(const SleepTagStats& s, const void* p) {
  const auto* c = static_cast<const char*>(p);
  return c >= s.base && c < s.base + s.reservation_bytes;
}

struct Block {
  void* pointer;
  std::size_t bytes;
};

// Sizes of every kind: small classes (small tier and large-tier carved) and large ones.
const std::vector<std::size_t> kMixedSizes = {300,      4096,          100000, 600 * 1024,
                                              3 * kMiB, 5 * kMiB + 17, 256,    9 * kMiB};

TEST(SleepTags, CreateFindAndNames) {
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  const SleepTag kv = h.pool.create_tag("kv", small_tag(true));
  EXPECT_TRUE(weights);
  EXPECT_NE(weights, kv);
  EXPECT_EQ(h.pool.find_tag("weights"), weights);
  EXPECT_EQ(h.pool.find_tag("kv"), kv);
  EXPECT_FALSE(h.pool.find_tag("none").has_value());
  EXPECT_EQ(h.pool.tags().size(), 2U);
  EXPECT_THROW((void)h.pool.create_tag("weights", small_tag()), InvalidArgument);
  EXPECT_THROW((void)h.pool.create_tag("", small_tag()), InvalidArgument);
  const SleepTagStats s = h.pool.tag_stats(kv);
  EXPECT_EQ(s.name, "kv");
  EXPECT_TRUE(s.discardable);
  EXPECT_EQ(s.state, SleepState::awake);
  EXPECT_EQ(s.live_blocks, 0U);
  EXPECT_EQ(s.mapped_bytes, 0U);
}

TEST(SleepTags, NeedVirtualMemory) {
  DevicePool::Options o;
  o.large_tier.memory = LargeTierMemory::segments;
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), o);
  EXPECT_THROW((void)pool.create_tag("weights"), InvalidArgument);
}

TEST(SleepTags, ScopeRoutesThisThreadsRequestsOnly) {
  HostPool h;
  const SleepTag a = h.pool.create_tag("a", small_tag());
  const SleepTag b = h.pool.create_tag("b", small_tag());
  const SleepTagStats sa = h.pool.tag_stats(a);
  const SleepTagStats sb = h.pool.tag_stats(b);
  void* outside = h.pool.allocate(4096);
  EXPECT_FALSE(inside(sa, outside));
  void* in_a = nullptr;
  void* in_b = nullptr;
  void* in_a_again = nullptr;
  void* other_thread = nullptr;
  {
    auto scope = h.pool.tag_scope(a);
    in_a = h.pool.allocate(4096);
    {
      auto inner = h.pool.tag_scope(b);
      in_b = h.pool.allocate(3 * kMiB);
    }
    in_a_again = h.pool.allocate_async(300, reinterpret_cast<cudaStream_t>(0x10));
    std::thread([&] { other_thread = h.pool.allocate(4096); }).join();
  }
  void* after = h.pool.allocate(4096);
  EXPECT_TRUE(inside(sa, in_a));
  EXPECT_TRUE(inside(sb, in_b));
  EXPECT_TRUE(inside(sa, in_a_again));
  EXPECT_FALSE(inside(sa, other_thread));
  EXPECT_FALSE(inside(sa, after));
  void* tagged = h.pool.allocate_tagged(1000, b);
  EXPECT_TRUE(inside(sb, tagged));
  EXPECT_EQ(h.pool.tag_stats(a).live_blocks, 2U);
  EXPECT_EQ(h.pool.tag_stats(b).live_blocks, 2U);
  for (void* p : {outside, other_thread, after}) h.pool.deallocate(p, 4096);
  h.pool.deallocate(in_a, 4096);
  h.pool.deallocate(in_b, 3 * kMiB);
  h.pool.deallocate_async(in_a_again, 300, reinterpret_cast<cudaStream_t>(0x10));
  h.pool.deallocate(tagged, 1000);
  EXPECT_EQ(h.pool.tag_stats(a).live_blocks, 0U);
  EXPECT_EQ(h.pool.tag_stats(b).live_blocks, 0U);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
  EXPECT_EQ(h.pool.stats().bytes_in_use, 0U);
}

// Which tag a plain request of this thread lands in: 0 for none, else 1 + its index in `tags`.
std::size_t routed(DevicePool& pool, const std::vector<SleepTag>& tags) {
  void* block = pool.allocate(4096);
  std::size_t which = 0;
  for (std::size_t i = 0; i < tags.size() && which == 0; ++i) {
    if (inside(pool.tag_stats(tags[i]), block)) which = i + 1;
  }
  pool.deallocate(block, 4096);
  return which;
}

TEST(SleepTags, ScopesEndedOutOfOrderLeaveTheInnermostOpenOneRouting) {
  HostPool h;
  const SleepTag a = h.pool.create_tag("a", small_tag());
  const SleepTag b = h.pool.create_tag("b", small_tag());
  const SleepTag c = h.pool.create_tag("c", small_tag());
  const std::vector<SleepTag> tags = {a, b, c};
  {
    std::optional<DevicePool::TagScope> outer(h.pool.tag_scope(a));
    std::optional<DevicePool::TagScope> inner(h.pool.tag_scope(b));
    outer.reset();  // the outer one first: the inner one still routes
    EXPECT_EQ(routed(h.pool, tags), 2U);
    inner.reset();
    EXPECT_EQ(routed(h.pool, tags), 0U);
  }
  {
    auto first = h.pool.tag_scope(a);
    auto second = h.pool.tag_scope(b);
    auto third = h.pool.tag_scope(c);
    second.end();  // the middle one
    EXPECT_EQ(routed(h.pool, tags), 3U);
    third.end();
    EXPECT_EQ(routed(h.pool, tags), 1U);  // not b: it ended
    first.end();
    EXPECT_EQ(routed(h.pool, tags), 0U);
  }
  // No scope open: a sleeping tag does not refuse plain requests.
  h.pool.sleep(a);
  void* plain = nullptr;
  EXPECT_NO_THROW(plain = h.pool.allocate(4096));
  h.pool.deallocate(plain, 4096);
  h.pool.wake(a);
  EXPECT_EQ(h.pool.stats().bytes_in_use, 0U);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTags, AScopeEndedOnAnotherThreadEndsOnlyTheOpenersRouting) {
  HostPool h;
  const SleepTag a = h.pool.create_tag("a", small_tag());
  const SleepTag b = h.pool.create_tag("b", small_tag());
  const std::vector<SleepTag> tags = {a, b};
  std::size_t other_before = 9;
  std::size_t other_after = 9;
  {
    DevicePool::TagScope scope = h.pool.tag_scope(a);
    EXPECT_EQ(routed(h.pool, tags), 1U);
    std::thread([&, moved = std::move(scope)]() mutable {
      auto own = h.pool.tag_scope(b);
      other_before = routed(h.pool, tags);
      moved.end();  // the opener's scope: this thread's own stays
      other_after = routed(h.pool, tags);
    }).join();
  }
  EXPECT_EQ(other_before, 2U);
  EXPECT_EQ(other_after, 2U);
  EXPECT_EQ(routed(h.pool, tags), 0U);
  // Ended on another thread while an outer scope of the opener stays open.
  {
    auto outer = h.pool.tag_scope(b);
    DevicePool::TagScope inner = h.pool.tag_scope(a);
    std::thread([moved = std::move(inner)]() mutable { moved.end(); }).join();
    EXPECT_EQ(routed(h.pool, tags), 2U);
  }
  EXPECT_EQ(routed(h.pool, tags), 0U);
  // Opened on a thread that exits first, ended here afterwards.
  DevicePool::TagScope orphan;
  std::thread([&] { orphan = h.pool.tag_scope(a); }).join();
  EXPECT_EQ(routed(h.pool, tags), 0U);
  orphan.end();
  EXPECT_EQ(h.pool.stats().bytes_in_use, 0U);
}

TEST(SleepTags, AScopeOfAnotherPoolDoesNotChangeThisPoolsRouting) {
  HostPool h;
  HostPool other;
  const SleepTag a = h.pool.create_tag("a", small_tag());
  const SleepTag x = other.pool.create_tag("x", small_tag());
  auto scope = h.pool.tag_scope(a);
  {
    auto inner = other.pool.tag_scope(x);
    EXPECT_EQ(routed(h.pool, {a}), 1U);
    EXPECT_EQ(routed(other.pool, {x}), 1U);
  }
  EXPECT_EQ(routed(h.pool, {a}), 1U);
  EXPECT_EQ(routed(other.pool, {x}), 0U);
}

TEST(SleepTags, NoScopeOfADestroyedPoolRoutesALaterPool) {
  auto physical = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  // A later pool's core may land at the same address as a destroyed one's, its first tag at
  // the same index.
  const auto later_pools_route = [&] {
    std::size_t routed_into_kv = 0;
    for (int i = 0; i < 4; ++i) {
      DevicePool later(physical, HostPool::options());
      const SleepTag kv = later.create_tag("kv", small_tag(true));
      routed_into_kv += routed(later, {kv});
    }
    return routed_into_kv;
  };
  {
    DevicePool pool(physical, HostPool::options());
    const SleepTag a = pool.create_tag("a", small_tag(true));
    const SleepTag b = pool.create_tag("b", small_tag(true));
    std::optional<DevicePool::TagScope> outer(pool.tag_scope(a));
    std::optional<DevicePool::TagScope> inner(pool.tag_scope(b));
    outer.reset();
    inner.reset();
  }
  EXPECT_EQ(later_pools_route(), 0U);
  DevicePool::TagScope open_scope;
  {
    DevicePool pool(physical, HostPool::options());
    open_scope = pool.tag_scope(pool.create_tag("a", small_tag(true)));
  }  // destroyed with a scope open on this thread
  EXPECT_EQ(later_pools_route(), 0U);
  open_scope.end();  // safe: the scope kept the destroyed pool's bookkeeping alive
  EXPECT_EQ(physical->live_bytes(), 0U);
  EXPECT_EQ(physical->bad_frees(), 0U);
}

TEST(SleepTags, SleepReleasesTheMappedMemoryAndWakeRestoresContentsAtTheSameAddresses) {
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  std::vector<Block> blocks;
  {
    auto scope = h.pool.tag_scope(weights);
    for (std::size_t i = 0; i < kMixedSizes.size(); ++i) {
      blocks.push_back({h.pool.allocate(kMixedSizes[i]), kMixedSizes[i]});
      fill(blocks.back().pointer, kMixedSizes[i], std::uint32_t(i + 1));
    }
  }
  const SleepTagStats awake = h.pool.tag_stats(weights);
  ASSERT_GT(awake.mapped_bytes, 0U);
  EXPECT_EQ(h.pool.stats().sleep_tag_bytes_mapped, awake.mapped_bytes);
  const std::size_t physical_awake = h.physical->live_bytes();

  h.pool.sleep(weights);
  const SleepTagStats asleep = h.pool.tag_stats(weights);
  EXPECT_EQ(asleep.state, SleepState::asleep);
  EXPECT_EQ(asleep.mapped_bytes, 0U);
  EXPECT_EQ(h.physical->live_bytes(), physical_awake - awake.mapped_bytes);
  EXPECT_GE(asleep.backed_up_bytes, awake.live_bytes);
  EXPECT_EQ(h.pool.stats().sleeping_tags, 1U);

  h.pool.wake(weights);
  const SleepTagStats woken = h.pool.tag_stats(weights);
  EXPECT_EQ(woken.state, SleepState::awake);
  EXPECT_EQ(woken.base, awake.base);
  EXPECT_EQ(woken.live_blocks, blocks.size());
  EXPECT_LE(woken.mapped_bytes, awake.mapped_bytes);  // only the granules under blocks
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_EQ(mismatches(blocks[i].pointer, blocks[i].bytes, std::uint32_t(i + 1)), 0U) << i;
  }
  for (const Block& b : blocks) h.pool.deallocate(b.pointer, b.bytes);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTags, AdjacentBlocksAreCopiedAsOneRange) {
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  std::vector<void*> blocks;
  auto scope = h.pool.tag_scope(weights);
  for (int i = 0; i < 64; ++i) blocks.push_back(h.pool.allocate(64 * 1024));
  h.pool.deallocate(blocks[10], 64 * 1024);  // a small hole is copied through
  h.pool.sleep(weights);
  EXPECT_EQ(h.pool.tag_stats(weights).copies, 1U);
  h.pool.wake(weights);
  EXPECT_EQ(h.pool.tag_stats(weights).copies, 1U);  // of the last sleep
  for (int i = 0; i < 64; ++i) {
    if (i != 10) h.pool.deallocate(blocks[i], 64 * 1024);
  }
}

TEST(SleepTags, DiscardableTagCopiesNothingAndComesBackMapped) {
  auto backup = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  HostPool h;
  const SleepTag kv = h.pool.create_tag("kv", small_tag(true, backup));
  void* cache = h.pool.allocate_tagged(20 * kMiB, kv);
  const std::size_t mapped = h.pool.tag_stats(kv).mapped_bytes;
  const std::size_t physical = h.physical->live_bytes();
  h.pool.sleep(kv);
  EXPECT_EQ(backup->live_bytes(), 0U);
  EXPECT_EQ(h.pool.tag_stats(kv).backed_up_bytes, 0U);
  EXPECT_EQ(h.physical->live_bytes(), physical - mapped);
  h.pool.wake(kv);
  EXPECT_GE(h.pool.tag_stats(kv).mapped_bytes, 20 * kMiB);
  std::memset(cache, 0x5a, 20 * kMiB);  // mapped and writable, contents undefined before
  h.pool.deallocate(cache, 20 * kMiB);
}

TEST(SleepTags, SleepThatDiscardsCopiesNothingEvenWithABackupAndKeepsTheBackupForLater) {
  auto backup = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag(false, backup));
  void* block = h.pool.allocate_tagged(12 * kMiB, weights);
  fill(block, 12 * kMiB, 7);
  h.pool.sleep(weights);  // a first cycle that keeps: the backup is pinned
  h.pool.wake(weights);
  const std::size_t pinned = backup->live_bytes();
  ASSERT_GE(pinned, 12 * kMiB);
  const std::size_t mapped = h.pool.tag_stats(weights).mapped_bytes;
  const std::size_t physical = h.physical->live_bytes();

  h.pool.sleep(weights, nullptr, SleepContents::discard);
  const SleepTagStats asleep = h.pool.tag_stats(weights);
  EXPECT_EQ(asleep.state, SleepState::asleep);
  EXPECT_EQ(asleep.backed_up_bytes, 0U);
  EXPECT_EQ(asleep.copies, 0U);
  EXPECT_EQ(asleep.mapped_bytes, 0U);
  EXPECT_EQ(h.physical->live_bytes(), physical - mapped);
  EXPECT_EQ(backup->live_bytes(), pinned);  // kept for a later sleep that keeps
  EXPECT_EQ(asleep.live_blocks, 1U);        // the block stays leased at its address

  h.pool.wake(weights);
  EXPECT_EQ(h.pool.tag_stats(weights).state, SleepState::awake);
  EXPECT_GE(h.pool.tag_stats(weights).mapped_bytes, 12 * kMiB);
  fill(block, 12 * kMiB, 9);  // mapped and writable: the caller reloads the contents
  h.pool.sleep(weights);      // keeps again, through the same backup
  EXPECT_EQ(backup->live_bytes(), pinned);
  h.pool.wake(weights);
  EXPECT_EQ(mismatches(block, 12 * kMiB, 9), 0U);
  h.pool.deallocate(block, 12 * kMiB);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTags, SleepThatDiscardsSeveralTagsAndIsRefusedForASleepingOne) {
  HostPool h;
  const SleepTag a = h.pool.create_tag("a", small_tag());
  const SleepTag b = h.pool.create_tag("b", small_tag(true));
  void* pa = h.pool.allocate_tagged(3 * kMiB, a);
  void* pb = h.pool.allocate_tagged(3 * kMiB, b);
  h.pool.sleep({a, b}, nullptr, SleepContents::discard);
  EXPECT_EQ(h.pool.tag_stats(a).state, SleepState::asleep);
  EXPECT_EQ(h.pool.tag_stats(b).state, SleepState::asleep);
  EXPECT_EQ(h.pool.tag_stats(a).backed_up_bytes, 0U);
  EXPECT_THROW(h.pool.sleep(a, nullptr, SleepContents::discard), InvalidArgument);
  EXPECT_EQ(h.pool.tag_stats(a).state, SleepState::asleep);
  h.pool.wake({a, b});
  h.pool.deallocate(pa, 3 * kMiB);
  h.pool.deallocate(pb, 3 * kMiB);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
}

// The proof that unmaps a tag's memory: only a copier's wait() mints it, once.
using detail::CopiesCompleted;
using detail::SleepCopier;
static_assert(!std::is_default_constructible_v<CopiesCompleted>);
static_assert(!std::is_copy_constructible_v<CopiesCompleted>);
static_assert(!std::is_copy_assignable_v<CopiesCompleted>);
static_assert(!std::is_constructible_v<CopiesCompleted, std::uint64_t>);
static_assert(!std::is_convertible_v<std::uint64_t, CopiesCompleted>);
static_assert(std::is_nothrow_move_constructible_v<CopiesCompleted>);

TEST(CopiesCompletedWitness, OnlyTheCopiersOwnWitnessIsAccepted) {
  const auto first = SleepCopier::for_host();
  const auto second = SleepCopier::for_host();
  const CopiesCompleted proof = first->wait();
  EXPECT_EQ(proof.batch(), first->batch());
  EXPECT_NO_THROW(first->check(proof));
  EXPECT_THROW(second->check(proof), std::logic_error);  // another copier's
}

TEST(CopiesCompletedWitness, AWitnessOfAnEarlierCycleProvesNothingNow) {
  const auto earlier = SleepCopier::for_host();
  const CopiesCompleted stale = earlier->wait();
  const auto now = SleepCopier::for_host();
  EXPECT_NE(now->batch(), earlier->batch());
  EXPECT_THROW(now->check(stale), std::logic_error);
  EXPECT_NO_THROW(now->check(now->wait()));
}

TEST(CopiesCompletedWitness, ASecondWaitIsRefusedAndTheFirstWitnessStaysValid) {
  const auto copier = SleepCopier::for_host();
  const CopiesCompleted proof = copier->wait();
  EXPECT_THROW((void)copier->wait(), std::logic_error);
  EXPECT_NO_THROW(copier->check(proof));
}

TEST(CopiesCompletedWitness, AMovedFromWitnessProvesNothing) {
  const auto copier = SleepCopier::for_host();
  CopiesCompleted proof = copier->wait();
  CopiesCompleted moved = std::move(proof);
  EXPECT_EQ(proof.batch(), 0U);  // NOLINT(bugprone-use-after-move): the moved-from state
  EXPECT_THROW(copier->check(proof), std::logic_error);
  EXPECT_NO_THROW(copier->check(moved));
}

TEST(CopiesCompletedWitness, ACopyAfterSealIsRefusedAndTheWitnessStillComes) {
  const auto copier = SleepCopier::for_host();
  std::vector<std::byte> device(64, std::byte{7});
  std::vector<std::byte> host(64);
  copier->to_host(host.data(), device.data(), 64);
  copier->seal();
  copier->seal();  // sealing again changes nothing
  std::fill(device.begin(), device.end(), std::byte{9});
  EXPECT_THROW(copier->to_host(host.data(), device.data(), 64), std::logic_error);
  EXPECT_EQ(host[0], std::byte{7}) << "a refused copy copies nothing";
  EXPECT_EQ(host[63], std::byte{7});
  EXPECT_THROW(copier->to_device(device.data(), host.data(), 64), std::logic_error);
  EXPECT_EQ(device[0], std::byte{9});
  EXPECT_NO_THROW(copier->check(copier->wait()));
}

TEST(SleepTags, TwentyCyclesGrowNeitherHostNorMappedMemory) {
  auto backup = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag(false, backup));
  const SleepTag kv = h.pool.create_tag("kv", small_tag(true));
  std::vector<Block> blocks;
  {
    auto scope = h.pool.tag_scope(weights);
    for (std::size_t i = 0; i < kMixedSizes.size(); ++i) {
      blocks.push_back({h.pool.allocate(kMixedSizes[i]), kMixedSizes[i]});
      fill(blocks.back().pointer, kMixedSizes[i], std::uint32_t(i + 7));
    }
  }
  void* cache = h.pool.allocate_tagged(8 * kMiB, kv);
  std::size_t backup_after_first = 0;
  std::size_t physical_after_first = 0;
  std::size_t backup_calls_after_first = 0;
  for (int cycle = 0; cycle < 20; ++cycle) {
    h.pool.sleep({weights, kv});
    h.pool.wake(std::vector<SleepTag>{weights, kv});
    if (cycle == 0) {
      backup_after_first = backup->live_bytes();
      physical_after_first = h.physical->live_bytes();
      backup_calls_after_first = backup->allocations();
    }
  }
  EXPECT_EQ(backup->live_bytes(), backup_after_first);
  EXPECT_EQ(backup->allocations(), backup_calls_after_first);  // pinned once, reused
  EXPECT_EQ(h.physical->live_bytes(), physical_after_first);
  EXPECT_EQ(h.pool.tag_stats(weights).sleeps, 20U);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_EQ(mismatches(blocks[i].pointer, blocks[i].bytes, std::uint32_t(i + 7)), 0U) << i;
    h.pool.deallocate(blocks[i].pointer, blocks[i].bytes);
  }
  h.pool.deallocate(cache, 8 * kMiB);
}

TEST(SleepTags, SleepTwiceAndWakeWithoutSleepAreRefused) {
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  void* block = h.pool.allocate_tagged(4096, weights);
  fill(block, 4096, 3);
  EXPECT_THROW(h.pool.wake(weights), InvalidArgument);
  EXPECT_EQ(h.pool.tag_stats(weights).state, SleepState::awake);
  h.pool.sleep(weights);
  EXPECT_THROW(h.pool.sleep(weights), InvalidArgument);
  EXPECT_EQ(h.pool.tag_stats(weights).state, SleepState::asleep);
  h.pool.wake(weights);
  EXPECT_EQ(mismatches(block, 4096, 3), 0U);
  h.pool.deallocate(block, 4096);
}

TEST(SleepTags, RequestsIntoASleepingTagAreRefused) {
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  h.pool.sleep(weights);
  EXPECT_THROW((void)h.pool.allocate_tagged(4096, weights), InvalidArgument);
  {
    auto scope = h.pool.tag_scope(weights);
    EXPECT_THROW((void)h.pool.allocate(4096), InvalidArgument);
    EXPECT_THROW((void)h.pool.acquire(8 * kMiB), InvalidArgument);
  }
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 0U);
  EXPECT_EQ(h.pool.stats().bytes_in_use, 0U);
  h.pool.wake(weights);
}

TEST(SleepTags, AReleaseIntoASleepingTagIsRefusedAndTheBlockSurvives) {
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  void* block = h.pool.allocate_tagged(3 * kMiB, weights);
  fill(block, 3 * kMiB, 9);
  h.pool.sleep(weights);
  h.pool.deallocate(block, 3 * kMiB);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 1U);
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 1U);
  h.pool.wake(weights);
  EXPECT_EQ(mismatches(block, 3 * kMiB, 9), 0U);
  h.pool.deallocate(block, 3 * kMiB);
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 0U);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 1U);
}

TEST(SleepTags, WrongSizeOrDoubleReleaseOfATaggedBlockIsRefused) {
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  void* block = h.pool.allocate_tagged(3 * kMiB, weights);
  h.pool.deallocate(block, 5 * kMiB);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 1U);
  h.pool.deallocate(block, 3 * kMiB);
  h.pool.deallocate(block, 3 * kMiB);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 2U);
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 0U);
}

TEST(SleepTags, ATagNeverCreatedOrOfAnotherPoolIsRefused) {
  HostPool h;
  HostPool other;
  const SleepTag mine = h.pool.create_tag("weights", small_tag());
  const SleepTag theirs = other.pool.create_tag("weights", small_tag());
  const SleepTag never{mine.pool, 7};
  for (const SleepTag& bad : {theirs, never, SleepTag{}}) {
    EXPECT_THROW(h.pool.sleep(bad), InvalidArgument);
    EXPECT_THROW(h.pool.wake(bad), InvalidArgument);
    EXPECT_THROW((void)h.pool.tag_scope(bad), InvalidArgument);
    EXPECT_THROW((void)h.pool.allocate_tagged(4096, bad), InvalidArgument);
    EXPECT_THROW((void)h.pool.tag_stats(bad), InvalidArgument);
  }
  // A list with one bad tag changes nothing.
  EXPECT_THROW(h.pool.sleep({mine, never}), InvalidArgument);
  EXPECT_EQ(h.pool.tag_stats(mine).state, SleepState::awake);
}

TEST(SleepTags, AReservationAboveWhatAPoolCanSpanIsRefusedWithNothingTaken) {
  HostPool h;
  const SleepTag first = h.pool.create_tag("first", small_tag());
  const std::vector<SleepTag> before = h.pool.tags();
  for (const std::size_t bytes :
       {SIZE_MAX, SIZE_MAX - (std::size_t{2} << 20) + 2, std::size_t{1} << 62,
        (std::size_t{16} << 40) + 1, std::size_t{17} << 40}) {
    SleepTagOptions options = small_tag();
    options.reservation_bytes = bytes;
    try {
      (void)h.pool.create_tag("huge", options);
      ADD_FAILURE() << "reservation_bytes " << bytes << " was accepted";
    } catch (const InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("16 TiB"), std::string::npos) << what;
      EXPECT_NE(what.find("Fix:"), std::string::npos) << what;
    }
    EXPECT_EQ(h.pool.tags(), before);
    EXPECT_FALSE(h.pool.find_tag("huge").has_value());
  }
  // The name and the slot are free: the next tag takes index 2.
  const SleepTag huge = h.pool.create_tag("huge", small_tag());
  EXPECT_EQ(huge.index, first.index + 1);
  EXPECT_EQ(h.pool.tags().size(), 2U);
}

TEST(SleepTags, BackupMemoryExhaustedLeavesTheTagAwakeAndIntact) {
  auto backup = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(),
                                               TestUpstream::Options{.capacity_bytes = 2 * kMiB});
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag(false, backup));
  void* block = h.pool.allocate_tagged(6 * kMiB, weights);
  fill(block, 6 * kMiB, 11);
  const std::size_t mapped = h.pool.tag_stats(weights).mapped_bytes;
  EXPECT_THROW(h.pool.sleep(weights), OutOfMemory);
  const SleepTagStats s = h.pool.tag_stats(weights);
  EXPECT_EQ(s.state, SleepState::awake);
  EXPECT_EQ(s.mapped_bytes, mapped);
  EXPECT_EQ(mismatches(block, 6 * kMiB, 11), 0U);
  h.pool.deallocate(block, 6 * kMiB);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTags, DeviceMemoryExhaustedAtWakeLeavesTheTagAsleepAndIntact) {
  HostPool h(64 * kMiB);
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  void* block = h.pool.allocate_tagged(24 * kMiB, weights);
  fill(block, 24 * kMiB, 13);
  h.pool.sleep(weights);
  void* hog = h.pool.allocate(56 * kMiB);  // takes what the tag gave back
  EXPECT_THROW(h.pool.wake(weights), OutOfMemory);
  EXPECT_EQ(h.pool.tag_stats(weights).state, SleepState::asleep);
  EXPECT_EQ(h.pool.tag_stats(weights).mapped_bytes, 0U);
  h.pool.deallocate(hog, 56 * kMiB);
  h.pool.trim();
  h.pool.wake(weights);
  EXPECT_EQ(mismatches(block, 24 * kMiB, 13), 0U);
  h.pool.deallocate(block, 24 * kMiB);
}

// Runs of 4 MiB: a wake maps a tag in several runs and queues each run's copies once it is
// mapped, so ranges straddle runs.
DevicePool::Options four_mib_runs() {
  DevicePool::Options o = HostPool::options();
  o.large_tier.virtual_run_bytes = 4 * kMiB;
  return o;
}

TEST(SleepTags, WakeInRunsRestoresRangesThatStraddleRuns) {
  auto physical = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(physical, four_mib_runs());
  const SleepTag weights = pool.create_tag("weights", small_tag());
  std::vector<Block> blocks;
  for (std::size_t i = 0; i < kMixedSizes.size(); ++i) {
    blocks.push_back({pool.allocate_tagged(kMixedSizes[i], weights), kMixedSizes[i]});
    fill(blocks.back().pointer, kMixedSizes[i], static_cast<std::uint32_t>(i + 1));
  }
  for (int cycle = 0; cycle < 3; ++cycle) {
    pool.sleep(weights);
    ASSERT_EQ(pool.tag_stats(weights).mapped_bytes, 0U);
    pool.wake(weights);
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      EXPECT_EQ(mismatches(blocks[i].pointer, blocks[i].bytes, static_cast<std::uint32_t>(i + 1)),
                0U)
          << "block " << i << " cycle " << cycle;
    }
  }
  EXPECT_GT(pool.tag_stats(weights).mapped_bytes, 4 * kMiB);  // more than one run
  for (const Block& b : blocks) pool.deallocate(b.pointer, b.bytes);
  EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
}

// A sleep releases each run once the copies of its live bytes are proven: with a tag in
// many runs, with free ranges among its blocks and ranges straddling runs, every run is
// given back and every word comes back; a discarding sleep gives every run back too.
TEST(SleepTags, SleepInRunsGivesBackEveryRunAndKeepsEveryWord) {
  auto physical = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(physical, four_mib_runs());
  const std::size_t untagged_live = physical->live_bytes();
  const SleepTag weights = pool.create_tag("weights", small_tag());
  std::vector<Block> blocks;
  std::vector<Block> freed;
  for (int round = 0; round < 3; ++round) {
    for (std::size_t i = 0; i < kMixedSizes.size(); ++i) {
      blocks.push_back({pool.allocate_tagged(kMixedSizes[i], weights), kMixedSizes[i]});
    }
    freed.push_back({pool.allocate_tagged(6 * kMiB, weights), 6 * kMiB});
  }
  for (const Block& b : freed) pool.deallocate(b.pointer, b.bytes);  // gaps among the runs
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    fill(blocks[i].pointer, blocks[i].bytes, static_cast<std::uint32_t>(i + 100));
  }
  ASSERT_GT(pool.tag_stats(weights).mapped_bytes, 8 * 4 * kMiB);  // runs of 4 MiB: many
  for (int cycle = 0; cycle < 3; ++cycle) {
    pool.sleep(weights);
    EXPECT_EQ(pool.tag_stats(weights).mapped_bytes, 0U);
    EXPECT_EQ(physical->live_bytes(), untagged_live) << "cycle " << cycle;
    pool.wake(weights);
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      EXPECT_EQ(mismatches(blocks[i].pointer, blocks[i].bytes, static_cast<std::uint32_t>(i + 100)),
                0U)
          << "block " << i << " cycle " << cycle;
    }
  }
  pool.sleep(weights, nullptr, SleepContents::discard);
  EXPECT_EQ(physical->live_bytes(), untagged_live);
  pool.wake(weights);
  for (const Block& b : blocks) pool.deallocate(b.pointer, b.bytes);
  EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTags, WakeFailingAtALaterRunLeavesTheTagAsleepAndIntact) {
  auto physical = std::make_shared<TestUpstream>(
      std::make_shared<HostMemoryUpstream>(), TestUpstream::Options{.capacity_bytes = 64 * kMiB});
  DevicePool pool(physical, four_mib_runs());
  const SleepTag weights = pool.create_tag("weights", small_tag());
  void* block = pool.allocate_tagged(24 * kMiB, weights);
  fill(block, 24 * kMiB, 17);
  pool.sleep(weights);
  void* hog = pool.allocate(48 * kMiB);  // 16 MiB left: the first runs map, a later one fails
  const std::uint64_t allocations = physical->allocations();
  const std::size_t live = physical->live_bytes();
  EXPECT_THROW(pool.wake(weights), OutOfMemory);
  EXPECT_GT(physical->allocations(), allocations);  // some runs were mapped (and copied into)
  EXPECT_EQ(physical->live_bytes(), live);          // and every one given back
  EXPECT_EQ(pool.tag_stats(weights).state, SleepState::asleep);
  EXPECT_EQ(pool.tag_stats(weights).mapped_bytes, 0U);
  pool.deallocate(hog, 48 * kMiB);
  pool.trim();
  pool.wake(weights);
  EXPECT_EQ(mismatches(block, 24 * kMiB, 17), 0U);
  pool.deallocate(block, 24 * kMiB);
  EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTags, DestroyingThePoolWithATaggedLeaseKeepsTheLeaseSafe) {
  auto backup = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto physical = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Lease lease;
  {
    DevicePool pool(physical, HostPool::options());
    const SleepTag weights = pool.create_tag("weights", small_tag(false, backup));
    auto scope = pool.tag_scope(weights);
    lease = pool.acquire(3 * kMiB);
    scope.end();
    pool.sleep(weights);
  }
  EXPECT_EQ(backup->live_bytes(), 0U);
  lease.reset();  // accepted: the last block back releases the tag's range
  EXPECT_EQ(physical->live_bytes(), 0U);
  EXPECT_EQ(physical->bad_frees(), 0U);
}

TEST(SleepTags, StreamFreedRangesServeOnlyTheirStreamUntilSleep) {
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  const auto s1 = reinterpret_cast<cudaStream_t>(0x100);
  const auto s2 = reinterpret_cast<cudaStream_t>(0x200);
  auto scope = h.pool.tag_scope(weights);
  void* a = h.pool.allocate_async(3 * kMiB, s1);
  void* keep = h.pool.allocate_async(4096, s1);
  h.pool.deallocate_async(a, 3 * kMiB, s1);
  void* b = h.pool.allocate_async(3 * kMiB, s2);
  EXPECT_NE(a, b);  // s1's work may still use a
  void* c = h.pool.allocate_async(3 * kMiB, s1);
  EXPECT_EQ(a, c);  // stream order on s1
  h.pool.deallocate_async(c, 3 * kMiB, s1);
  scope.end();
  h.pool.sleep(weights);  // proves s1's work done: its ranges become free for all
  h.pool.wake(weights);
  {
    auto again = h.pool.tag_scope(weights);
    void* d = h.pool.allocate_async(3 * kMiB, s2);
    EXPECT_EQ(d, a);
    h.pool.deallocate_async(d, 3 * kMiB, s2);
  }
  h.pool.deallocate_async(b, 3 * kMiB, s2);
  h.pool.deallocate_async(keep, 4096, s1);
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 0U);
}

TEST(SleepTags, TrimUnmapsTheFreeGranulesOfAwakeTags) {
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  void* small = h.pool.allocate_tagged(4096, weights);     // its run: granules under and ahead
  void* big = h.pool.allocate_tagged(32 * kMiB, weights);  // needs a run of its own
  h.pool.deallocate(big, 32 * kMiB);
  const std::size_t before = h.pool.tag_stats(weights).mapped_bytes;
  h.pool.trim();
  EXPECT_LT(h.pool.tag_stats(weights).mapped_bytes, before);
  EXPECT_GT(h.pool.tag_stats(weights).mapped_bytes, 0U);  // the run under `small` stays
  h.pool.deallocate(small, 4096);
  h.pool.trim();
  EXPECT_EQ(h.pool.tag_stats(weights).mapped_bytes, 0U);
}

// Reserved bytes count the tags' mapped granules, and so does their peak: the peak is never
// below what is reserved, before or after reset_peak() and across sleep and wake.
TEST(SleepTags, PeakReservedCountsTheTagsMappedGranules) {
  HostPool h;
  void* untagged = h.pool.allocate(8 * kMiB);
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  void* tagged = h.pool.allocate_tagged(32 * kMiB, weights);
  const auto check = [&](const char* when) {
    const DevicePoolStats s = h.pool.stats();
    EXPECT_GE(s.peak_bytes_reserved, s.bytes_reserved) << when;
    EXPECT_GE(s.bytes_reserved, s.sleep_tag_bytes_mapped) << when;
    return s;
  };
  const DevicePoolStats awake = check("awake");
  EXPECT_GE(awake.sleep_tag_bytes_mapped, 32 * kMiB);
  EXPECT_GE(awake.peak_bytes_reserved, awake.sleep_tag_bytes_mapped + 8 * kMiB);
  h.pool.reset_peak();
  const DevicePoolStats reset = check("after reset_peak");
  EXPECT_EQ(reset.peak_bytes_reserved, reset.bytes_reserved);
  EXPECT_EQ(reset.bytes_reserved, awake.bytes_reserved);
  h.pool.sleep(weights);
  const DevicePoolStats asleep = check("asleep");
  EXPECT_EQ(asleep.sleep_tag_bytes_mapped, 0U);
  EXPECT_EQ(asleep.bytes_reserved, awake.bytes_reserved - awake.sleep_tag_bytes_mapped);
  EXPECT_EQ(asleep.peak_bytes_reserved, awake.bytes_reserved);  // the peak before the sleep
  h.pool.reset_peak();
  h.pool.wake(weights);
  const DevicePoolStats woken = check("after wake");
  EXPECT_EQ(woken.peak_bytes_reserved, woken.bytes_reserved);
  EXPECT_GE(woken.sleep_tag_bytes_mapped, 32 * kMiB);
  // The peak a wake reached, read while asleep again: the tag's granules raised it.
  h.pool.sleep(weights);
  const DevicePoolStats again = check("asleep again");
  EXPECT_LT(again.bytes_reserved, woken.bytes_reserved);
  EXPECT_EQ(again.peak_bytes_reserved, woken.bytes_reserved);
  h.pool.wake(weights);
  h.pool.deallocate(tagged, 32 * kMiB);
  h.pool.deallocate(untagged, 8 * kMiB);
  h.pool.trim();
  check("trimmed");
  EXPECT_EQ(h.pool.stats().sleep_tag_bytes_mapped, 0U);

  // A tier's growth while a tag holds granules: the peak is their sum, read after both left.
  h.pool.reset_peak();
  void* tagged_again = h.pool.allocate_tagged(32 * kMiB, weights);
  void* grown = h.pool.allocate(64 * kMiB);
  const DevicePoolStats both = check("both held");
  EXPECT_GE(both.bytes_reserved, both.sleep_tag_bytes_mapped + 64 * kMiB);
  h.pool.deallocate(grown, 64 * kMiB);
  h.pool.deallocate(tagged_again, 32 * kMiB);
  h.pool.trim();
  const DevicePoolStats after = check("both gone");
  EXPECT_LT(after.bytes_reserved, both.bytes_reserved);
  EXPECT_EQ(after.peak_bytes_reserved, both.bytes_reserved);
}

// A pool with a tag, a stream and a graph pool to capture into inside the tag's scope.
struct CaptureInTag {
  HostPool h;
  SleepTag weights = h.pool.create_tag("weights", small_tag());
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(0x300);
  DevicePool::GraphPoolId graph = DevicePool::new_graph_pool();
  // A block a capture into `graph` inside the tag's scope took (the graph's output, say).
  void* captured_block(std::size_t bytes) {
    auto tag_scope = h.pool.tag_scope(weights);
    auto capture = h.pool.capture_into(graph, stream);
    return h.pool.allocate_async(bytes, stream);
  }
};

TEST(SleepTags, CaptureScopeInsideATagScopeTakesTaggedBlocksThatStayItsGraphPools) {
  CaptureInTag c;
  HostPool& h = c.h;
  const SleepTag weights = c.weights;
  const cudaStream_t stream = c.stream;
  void* block = nullptr;
  {
    auto tag_scope = h.pool.tag_scope(weights);
    auto capture = h.pool.capture_into(c.graph, stream);
    block = h.pool.allocate_async(3 * kMiB, stream);
    h.pool.deallocate_async(block, 3 * kMiB, stream);  // back to the graph pool
    void* next = h.pool.allocate_async(3 * kMiB, stream);
    EXPECT_EQ(next, block);  // reused inside the pool, as its untagged blocks are
    h.pool.deallocate_async(next, 3 * kMiB, stream);
  }
  EXPECT_TRUE(inside(h.pool.tag_stats(weights), block));
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 1U);  // the pool's: live in the tag
  EXPECT_EQ(h.pool.stats().graph_pool_bytes, 3 * kMiB);
  h.pool.sleep(weights);  // a graph pool's tagged blocks sleep and wake with their tag
  h.pool.wake(weights);
  h.pool.release_graph_pool(c.graph);
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 0U);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTags, ATaggedBlockReleasedThroughACaptureScopeStaysItsTags) {
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  const auto graph = DevicePool::new_graph_pool();
  void* block = h.pool.allocate_tagged(3 * kMiB, weights);
  {
    auto capture = h.pool.capture_into(graph);  // unrouted: its host picks the releases
    capture.deallocate(block, 3 * kMiB);
  }
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 1U);  // a free block of the graph pool
  EXPECT_EQ(h.pool.stats().graph_pool_bytes, 3 * kMiB);
  h.pool.release_graph_pool(graph);
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 0U);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTags, ATaggedBlockACaptureTookStaysItsGraphsWhenDeallocatedAfterTheCapture) {
  CaptureInTag c;
  HostPool& h = c.h;
  const SleepTag weights = c.weights;
  const cudaStream_t stream = c.stream;
  void* block = c.captured_block(3 * kMiB);  // the graph's output, say
  EXPECT_TRUE(inside(h.pool.tag_stats(weights), block));
  h.pool.deallocate_async(block, 3 * kMiB, stream);  // after the capture: the graph writes it
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 1U);
  void* other = h.pool.allocate_tagged(3 * kMiB, weights);
  EXPECT_NE(other, block);             // never handed out while the graph may write it
  h.pool.deallocate(block, 3 * kMiB);  // again: a double free, refused
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 1U);
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 2U);
  h.pool.release_graph_pool(c.graph);
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 1U);  // the pool's block is the tag's again
  h.pool.deallocate(other, 3 * kMiB);
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 0U);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 1U);
}

TEST(SleepTags, AnUnroutedCaptureScopeInsideATagScopeTakesTaggedBlocksForItsGraph) {
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  const auto graph = DevicePool::new_graph_pool();
  void* kept = nullptr;
  void* freed = nullptr;
  {
    auto tag_scope = h.pool.tag_scope(weights);
    auto capture = h.pool.capture_into(graph);  // as the PyTorch plug-in opens it
    kept = capture.allocate(2 * kMiB);
    freed = capture.allocate(5 * kMiB);
    capture.deallocate(freed, 5 * kMiB);
  }
  const SleepTagStats s = h.pool.tag_stats(weights);
  EXPECT_TRUE(inside(s, kept));
  EXPECT_TRUE(inside(s, freed));
  EXPECT_EQ(s.live_blocks, 2U);  // the freed one: a free block of the graph pool
  EXPECT_EQ(h.pool.stats().graph_pool_bytes, 7 * kMiB);
  fill(kept, 2 * kMiB, 23);
  h.pool.sleep(weights);
  h.pool.wake(weights);
  EXPECT_EQ(mismatches(kept, 2 * kMiB, 23), 0U);
  h.pool.release_graph_pool(graph);
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 2U);  // a block of the pool still live
  h.pool.deallocate(kept, 2 * kMiB);  // back to its pool, which gives everything up
  h.pool.trim();                      // the returns are drained
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 0U);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTags, RequestsOfOneScopeReuseTheirFreedTaggedBlocks) {
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  const auto pool_id = DevicePool::new_graph_pool();  // a torch.cuda.MemPool, say
  {
    auto tag_scope = h.pool.tag_scope(weights);
    auto scope = h.pool.capture_into(pool_id);
    for (int i = 0; i < 100; ++i) scope.deallocate(scope.allocate(1 * kMiB), 1 * kMiB);
  }
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 1U);  // one block, reused 99 times
  h.pool.release_graph_pool(pool_id);
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 0U);
}

TEST(SleepTags, AnUntaggedRequestIntoAGraphPoolNeverTakesATaggedBlock) {
  CaptureInTag c;
  HostPool& h = c.h;
  auto capture = h.pool.capture_into(c.graph, c.stream);
  {
    auto tag_scope = h.pool.tag_scope(c.weights);
    h.pool.deallocate_async(h.pool.allocate_async(3 * kMiB, c.stream), 3 * kMiB, c.stream);
  }
  void* untagged = h.pool.allocate_async(3 * kMiB, c.stream);
  EXPECT_FALSE(inside(h.pool.tag_stats(c.weights), untagged));
  h.pool.deallocate_async(untagged, 3 * kMiB, c.stream);
  capture.end();
  h.pool.release_graph_pool(c.graph);
  EXPECT_EQ(h.pool.tag_stats(c.weights).live_blocks, 0U);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTags, AGraphPoolOfTwoGraphsKeepsTaggedBlocksUntilItsLastRelease) {
  CaptureInTag c;
  HostPool& h = c.h;
  void* blocks[2] = {nullptr, nullptr};
  for (void*& block : blocks) {  // two graphs share the pool
    auto tag_scope = h.pool.tag_scope(c.weights);
    auto capture = h.pool.capture_into(c.graph, c.stream);
    block = h.pool.allocate_async(3 * kMiB, c.stream);
  }
  h.pool.deallocate_async(blocks[1], 3 * kMiB, c.stream);
  h.pool.release_graph_pool(c.graph);  // the first graph's use: the second may still run
  void* other = h.pool.allocate_tagged(3 * kMiB, c.weights);
  EXPECT_NE(other, blocks[1]);
  h.pool.deallocate(other, 3 * kMiB);
  EXPECT_EQ(h.pool.tag_stats(c.weights).live_blocks, 2U);  // both graphs' blocks
  h.pool.release_graph_pool(c.graph);
  EXPECT_EQ(h.pool.tag_stats(c.weights).live_blocks, 2U);  // one of the pool's is live
  h.pool.deallocate_async(blocks[0], 3 * kMiB, c.stream);  // the pool's last live block
  h.pool.trim();
  EXPECT_EQ(h.pool.tag_stats(c.weights).live_blocks, 0U);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTags, AGraphPoolReleasedWhileAnotherScopeIsOpenGivesItsBlocksBackWhenItEnds) {
  CaptureInTag c;
  HostPool& h = c.h;
  void* block = c.captured_block(3 * kMiB);
  h.pool.deallocate_async(block, 3 * kMiB, c.stream);
  {
    auto other = h.pool.capture_into(DevicePool::new_graph_pool());  // a MemPool in use, say
    h.pool.release_graph_pool(c.graph);
    EXPECT_EQ(h.pool.tag_stats(c.weights).live_blocks, 1U);  // no quiesce during a scope
  }
  EXPECT_EQ(h.pool.tag_stats(c.weights).live_blocks, 0U);  // the scope's end drained it
}

TEST(SleepTags, AGraphPoolReleasedWhileItsTagSleepsGivesItsBlocksBackAtWake) {
  CaptureInTag c;
  HostPool& h = c.h;
  void* block = c.captured_block(3 * kMiB);
  h.pool.deallocate_async(block, 3 * kMiB, c.stream);
  h.pool.sleep(c.weights);
  h.pool.release_graph_pool(c.graph);  // the graph is gone while its memory sleeps
  EXPECT_EQ(h.pool.tag_stats(c.weights).live_blocks, 1U);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
  h.pool.wake(c.weights);
  EXPECT_EQ(h.pool.tag_stats(c.weights).live_blocks, 0U);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTags, DestroyingThePoolGivesBackTheTaggedBlocksOfItsGraphPools) {
  auto physical = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  {
    DevicePool pool(physical, HostPool::options());
    const SleepTag weights = pool.create_tag("weights", small_tag());
    const auto graph = DevicePool::new_graph_pool();
    const auto stream = reinterpret_cast<cudaStream_t>(0x300);
    auto tag_scope = pool.tag_scope(weights);
    {
      auto capture = pool.capture_into(graph, stream);
      pool.deallocate_async(pool.allocate_async(3 * kMiB, stream), 3 * kMiB, stream);
    }
    tag_scope.end();
  }  // the graph pool never released
  EXPECT_EQ(physical->live_bytes(), 0U);
}

TEST(SleepTags, ADoubleFreeOfAGraphPoolsPendingTaggedBlockIsRefused) {
  CaptureInTag c;
  HostPool& h = c.h;
  void* block = c.captured_block(3 * kMiB);
  h.pool.deallocate_async(block, 3 * kMiB, c.stream);  // free in its graph pool
  void* other = nullptr;
  {
    auto scope = h.pool.capture_into(DevicePool::new_graph_pool());  // returns wait
    h.pool.release_graph_pool(c.graph);  // the pool retires: its block is pending
    h.pool.deallocate(block, 3 * kMiB);  // a double free
    EXPECT_EQ(h.pool.stats().invalid_deallocations, 1U);
    other = h.pool.allocate_tagged(3 * kMiB, c.weights);
    EXPECT_NE(other, block);  // the pending block is not the tag's yet
  }                           // the scope's end drains: the block back to its tag
  EXPECT_EQ(h.pool.tag_stats(c.weights).live_blocks, 1U);  // `other`
  h.pool.deallocate(other, 3 * kMiB);
  EXPECT_EQ(h.pool.tag_stats(c.weights).live_blocks, 0U);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 1U);
}

// Runs `f` when the calling thread's thread-locals are destroyed, after those the pool made
// for it (a thread cache): the pool then serves the thread without a cache.
struct AtThreadExit {
  std::function<void()> f;
  ~AtThreadExit() {
    if (f) f();
  }
};
thread_local AtThreadExit tl_at_thread_exit;

TEST(SleepTags, AnOutOfMemoryRetryWithoutACacheLeavesAPendingTaggedBlockPending) {
  HostPool h(64 * kMiB);
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  const auto graph = DevicePool::new_graph_pool();
  const auto stream = reinterpret_cast<cudaStream_t>(0x300);
  void* block = nullptr;
  {
    auto tag_scope = h.pool.tag_scope(weights);
    auto capture = h.pool.capture_into(graph, stream);
    block = h.pool.allocate_async(3 * kMiB, stream);
  }
  h.pool.release_graph_pool(graph);
  h.pool.deallocate_async(block, 3 * kMiB, stream);  // the pool retires: pending, not drained
  std::atomic<int> outcome{0};                       // 1: refused as it should be
  std::thread t([&] {
    tl_at_thread_exit.f = [&] {
      try {
        h.pool.deallocate(h.pool.allocate(200 * kMiB), 200 * kMiB);
        outcome = 2;
      } catch (const OutOfMemory&) {
        outcome = 1;
      }
    };
    h.pool.deallocate(h.pool.allocate(4096), 4096);  // the pool makes this thread's cache
  });
  for (int i = 0; i < 400 && outcome == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (outcome == 0) {
    ADD_FAILURE() << "an out-of-memory retry without a cache hung";
    std::_Exit(1);  // a hung thread holds the pool's lock: nothing can be torn down
  }
  t.join();
  EXPECT_EQ(outcome.load(), 1);
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 1U);  // still pending
  h.pool.trim();
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 0U);
}

TEST(SleepTagsThreads, ConcurrentRequestsAndReleasesInOneTag) {
  HostPool h;
  const SleepTag weights = h.pool.create_tag("weights", small_tag());
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto scope = h.pool.tag_scope(weights);
      std::vector<std::pair<Block, std::uint32_t>> mine;
      for (int i = 0; i < 200; ++i) {
        const std::size_t bytes = kMixedSizes[(i + t) % kMixedSizes.size()] % (2 * kMiB) + 256;
        const auto seed = std::uint32_t(t * 1000 + i);
        mine.push_back({{h.pool.allocate(bytes), bytes}, seed});
        fill(mine.back().first.pointer, bytes, seed);
        if (i % 3 == 0) {
          const auto middle = mine.begin() + std::ptrdiff_t(mine.size() / 2);
          if (mismatches(middle->first.pointer, middle->first.bytes, middle->second) != 0) ++bad;
          h.pool.deallocate(middle->first.pointer, middle->first.bytes);
          mine.erase(middle);
        }
      }
      for (const auto& [b, seed] : mine) {
        if (mismatches(b.pointer, b.bytes, seed) != 0) ++bad;
        h.pool.deallocate(b.pointer, b.bytes);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(h.pool.tag_stats(weights).live_blocks, 0U);
  EXPECT_EQ(h.pool.stats().invalid_deallocations, 0U);
}

// ---- Gpu: CUDA virtual memory on device 0 -----------------------------------------------
#ifdef VRAM_HAVE_TEST_KERNELS

DevicePool::Options device_virtual() {
  DevicePool::Options o;
  o.large_tier.memory = LargeTierMemory::virtual_memory;
  return o;
}

std::size_t device_free_bytes() {
  std::size_t free_bytes = 0;
  std::size_t total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  return free_bytes;
}

// Word-by-word check of blocks filled with pattern + index on the device.
unsigned long long device_mismatches(const std::vector<Block>& blocks, std::uint32_t pattern,
                                     cudaStream_t stream) {
  unsigned long long* counter = nullptr;
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&counter), sizeof *counter), cudaSuccess);
  EXPECT_EQ(cudaMemsetAsync(counter, 0, sizeof *counter, stream), cudaSuccess);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    launch_count_mismatches(blocks[i].pointer, blocks[i].bytes / 4,
                            pattern + static_cast<std::uint32_t>(i), counter, stream);
  }
  unsigned long long host = 0;
  EXPECT_EQ(cudaMemcpyAsync(&host, counter, sizeof host, cudaMemcpyDeviceToHost, stream),
            cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaFree(counter), cudaSuccess);
  return host;
}

void device_fill(const std::vector<Block>& blocks, std::uint32_t pattern, cudaStream_t stream) {
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    launch_fill(blocks[i].pointer, blocks[i].bytes / 4, pattern + static_cast<std::uint32_t>(i),
                stream);
  }
}

TEST(SleepTagsGpu, ContentsWordByWordAtTheSameAddressesAndTheMemoryIsFreeWhileAsleep) {
  VRAM_GPU_TEST_OR_SKIP();
  cuda::Stream stream;
  DevicePool pool(0, device_virtual());
  const SleepTag weights = pool.create_tag("weights");
  std::vector<Block> blocks;
  {
    auto scope = pool.tag_scope(weights);
    for (int round = 0; round < 8; ++round) {
      for (std::size_t bytes : kMixedSizes) {
        blocks.push_back({pool.allocate_async(bytes, stream.get()), bytes / 4 * 4});
      }
    }
    for (int i = 0; i < 16; ++i) blocks.push_back({pool.allocate(64 * kMiB), 64 * kMiB});
  }
  device_fill(blocks, 0xA0000000u, stream.get());
  ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
  const SleepTagStats awake = pool.tag_stats(weights);
  const std::size_t free_awake = device_free_bytes();
  pool.sleep(weights, stream.get());
  const std::size_t free_asleep = device_free_bytes();
  EXPECT_GE(free_asleep, free_awake + awake.mapped_bytes / 100 * 99)
      << "cudaMemGetInfo must see the tag's mapped bytes free while it sleeps";
  pool.wake(weights, stream.get());
  EXPECT_EQ(pool.tag_stats(weights).base, awake.base);
  EXPECT_EQ(device_mismatches(blocks, 0xA0000000u, stream.get()), 0U);
  for (const Block& b : blocks) pool.deallocate_async(b.pointer, b.bytes, stream.get());
  EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTagsGpu, SleepIsOrderedAfterTheWorkQueuedOnItsStream) {
  VRAM_GPU_TEST_OR_SKIP();
  cuda::Stream stream;
  DevicePool pool(0, device_virtual());
  const SleepTag weights = pool.create_tag("weights");
  std::vector<Block> blocks = {{pool.allocate_tagged(32 * kMiB, weights), 32 * kMiB}};
  // The fill runs after a 50 ms spin: a sleep that did not wait for it would copy zeros
  // (or unmap under the kernel).
  launch_spin_then_fill(blocks[0].pointer, blocks[0].bytes / 4, 0xC0FFEE00u, 50'000'000,
                        stream.get());
  pool.sleep(weights, stream.get());
  pool.wake(weights, stream.get());
  EXPECT_EQ(device_mismatches(blocks, 0xC0FFEE00u, stream.get()), 0U);
  // Without a stream: a device synchronize first.
  launch_spin_then_fill(blocks[0].pointer, blocks[0].bytes / 4, 0xBEEF0000u, 50'000'000,
                        stream.get());
  pool.sleep(weights);
  pool.wake(weights);
  EXPECT_EQ(device_mismatches(blocks, 0xBEEF0000u, stream.get()), 0U);
  pool.deallocate(blocks[0].pointer, blocks[0].bytes);
}

// The witness of a sealed batch proves its own copies and comes without waiting for the
// work queued behind them on the same stream (a later batch of the same sleep).
TEST(SleepTagsGpu, ASealedBatchsWitnessComesBeforeTheWorkQueuedAfterIt) {
  VRAM_GPU_TEST_OR_SKIP();
  cuda::Stream stream;
  std::optional<cuda::Stream> own;
  void* device = nullptr;
  void* busy = nullptr;
  void* host = nullptr;
  ASSERT_EQ(cudaMalloc(&device, kMiB), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&busy, kMiB), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&host, 2 * kMiB), cudaSuccess);
  launch_fill(device, kMiB / 4, 0x5EA1ED00u, stream.get());
  const auto first = SleepCopier::for_device(0, stream.get(), own);
  first->to_host(host, device, kMiB);
  first->seal();
  launch_spin_then_fill(busy, kMiB / 4, 1u, 500'000'000, stream.get());  // 0.5 s
  const auto second = SleepCopier::for_device(0, first->stream(), own);
  EXPECT_EQ(second->stream(), stream.get());
  second->to_host(static_cast<char*>(host) + kMiB, busy, kMiB);
  const CopiesCompleted proof = first->wait();
  EXPECT_NO_THROW(first->check(proof));
  EXPECT_EQ(cudaStreamQuery(stream.get()), cudaErrorNotReady) << "the spin should still run";
  EXPECT_NO_THROW(second->check(second->wait()));
  EXPECT_EQ(cudaStreamQuery(stream.get()), cudaSuccess);
  const auto* words = static_cast<const std::uint32_t*>(host);
  EXPECT_EQ(words[0], 0x5EA1ED00u);
  EXPECT_EQ(words[kMiB / 4 + 1], 1u);
  EXPECT_EQ(cudaFree(device), cudaSuccess);
  EXPECT_EQ(cudaFree(busy), cudaSuccess);
  EXPECT_EQ(cudaFreeHost(host), cudaSuccess);
}

// Runs of 4 MiB: a sleep releases run by run while later runs still copy; the work queued
// before it on its stream (a spin, then the fill) ends first, and every word comes back.
TEST(SleepTagsGpu, SleepInRunsKeepsEveryWordAndFreesTheMemory) {
  VRAM_GPU_TEST_OR_SKIP();
  cuda::Stream stream;
  DevicePool::Options options = device_virtual();
  options.large_tier.virtual_run_bytes = 4 * kMiB;
  DevicePool pool(0, options);
  const SleepTag weights = pool.create_tag("weights");
  std::vector<Block> blocks;
  {
    auto scope = pool.tag_scope(weights);
    for (int round = 0; round < 4; ++round) {
      for (std::size_t bytes : kMixedSizes) {
        blocks.push_back({pool.allocate_async(bytes, stream.get()), bytes / 4 * 4});
      }
    }
    for (int i = 0; i < 8; ++i) blocks.push_back({pool.allocate(16 * kMiB), 16 * kMiB});
  }
  for (int cycle = 0; cycle < 3; ++cycle) {
    const auto pattern = 0xD0000000u + static_cast<std::uint32_t>(cycle) * 0x1000u;
    launch_spin_then_fill(blocks[0].pointer, blocks[0].bytes / 4, pattern, 50'000'000,
                          stream.get());
    std::vector<Block> rest(blocks.begin() + 1, blocks.end());
    device_fill(rest, pattern + 1, stream.get());  // block i gets pattern + i
    const SleepTagStats awake = pool.tag_stats(weights);
    ASSERT_GT(awake.mapped_bytes, 16 * 4 * kMiB);
    const std::size_t free_awake = device_free_bytes();
    pool.sleep(weights, stream.get());
    EXPECT_GE(device_free_bytes(), free_awake + awake.mapped_bytes / 100 * 99);
    pool.wake(weights, stream.get());
    EXPECT_EQ(device_mismatches(blocks, pattern, stream.get()), 0U) << "cycle " << cycle;
  }
  for (const Block& b : blocks) pool.deallocate_async(b.pointer, b.bytes, stream.get());
  EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTagsGpu, AGraphCapturedBeforeSleepReplaysAfterWake) {
  VRAM_GPU_TEST_OR_SKIP();
  cuda::Stream stream;
  DevicePool pool(0, device_virtual());
  const SleepTag weights = pool.create_tag("weights");
  const SleepTag kv = pool.create_tag("kv", {.discardable = true});
  std::vector<Block> input = {{pool.allocate_tagged(8 * kMiB, weights), 8 * kMiB}};
  std::vector<Block> output = {{pool.allocate_tagged(6 * kMiB, kv), 6 * kMiB}};
  auto* counter = static_cast<unsigned long long*>(pool.allocate_tagged(256, weights));
  device_fill(input, 0x11110000u, stream.get());
  ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal), cudaSuccess);
  launch_count_mismatches(input[0].pointer, input[0].bytes / 4, 0x11110000u, counter, stream.get());
  launch_fill(output[0].pointer, output[0].bytes / 4, 0x22220000u, stream.get());
  ASSERT_EQ(cudaStreamEndCapture(stream.get(), &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int cycle = 0; cycle < 3; ++cycle) {
    pool.sleep({weights, kv}, stream.get());
    pool.wake(std::vector<SleepTag>{weights, kv}, stream.get());
    ASSERT_EQ(cudaMemsetAsync(counter, 0, sizeof *counter, stream.get()), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream.get()), cudaSuccess);
    unsigned long long host = 1;
    ASSERT_EQ(cudaMemcpyAsync(&host, counter, sizeof host, cudaMemcpyDeviceToHost, stream.get()),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
    EXPECT_EQ(host, 0U) << "the replay read the woken weights wrong, cycle " << cycle;
    EXPECT_EQ(device_mismatches(output, 0x22220000u, stream.get()), 0U) << cycle;
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  pool.deallocate(input[0].pointer, input[0].bytes);
  pool.deallocate(output[0].pointer, output[0].bytes);
  pool.deallocate(counter, 256);
}

TEST(SleepTagsGpu, TwentyCyclesGrowNeitherDeviceNorPinnedMemory) {
  VRAM_GPU_TEST_OR_SKIP();
  cuda::Stream stream;
  auto pinned = std::make_shared<TestUpstream>(std::make_shared<PinnedHostUpstream>());
  DevicePool pool(0, device_virtual());
  const SleepTag weights = pool.create_tag("weights", {.backup = pinned});
  const SleepTag kv = pool.create_tag("kv", {.discardable = true});
  std::vector<Block> blocks;
  for (int i = 0; i < 32; ++i) {
    blocks.push_back(
        {pool.allocate_tagged(kMixedSizes[i % kMixedSizes.size()] / 4 * 4 + 4096, weights),
         kMixedSizes[i % kMixedSizes.size()] / 4 * 4 + 4096});
  }
  void* cache = pool.allocate_tagged(256 * kMiB, kv);
  device_fill(blocks, 0x5EED0000u, stream.get());
  std::size_t free_after_first = 0;
  std::size_t pinned_after_first = 0;
  for (int cycle = 0; cycle < 20; ++cycle) {
    pool.sleep({weights, kv}, stream.get());
    pool.wake(std::vector<SleepTag>{weights, kv}, stream.get());
    if (cycle == 0) {
      free_after_first = device_free_bytes();
      pinned_after_first = pinned->live_bytes();
    }
  }
  EXPECT_GE(device_free_bytes() + (std::size_t{4} << 20), free_after_first);
  EXPECT_EQ(pinned->live_bytes(), pinned_after_first);
  EXPECT_EQ(device_mismatches(blocks, 0x5EED0000u, stream.get()), 0U);
  for (const Block& b : blocks) pool.deallocate(b.pointer, b.bytes);
  pool.deallocate(cache, 256 * kMiB);
}

TEST(SleepTagsGpu, ACaptureScopeInsideATagScopeKeepsTheGraphValidAcrossSleep) {
  VRAM_GPU_TEST_OR_SKIP();
  cuda::Stream stream;
  DevicePool pool(0, device_virtual());
  const SleepTag weights = pool.create_tag("weights");
  const auto id = DevicePool::new_graph_pool();
  std::vector<Block> out;
  cudaGraph_t graph = nullptr;
  {
    auto tag_scope = pool.tag_scope(weights);
    auto capture = pool.capture_into(id, stream.get());
    ASSERT_EQ(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal), cudaSuccess);
    void* scratch = pool.allocate_async(4 * kMiB, stream.get());
    launch_fill(scratch, kMiB, 0x77770000u, stream.get());
    out.push_back({pool.allocate_async(2 * kMiB, stream.get()), 2 * kMiB});
    launch_fill(out[0].pointer, out[0].bytes / 4, 0x33330000u, stream.get());
    pool.deallocate_async(scratch, 4 * kMiB, stream.get());
    ASSERT_EQ(cudaStreamEndCapture(stream.get(), &graph), cudaSuccess);
  }
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  pool.sleep(weights, stream.get());
  pool.wake(weights, stream.get());
  ASSERT_EQ(cudaGraphLaunch(exec, stream.get()), cudaSuccess);
  EXPECT_EQ(device_mismatches(out, 0x33330000u, stream.get()), 0U);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  pool.release_graph_pool(id);
  // The graph pool retires at its last block's free; its blocks rejoin the tag at the next
  // moment that may synchronize the device (here trim), not inside the deallocation.
  pool.deallocate(out[0].pointer, out[0].bytes);
  EXPECT_EQ(pool.tag_stats(weights).live_blocks, 2U);
  pool.trim();
  EXPECT_EQ(pool.tag_stats(weights).live_blocks, 0U);
  EXPECT_EQ(pool.stats().graph_pool_bytes, 0U);
}

// `count` blocks of `bytes` taken under a scope of `tag`, filled from `seed` on `stream`.
std::vector<Block> filled_tagged_blocks(DevicePool& pool, SleepTag tag, int count,
                                        std::size_t bytes, std::uint32_t seed,
                                        cudaStream_t stream) {
  std::vector<Block> blocks;
  {
    auto scope = pool.tag_scope(tag);
    for (int i = 0; i < count; ++i) blocks.push_back({pool.allocate(bytes), bytes});
  }
  device_fill(blocks, seed, stream);
  return blocks;
}

// The free bytes of device 0 as a second process sees them: vram_free_memory_probe (built
// beside this executable), a child process of its own (no CUDA after a plain fork) stopped
// after 60 s. Empty, with the test failed, when the probe is missing or cannot say.
std::optional<std::size_t> free_bytes_seen_by_another_process() {
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  const std::string probe = (self.parent_path() / "vram_free_memory_probe").string();
  if (error || ::access(probe.c_str(), X_OK) != 0) {
    ADD_FAILURE() << "no executable " << probe
                  << ": build the vram_free_memory_probe target beside vram_tests";
    return std::nullopt;
  }
  const bench::ChildRun run = bench::run_child({probe, "0"}, 60);
  std::string out;
  for (const std::string& line : run.lines) out += line + "\n";
  if (!run.ran || run.exit_code != 0 || run.lines.size() != 1) {
    ADD_FAILURE() << probe << " failed ("
                  << (run.ran ? "exit " + std::to_string(run.exit_code) : run.error)
                  << "), output: " << out;
    return std::nullopt;
  }
  try {
    return static_cast<std::size_t>(std::stoull(run.lines.front()));
  } catch (...) {
    ADD_FAILURE() << probe << " printed no number: " << out;
    return std::nullopt;
  }
}

TEST(SleepTagsGpu, FreeMemorySeenFromASecondProcessFollowsSleepAndWake) {
  VRAM_GPU_TEST_OR_SKIP();
  cuda::Stream stream;
  DevicePool pool(0, device_virtual());
  const SleepTag weights = pool.create_tag("weights");
  const std::vector<Block> blocks =
      filled_tagged_blocks(pool, weights, 32, 32 * kMiB, 0xB0000000u, stream.get());
  ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
  const SleepTagStats awake = pool.tag_stats(weights);
  ASSERT_GE(awake.mapped_bytes, 32 * 32 * kMiB);
  const std::optional<std::size_t> free_awake = free_bytes_seen_by_another_process();
  ASSERT_TRUE(free_awake.has_value());

  pool.sleep(weights, stream.get());
  const std::optional<std::size_t> free_asleep = free_bytes_seen_by_another_process();
  ASSERT_TRUE(free_asleep.has_value());
  EXPECT_GE(*free_asleep, *free_awake + awake.mapped_bytes / 100 * 99)
      << "another process must see at least 99% of the tag's mapped bytes free while it sleeps";

  pool.wake(weights, stream.get());
  const SleepTagStats woken = pool.tag_stats(weights);
  const std::optional<std::size_t> free_woken = free_bytes_seen_by_another_process();
  ASSERT_TRUE(free_woken.has_value());
  // Every byte under live blocks is mapped again (wake skips the free granules mapped ahead).
  ASSERT_LE(woken.mapped_bytes, awake.mapped_bytes);
  ASSERT_GE(woken.mapped_bytes, 32 * 32 * kMiB);
  constexpr std::size_t kTolerance = 64 * kMiB;  // other tenants of the device, the driver
  EXPECT_GE(*free_asleep, *free_woken + woken.mapped_bytes / 100 * 99);
  EXPECT_LE(*free_woken, *free_awake + (awake.mapped_bytes - woken.mapped_bytes) + kTolerance);
  EXPECT_EQ(device_mismatches(blocks, 0xB0000000u, stream.get()), 0U);
  for (const Block& b : blocks) pool.deallocate(b.pointer, b.bytes);
  EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
}

TEST(SleepTagsGpu, SleepThatDiscardsFreesTheMemoryCopiesNothingAndWakeGivesWritableMemory) {
  VRAM_GPU_TEST_OR_SKIP();
  cuda::Stream stream;
  DevicePool pool(0, device_virtual());
  const SleepTag weights = pool.create_tag("weights");
  const std::vector<Block> blocks =
      filled_tagged_blocks(pool, weights, 8, 64 * kMiB, 0xC0000000u, stream.get());
  ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
  const SleepTagStats awake = pool.tag_stats(weights);
  const std::size_t free_awake = device_free_bytes();
  pool.sleep(weights, stream.get(), SleepContents::discard);
  const SleepTagStats asleep = pool.tag_stats(weights);
  EXPECT_EQ(asleep.state, SleepState::asleep);
  EXPECT_EQ(asleep.backed_up_bytes, 0U);
  EXPECT_EQ(asleep.copies, 0U);
  EXPECT_EQ(asleep.backup_bytes, 0U);  // nothing was ever pinned for it
  EXPECT_GE(device_free_bytes(), free_awake + awake.mapped_bytes / 100 * 99);
  pool.wake(weights, stream.get());
  EXPECT_EQ(pool.tag_stats(weights).base, awake.base);
  device_fill(blocks, 0xD0000000u, stream.get());  // the reload
  EXPECT_EQ(device_mismatches(blocks, 0xD0000000u, stream.get()), 0U);
  pool.sleep(weights, stream.get());  // a later sleep keeps the reloaded contents
  pool.wake(weights, stream.get());
  EXPECT_EQ(device_mismatches(blocks, 0xD0000000u, stream.get()), 0U);
  for (const Block& b : blocks) pool.deallocate_async(b.pointer, b.bytes, stream.get());
  EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
}

#endif  // VRAM_HAVE_TEST_KERNELS

}  // namespace
}  // namespace vram::testing
