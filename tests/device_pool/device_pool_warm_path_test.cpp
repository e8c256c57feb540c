// DevicePool's warm paths (claim_warm, tl_last, per-class bin limits, block_bytes_of,
// plain_calls), SegmentTier's TierMutex and the `mapped` flag of fit(): accounting stays
// exact across option sweeps, replaced pools, racing trims and adopted caches.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "test_upstreams.hpp"
#include "vram/device_pool.hpp"
#include "vram/size_classes.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

struct SweepCase {
  std::size_t small_max;
  std::size_t cache_blocks;
  std::size_t cache_max_block;
  bool validate;
  bool track;
};

// Sizes worth asking for under `small_max`: 1, every class boundary (and one past it) up
// to small_max, small_max itself and the first large size.
std::vector<std::size_t> sizes_for(std::size_t small_max) {
  std::vector<std::size_t> sizes{1, 255, 256, 257};
  for (std::size_t index = 0;; ++index) {
    const std::size_t bytes = SizeClasses::bytes_of(index);
    if (bytes > small_max) break;
    sizes.push_back(bytes);
    if (bytes + 1 <= small_max) sizes.push_back(bytes + 1);
  }
  sizes.push_back(small_max);
  sizes.push_back(small_max + 1);
  return sizes;
}

// Every option value the bins depend on (thread_cache.blocks 0, 1, 16 and above 16;
// thread_cache.max_block_bytes 0, 1, small, and above small_max; small_max 256 B up to
// 2 MiB and above, clamped), with and without validation and peak tracking: after every
// acquire/release pattern the accounting is exact, no thread cache holds more than its
// per-class depth allows, and trim(0) leaves nothing behind.
TEST(WarmPathCaches, OptionSweepKeepsAccountingExactForEverySmallSize) {
  std::vector<SweepCase> cases;
  for (std::size_t small_max : {std::size_t{256}, std::size_t{300}, std::size_t{1_MiB},
                                std::size_t{2_MiB}, std::size_t{4_MiB}}) {
    for (std::size_t blocks : {0, 1, 16, 17}) {
      for (std::size_t max_block :
           {std::size_t{0}, std::size_t{1}, std::size_t{4096}, std::size_t{1} << 40}) {
        for (int flags : {0, 1, 2}) {  // plain; validate_deallocations; track_peak_in_use
          cases.push_back({small_max, blocks, max_block, (flags & 1) != 0, (flags & 2) != 0});
        }
      }
    }
  }
  for (const SweepCase& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "small_max " << c.small_max << " blocks " << c.cache_blocks << " max_block "
                 << c.cache_max_block << " validate " << c.validate << " track " << c.track);
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    DevicePool::Options options;
    options.small_tier.max_block_bytes = c.small_max;
    options.thread_cache.blocks = c.cache_blocks;
    options.thread_cache.max_block_bytes = c.cache_max_block;
    options.thread_cache.max_bytes = 64_MiB;  // the depth, not the byte bound, limits here
    options.validate_deallocations = c.validate;
    options.track_peak_in_use = c.track;
    DevicePool pool(upstream, options);
    const std::size_t small_max = pool.options().small_tier.max_block_bytes;
    const std::size_t depth = std::min<std::size_t>(c.cache_blocks, 16);
    const std::size_t kept_max =
        c.cache_blocks == 0 || c.cache_max_block == 0 ? 0 : std::min(c.cache_max_block, small_max);
    for (std::size_t bytes : sizes_for(small_max)) {
      SCOPED_TRACE(::testing::Message() << "bytes " << bytes);
      constexpr int kBlocks = 20;  // more than any bin holds
      for (int round = 0; round < 2; ++round) {
        std::vector<void*> blocks;
        for (int i = 0; i < kBlocks; ++i) {
          void* block = pool.allocate(bytes);
          std::memset(block, 0x5a, std::min<std::size_t>(bytes, 4096));
          blocks.push_back(block);
        }
        auto s = pool.stats();
        ASSERT_EQ(s.bytes_in_use, kBlocks * pool.block_bytes(bytes));
        for (void* block : blocks) pool.deallocate(block, bytes);
        s = pool.stats();
        ASSERT_EQ(s.bytes_in_use, 0U);
        ASSERT_EQ(s.acquires, s.deallocations);
        ASSERT_EQ(s.invalid_deallocations, 0U);
        const bool kept = bytes <= small_max && kept_max != 0 &&
                          SizeClasses::index_for(bytes) <= SizeClasses::index_for(kept_max);
        ASSERT_EQ(s.bytes_cached_in_threads, kept ? depth * pool.block_bytes(bytes) : 0U);
        if (c.track) {
          ASSERT_EQ(s.peak_bytes_in_use, kBlocks * pool.block_bytes(bytes));
          pool.reset_peak();
        }
      }
      pool.trim(0);
      const auto s = pool.stats();
      ASSERT_EQ(s.bytes_cached_in_threads, 0U);
      ASSERT_EQ(s.bytes_reserved, 0U);
      ASSERT_EQ(upstream->live_bytes(), 0U);
    }
    EXPECT_EQ(upstream->bad_frees(), 0U);
  }
}

