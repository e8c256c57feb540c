// DevicePoolOptions::observer (vram/reserve_observer.hpp): every unit of memory the pool
// reserves is told once, and told again before it goes back, with the same span, while the
// memory is still valid; the figures match the pool's own counters; the pool's choices
// (upstream(), virtual memory) are those it makes without an observer. Host-only: the
// host upstream, and the host emulation of virtual memory.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "vram/device_pool.hpp"
#include "vram/reserve_observer.hpp"
#include "vram/sleep_tag.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

// Records the spans reserved and not yet given back, and every misuse of the contract.
class Recorder final : public ReserveObserver {
 public:
  void reserved(const ReservedSpan& span) noexcept override {
    std::lock_guard lock(mutex_);
    ++reserved_count;
    if (span.virtual_memory) ++virtual_reserved;
    // A new span never overlaps one still held.
    auto next = held_.lower_bound(span.address);
    if (next != held_.end() && next->first < span.address + span.bytes) ++overlaps;
    if (next != held_.begin() &&
        std::prev(next)->first + std::prev(next)->second.bytes > span.address) {
      ++overlaps;
    }
    held_[span.address] = span;
  }
  void giving_back(const ReservedSpan& span) noexcept override {
    std::lock_guard lock(mutex_);
    ++given_back_count;
    auto found = held_.find(span.address);
    if (found == held_.end() || found->second.bytes != span.bytes ||
        found->second.virtual_memory != span.virtual_memory) {
      ++unknown_give_backs;
      return;
    }
    // Still valid memory: writing all of it must not fault (and ASan would catch a freed one).
    std::memset(reinterpret_cast<void*>(span.address), 0x5a, span.bytes);
    held_.erase(found);
  }
  std::size_t held_bytes() const {
    std::lock_guard lock(mutex_);
    std::size_t total = 0;
    for (const auto& [address, span] : held_) total += span.bytes;
    return total;
  }
  std::size_t held_count() const {
    std::lock_guard lock(mutex_);
    return held_.size();
  }

  std::uint64_t reserved_count = 0;
  std::uint64_t virtual_reserved = 0;
  std::uint64_t given_back_count = 0;
  std::uint64_t unknown_give_backs = 0;
  std::uint64_t overlaps = 0;

 private:
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, ReservedSpan> held_;
};

DevicePool::Options observed(std::shared_ptr<Recorder> recorder, LargeTierMemory memory) {
  DevicePool::Options options;
  options.observer = std::move(recorder);
  options.large_tier.memory = memory;
  options.large_tier.virtual_reservation_bytes = 1_GiB;
  return options;
}

// Requests of every kind: small classes, large blocks in shared and own segments.
void churn(DevicePool& pool) {
  const std::vector<std::size_t> sizes = {300, 4096, 100000, 600 * 1024, 3_MiB, 9_MiB, 40_MiB};
  std::vector<std::pair<void*, std::size_t>> live;
  for (int round = 0; round < 3; ++round) {
    for (std::size_t bytes : sizes) live.emplace_back(pool.allocate(bytes), bytes);
    for (std::size_t i = 0; i < live.size(); i += 2) pool.deallocate(live[i].first, live[i].second);
    std::erase_if(live, [&](const auto& b) { return (&b - live.data()) % 2 == 0; });
  }
  for (const auto& [block, bytes] : live) pool.deallocate(block, bytes);
}