// A thread that alternates between two pools (tl_last switches on every call), and a
// pool destroyed and replaced (most likely at the same address) while this thread's
// tl_last still names the old one: every call lands in the right pool and the counts of
// both stay exact.
TEST(WarmPathCaches, AlternatingPoolsAndReplacedPoolsKeepTheirOwnCaches) {
  DevicePool::Options options;
  options.validate_deallocations = false;
  auto upstream_a = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool a(upstream_a, options);
  for (int round = 0; round < 50; ++round) {
    auto upstream_b = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    std::optional<DevicePool> b(std::in_place, upstream_b, options);
    std::vector<void*> from_a;
    std::vector<void*> from_b;
    for (int i = 0; i < 12; ++i) {
      from_a.push_back(a.allocate(4096));
      from_b.push_back(b->allocate(4096));
    }
    for (int i = 0; i < 12; ++i) {
      a.deallocate(from_a[i], 4096);
      b->deallocate(from_b[i], 4096);
    }
    for (int i = 0; i < 8; ++i) {  // warm: from each pool's own cache
      void* pa = a.allocate(4096);
      void* pb = b->allocate(4096);
      EXPECT_TRUE(std::find(from_a.begin(), from_a.end(), pa) != from_a.end());
      EXPECT_TRUE(std::find(from_b.begin(), from_b.end(), pb) != from_b.end());
      a.deallocate(pa, 4096);
      b->deallocate(pb, 4096);
    }
    const auto sb = b->stats();
    EXPECT_EQ(sb.acquires, 20U);
    EXPECT_EQ(sb.deallocations, 20U);
    EXPECT_EQ(sb.bytes_in_use, 0U);
    b.reset();  // the next round's pool is likely at this one's address
    EXPECT_EQ(upstream_b->live_bytes(), 0U);
    EXPECT_EQ(upstream_b->bad_frees(), 0U);
  }
  const auto sa = a.stats();
  EXPECT_EQ(sa.acquires, sa.deallocations);
  EXPECT_EQ(sa.bytes_in_use, 0U);
  a.trim(0);
  EXPECT_EQ(upstream_a->live_bytes(), 0U);
}

// An upstream whose allocations block while the gate is closed (an owner inside a slow
// call, in_slow_call set).
class GatedUpstream final : public Upstream {
 public:
  explicit GatedUpstream(std::shared_ptr<Upstream> inner) : inner_(std::move(inner)) {}
  void* allocate(std::size_t bytes) override {
    std::unique_lock lock(mutex_);
    if (closed_) {
      ++waiting_;
      cv_.notify_all();
      cv_.wait(lock, [this] { return !closed_; });
    }
    lock.unlock();
    return inner_->allocate(bytes);
  }
  void deallocate(void* block, std::size_t bytes) noexcept override {
    inner_->deallocate(block, bytes);
  }
  MemoryKind kind() const noexcept override { return inner_->kind(); }
  std::string_view name() const noexcept override { return "gated"; }
  std::size_t alignment() const noexcept override { return inner_->alignment(); }
  std::size_t available_bytes() const noexcept override { return inner_->available_bytes(); }

  void close() {
    std::lock_guard lock(mutex_);
    closed_ = true;
  }
  void open() {
    std::lock_guard lock(mutex_);
    closed_ = false;
    cv_.notify_all();
  }
  void wait_for_waiter() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [this] { return waiting_ > 0; });
  }

 private:
  std::shared_ptr<Upstream> inner_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool closed_ = false;
  int waiting_ = 0;
};

// trim() while an owner blocks inside a growing call: trim asks it to flush and returns;
// the owner's call must flush its bins on its way out, and its later warm calls (the
// paths that now store kFree without looking at flush_requested) must not leave the
// request or its blocks stranded.
TEST(WarmPathCaches, TrimRacingAnOwnerBlockedInTheUpstreamIsHonoured) {
  for (bool validate : {false, true}) {
    SCOPED_TRACE(validate ? "validate" : "plain");
    auto counted = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto gated = std::make_shared<GatedUpstream>(counted);
    DevicePool::Options options;
    options.validate_deallocations = validate;
    DevicePool pool(gated, options);
    std::atomic<int> phase{0};
    std::thread owner([&] {
      std::vector<void*> blocks;
      for (int i = 0; i < 8; ++i) blocks.push_back(pool.allocate(4096));
      for (void* block : blocks) pool.deallocate(block, 4096);  // 8 blocks in its bins
      phase = 1;
      while (phase.load() != 2) std::this_thread::yield();
      void* large = pool.allocate(8_MiB);  // grows the large tier: blocks in the upstream
      phase = 3;
      while (phase.load() != 4) std::this_thread::yield();
      // Warm calls after the flush: nothing in the bins, so these go through the slow path.
      void* again = pool.allocate(4096);
      pool.deallocate(again, 4096);
      pool.deallocate(large, 8_MiB);
      phase = 5;
    });
    while (phase.load() != 1) std::this_thread::yield();
    EXPECT_EQ(pool.stats().bytes_cached_in_threads, 8U * 4096);
    gated->close();
    phase = 2;
    gated->wait_for_waiter();
    // The owner is inside a slow call: trim asks it to flush, then blocks on the large
    // tier's lock (the owner holds it across the upstream call) until the gate opens.
    std::thread trimmer([&] { pool.trim(0); });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    gated->open();
    trimmer.join();
    while (phase.load() != 3) std::this_thread::yield();
    EXPECT_EQ(pool.stats().bytes_cached_in_threads, 0U)
        << "the owner's growing call returned without honouring trim's flush request";
    phase = 4;
    while (phase.load() != 5) std::this_thread::yield();
    owner.join();
    auto s = pool.stats();
    EXPECT_EQ(s.bytes_in_use, 0U);
    EXPECT_EQ(s.acquires, s.deallocations);
    pool.trim(0);
    EXPECT_EQ(counted->live_bytes(), 0U);
    EXPECT_EQ(counted->bad_frees(), 0U);
  }
}

// A block of a class the thread cache does not keep (above thread_cache.max_block_bytes)
// released on a warm thread goes to its ring, never into a bin; one released on a thread
// that never used this pool (tl_last names another pool) too.
TEST(WarmPathCaches, UnkeptClassAndForeignThreadReleasesBypassTheBins) {
  DevicePool::Options options;
  options.validate_deallocations = false;
  options.thread_cache.max_block_bytes = 4096;
  DevicePool pool(std::make_shared<HostMemoryUpstream>(), options);
  DevicePool other(std::make_shared<HostMemoryUpstream>(), options);
  pool.deallocate(pool.allocate(4096), 4096);  // warm: tl_last is this pool
  void* big = pool.allocate(8192);
  pool.deallocate(big, 8192);
  auto s = pool.stats();
  EXPECT_EQ(s.bytes_cached_in_threads, 4096U);
  EXPECT_EQ(s.bytes_cached_in_rings, 8192U);
  void* block = pool.allocate(4096);
  std::thread foreign([&] {
    other.deallocate(other.allocate(256), 256);  // this thread's tl_last: `other`
    pool.deallocate(block, 4096);
  });
  foreign.join();
  s = pool.stats();
  EXPECT_EQ(s.bytes_in_use, 0U);
  EXPECT_EQ(s.acquires, s.deallocations);
  EXPECT_EQ(s.bytes_cached_in_rings, 8192U);
  EXPECT_EQ(s.bytes_cached_in_threads, 0U);  // the foreign thread's cache was retired
}