void expect_growth_told_then_trim_gives_all_back(LargeTierMemory memory) {
  auto recorder = std::make_shared<Recorder>();
  auto upstream = std::make_shared<HostMemoryUpstream>();
  DevicePool pool(upstream, observed(recorder, memory));
  EXPECT_EQ(&pool.upstream(), upstream.get());  // the upstream given, not a wrapper
  churn(pool);
  void* kept = pool.allocate(5_MiB);
  DevicePoolStats stats = pool.stats();
  EXPECT_GT(recorder->reserved_count, 0u);
  EXPECT_EQ(recorder->reserved_count, stats.upstream_allocations);
  EXPECT_EQ(recorder->given_back_count, stats.upstream_frees);
  EXPECT_EQ(recorder->held_bytes(), stats.bytes_reserved);
  EXPECT_EQ(recorder->overlaps, 0u);
  pool.trim(0);
  stats = pool.stats();
  EXPECT_EQ(recorder->given_back_count, stats.upstream_frees);
  EXPECT_EQ(recorder->held_bytes(), stats.bytes_reserved);
  EXPECT_GT(recorder->held_count(), 0u);  // the span under `kept` stays
  pool.deallocate(kept, 5_MiB);
  pool.trim(0);
  EXPECT_EQ(recorder->held_bytes(), pool.stats().bytes_reserved);
  EXPECT_EQ(recorder->unknown_give_backs, 0u);
}

TEST(ReserveObserver, SegmentsAreToldOnGrowthAndBeforeTheyGoBack) {
  expect_growth_told_then_trim_gives_all_back(LargeTierMemory::segments);
}

TEST(ReserveObserver, MappedRunsAreToldOnGrowthAndBeforeTheyGoBack) {
  auto recorder = std::make_shared<Recorder>();
  {
    DevicePool pool(std::make_shared<HostMemoryUpstream>(),
                    observed(recorder, LargeTierMemory::virtual_memory));
    ASSERT_TRUE(pool.uses_virtual_memory());
    void* block = pool.allocate(9_MiB);
    EXPECT_GT(recorder->virtual_reserved, 0u);
    pool.deallocate(block, 9_MiB);
  }
  expect_growth_told_then_trim_gives_all_back(LargeTierMemory::virtual_memory);
}

TEST(ReserveObserver, DestructionGivesBackEverySpanItWasToldOf) {
  for (LargeTierMemory memory : {LargeTierMemory::segments, LargeTierMemory::virtual_memory}) {
    auto recorder = std::make_shared<Recorder>();
    {
      DevicePool pool(std::make_shared<HostMemoryUpstream>(), observed(recorder, memory));
      churn(pool);
      void* block = pool.allocate(7_MiB);
      pool.deallocate(block, 7_MiB);
      EXPECT_GT(recorder->held_count(), 0u);
    }
    EXPECT_EQ(recorder->held_count(), 0u);
    EXPECT_EQ(recorder->reserved_count, recorder->given_back_count);
    EXPECT_EQ(recorder->unknown_give_backs, 0u);
    EXPECT_EQ(recorder->overlaps, 0u);
  }
}

TEST(ReserveObserver, SleepTagMapsAreToldAndSleepGivesThemBackFirst) {
  auto recorder = std::make_shared<Recorder>();
  DevicePool pool(std::make_shared<HostMemoryUpstream>(),
                  observed(recorder, LargeTierMemory::virtual_memory));
  const SleepTag tag = pool.create_tag(
      "weights", {.discardable = true, .reservation_bytes = 256_MiB, .map_ahead_bytes = 0});
  void* block = pool.allocate_tagged(6_MiB, tag);
  const std::size_t held = recorder->held_bytes();
  EXPECT_GE(held, 6_MiB);
  pool.sleep(tag, nullptr, SleepContents::discard);
  EXPECT_LT(recorder->held_bytes(), held);  // the tag's runs went back, told first
  pool.wake(tag);
  EXPECT_EQ(recorder->held_bytes(), held);
  pool.deallocate(block, 6_MiB);
  EXPECT_EQ(recorder->unknown_give_backs, 0u);
  EXPECT_EQ(recorder->overlaps, 0u);
}

TEST(ReserveObserver, WithoutAnObserverNothingChanges) {
  auto upstream = std::make_shared<HostMemoryUpstream>();
  DevicePool pool(upstream);
  EXPECT_EQ(&pool.upstream(), upstream.get());
  EXPECT_FALSE(pool.options().observer);
}

}  // namespace
}  // namespace vram::testing