// Caches of exited threads are adopted by new threads: the adopted cache keeps the pool's
// per-class limits (bins sized for every small class, limits for the kept ones).
TEST(WarmPathCaches, AdoptedCachesKeepTheirLimits) {
  DevicePool::Options options;
  options.validate_deallocations = false;
  options.thread_cache.blocks = 3;
  options.thread_cache.max_block_bytes = 1024;
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool pool(upstream, options);
  for (int generation = 0; generation < 20; ++generation) {
    std::thread([&] {
      for (std::size_t bytes : {std::size_t{256}, std::size_t{1024}, std::size_t{4096}}) {
        std::vector<void*> blocks;
        for (int i = 0; i < 6; ++i) blocks.push_back(pool.allocate(bytes));
        for (void* block : blocks) pool.deallocate(block, bytes);
      }
      const auto s = pool.stats();
      EXPECT_EQ(s.bytes_cached_in_threads, 3U * (256 + 1024));
    }).join();
  }
  const auto s = pool.stats();
  EXPECT_EQ(s.bytes_cached_in_threads, 0U);
  EXPECT_EQ(s.bytes_in_use, 0U);
  EXPECT_EQ(s.acquires, s.deallocations);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// Threads that switch pools on every call (tl_last churn: the warm paths' claim fails and
// the slow path re-registers), with trims of both pools racing them and short-lived threads
// exiting (retire), in every call mode (plain, validate_deallocations, track_peak_in_use): no
// block is handed out twice and the accounting of both pools balances. (The name matches
// .ci/run's TSan filter, *Thread*.)
TEST(WarmPathCaches, TwoPoolThreadsRacingTrimsKeepAccountingExact) {
  for (int mode = 0; mode < 3; ++mode) {
    SCOPED_TRACE(mode == 0 ? "plain" : mode == 1 ? "validate_deallocations" : "track_peak_in_use");
    DevicePool::Options options;
    options.validate_deallocations = mode == 1;
    options.track_peak_in_use = mode == 2;
    options.thread_cache.blocks = 2;
    auto upstream_a = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto upstream_b = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    DevicePool a(upstream_a, options);
    DevicePool b(upstream_b, options);
    std::atomic<bool> stop{false};
    std::atomic<std::uint64_t> corrupt{0};
    auto work = [&](std::uint64_t id, int max_rounds) {
      std::uint64_t x = id * 0x9e3779b97f4a7c15ULL;
      for (int round = 0; round < max_rounds && !stop.load(std::memory_order_relaxed); ++round) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        const std::size_t bytes = std::size_t{1} << (8 + x % 8);  // 256 B .. 32 KiB
        DevicePool& pool = (x >> 8) % 2 == 0 ? a : b;
        DevicePool& other = &pool == &a ? b : a;
        auto* p = static_cast<std::uint64_t*>(pool.allocate(bytes));
        auto* q = static_cast<std::uint64_t*>(other.allocate(256));
        p[0] = x;
        q[0] = ~x;
        std::this_thread::yield();
        if (p[0] != x || q[0] != ~x) corrupt.fetch_add(1);
        pool.deallocate(p, bytes);
        other.deallocate(q, 256);
      }
    };
    std::vector<std::thread> threads;
    for (int t = 0; t < 3; ++t) threads.emplace_back(work, t + 1, 1 << 30);
    threads.emplace_back([&] {
      for (std::uint64_t id = 100; !stop.load(std::memory_order_relaxed); ++id) {
        std::thread(work, id, 50).join();
      }
    });
    threads.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
        a.trim(0);
        b.trim(0);
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    stop = true;
    for (auto& thread : threads) thread.join();
    EXPECT_EQ(corrupt.load(), 0U) << "a block was handed to two threads at once";
    for (DevicePool* pool : {&a, &b}) {
      const auto s = pool->stats();
      EXPECT_EQ(s.bytes_in_use, 0U);
      EXPECT_EQ(s.acquires, s.deallocations);
      EXPECT_EQ(s.invalid_deallocations, 0U);
      pool->trim(0);
      EXPECT_EQ(pool->stats().bytes_reserved, 0U);
    }
    EXPECT_EQ(upstream_a->live_bytes(), 0U);
    EXPECT_EQ(upstream_b->live_bytes(), 0U);
    EXPECT_EQ(upstream_a->bad_frees() + upstream_b->bad_frees(), 0U);
  }
}

}  // namespace
}  // namespace vram::testing
