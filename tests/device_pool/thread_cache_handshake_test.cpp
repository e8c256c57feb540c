// The thread caches' Dekker handshake (detail/asymmetric_barrier.hpp) in each fence mode this
// build and kernel offer: the bare store-buffering litmus, and DevicePool's warm small
// pairs racing trim() in a loop and thread exits, with the shipped options
// (validate_deallocations off). A block handed to two threads at once is caught by a host-side
// set of held blocks, and a holder's tag written into the block is checked on release.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "device_pool/thread_cache.hpp"
#include "test_upstreams.hpp"
#include "vram/detail/asymmetric_barrier.hpp"
#include "vram/device_pool.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;
using detail::BarrierMode;

double fence_stress_seconds() {
  const char* text = std::getenv("VRAM_STRESS_SECONDS");
  return text ? std::atof(text) / 2 : 1.0;
}

// Pools constructed while this lives use `mode`; skips the test when this build or kernel
// cannot use it.
class ForcedMode {
 public:
  explicit ForcedMode(BarrierMode mode) : applied_(detail::force_barrier_mode_for_testing(mode)) {}
  ~ForcedMode() { detail::reset_barrier_mode_for_testing(); }
  ForcedMode(const ForcedMode&) = delete;
  ForcedMode& operator=(const ForcedMode&) = delete;
  bool applied() const { return applied_; }

 private:
  bool applied_;
};

#define VRAM_FORCE_MODE_OR_SKIP(mode)                                        \
  ForcedMode forced_mode(mode);                                              \
  if (!forced_mode.applied()) {                                              \
    GTEST_SKIP() << "barrier mode " << detail::barrier_mode_name(mode)       \
                 << " is not available in this build/kernel (default here: " \
                 << detail::asymmetric_barrier_mode() << ")";                \
  }                                                                          \
  ASSERT_STREQ(detail::asymmetric_barrier_mode(), detail::barrier_mode_name(mode))

std::string mode_test_name(const ::testing::TestParamInfo<BarrierMode>& info) {
  switch (info.param) {
    case BarrierMode::membarrier:
      return "Membarrier";
    case BarrierMode::full_barrier:
      return "Fence";
    case BarrierMode::seq_cst:
      return "SeqCst";
  }
  return "Unknown";
}

// A stealer skips a holder in a slow section (it may block). Sections nest (a growth's flush
// gives memory back inside the growth's own section): the inner one's end must not end the
// outer one, or a stealer would wait on a holder that is about to block.
TEST(ThreadCacheHandshake, ANestedSlowSectionLeavesTheOuterOneOpen) {
  detail::ThreadCache cache(4, 4, 8);
  {
    detail::SlowSection outer(&cache);
    {
      detail::SlowSection inner(&cache);
      EXPECT_TRUE(cache.in_slow_call.load());
    }
    EXPECT_TRUE(cache.in_slow_call.load()) << "the outer section is still open";
  }
  EXPECT_FALSE(cache.in_slow_call.load());
  detail::SlowSection none(nullptr);  // no cache: nothing to mark
}

TEST(ThreadCacheHandshake, DefaultModeIsNamedAndFixed) {
  const std::string name = detail::asymmetric_barrier_mode();
  std::printf("[barrier] default mode here: %s\n", name.c_str());
  EXPECT_EQ(name, detail::barrier_mode_name(detail::default_barrier_mode()));
  EXPECT_EQ(name, detail::asymmetric_barrier_mode());
#if VRAM_DETAIL_TSAN
  EXPECT_EQ(detail::default_barrier_mode(), BarrierMode::seq_cst);
  EXPECT_FALSE(detail::force_barrier_mode_for_testing(BarrierMode::full_barrier));
#else
  EXPECT_NE(detail::default_barrier_mode(), BarrierMode::seq_cst);
  EXPECT_FALSE(detail::force_barrier_mode_for_testing(BarrierMode::seq_cst));
  ASSERT_TRUE(detail::force_barrier_mode_for_testing(BarrierMode::full_barrier));  // always usable
  EXPECT_STREQ(detail::asymmetric_barrier_mode(), "full barrier");
  detail::reset_barrier_mode_for_testing();
#endif
  EXPECT_EQ(std::string(detail::asymmetric_barrier_mode()), name);
}

class ThreadCacheHandshakeModes : public ::testing::TestWithParam<BarrierMode> {};

// Store buffering: each side stores its word, runs its barrier and loads the other's.
// Without barriers x86 lets both loads read 0; with them at least one load sees a store.
TEST_P(ThreadCacheHandshakeModes, StoreBufferingLitmusNeverMissesBothStores) {
  VRAM_FORCE_MODE_OR_SKIP(GetParam());
  const detail::AsymmetricBarrier barrier(detail::barrier_mode_for_new_pool());
  constexpr int kRounds = 20000;
  std::atomic<std::uint32_t> x{0};
  std::atomic<std::uint32_t> y{0};
  std::atomic<int> arrived{0};
  std::array<std::uint32_t, 2> seen{};
  std::atomic<int> both_missed{0};
  // Both threads meet before and after every round (main resets x and y in between).
  auto meet = [&](int target) {
    arrived.fetch_add(1, std::memory_order_acq_rel);
    for (int spins = 0; arrived.load(std::memory_order_acquire) < target; ++spins) {
      if (spins > 100) std::this_thread::yield();  // 2 cores, builds running beside
    }
  };
  // A pseudo-random short delay after each meeting, so that the two sides' stores and
  // loads overlap in some rounds (the one released last by a meeting trails the other).
  auto delay = [](int seed) {
    const unsigned spins = (static_cast<unsigned>(seed) * 2654435761U) >> 26;  // 0..63
    volatile unsigned count = 0;
    while (count < spins) count = count + 1;
  };
  std::thread light_side([&] {
    for (int round = 0; round < kRounds; ++round) {
      meet(4 * round + 2);
      delay(round);
      x.store(1, detail::kDekkerStore);
      barrier.light();
      seen[0] = y.load(detail::kDekkerLoad);
      meet(4 * round + 4);
    }
  });
  for (int round = 0; round < kRounds; ++round) {
    meet(4 * round + 2);
    delay(round + kRounds);
    y.store(1, detail::kDekkerStore);
    barrier.heavy();
    seen[1] = x.load(detail::kDekkerLoad);
    meet(4 * round + 4);
    // Both are past the second meeting; the light side waits at the next first one.
    if (seen[0] == 0 && seen[1] == 0) both_missed.fetch_add(1, std::memory_order_relaxed);
    x.store(0, std::memory_order_relaxed);
    y.store(0, std::memory_order_relaxed);
  }
  light_side.join();
  EXPECT_EQ(both_missed.load(), 0);
}

// Which blocks are handed out now: a host-side set per shard (the block memory itself may
// hold anything when it comes fresh from malloc, so it cannot carry the claim).
class BlockCheck {
 public:
  // Records `block` as held by `tag` and writes the tag into its first 64 bytes (plain
  // stores: under TSan, two holders at once would also be a reported race).
  void claim(void* block, std::uint64_t tag) {
    {
      Shard& shard = shard_of(block);
      std::lock_guard lock(shard.mutex);
      if (!shard.held.insert(block).second) double_handouts.fetch_add(1);
    }
    auto* words = static_cast<std::uint64_t*>(block);
    for (int i = 0; i < 8; ++i) words[i] = tag;
  }
  void unclaim(void* block, std::uint64_t tag) {
    const auto* words = static_cast<const std::uint64_t*>(block);
    for (int i = 0; i < 8; ++i) {
      if (words[i] != tag) corrupted_tags.fetch_add(1);
    }
    Shard& shard = shard_of(block);
    std::lock_guard lock(shard.mutex);
    if (shard.held.erase(block) != 1) double_handouts.fetch_add(1);
  }

  std::atomic<std::uint64_t> double_handouts{0};
  std::atomic<std::uint64_t> corrupted_tags{0};

 private:
  struct Shard {
    std::mutex mutex;
    std::unordered_set<void*> held;
  };
  Shard& shard_of(void* block) {
    return shards_[(reinterpret_cast<std::uintptr_t>(block) >> 8) % shards_.size()];
  }
  std::array<Shard, 64> shards_;
};

// N threads run warm acquire/release pairs on small classes (holding a few blocks at a
// time) while one thread trims in a loop and short-lived threads register, work and exit
// (their caches are retired and adopted). The shipped path: validate_deallocations off.
TEST_P(ThreadCacheHandshakeModes, WarmPairsRacingTrimLoopNeverShareABlock) {
  VRAM_FORCE_MODE_OR_SKIP(GetParam());
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Options options;
  options.validate_deallocations = false;
  DevicePool pool(upstream, options);
  const std::array<std::size_t, 5> sizes{256, 512, 4_KiB, 64_KiB, 1_MiB};

  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> pairs{0};
  std::atomic<std::uint64_t> trims{0};
  std::atomic<std::uint64_t> exited_threads{0};
  BlockCheck check;
  auto work = [&](std::uint64_t id, std::uint64_t max_pairs) {
    std::mt19937_64 random(id);
    struct Held {
      void* block;
      std::size_t bytes;
      std::uint64_t tag;
    };
    std::vector<Held> held;
    std::uint64_t done = 0;
    while (!stop.load(std::memory_order_relaxed) && done < max_pairs) {
      const std::size_t bytes = sizes[random() % sizes.size()];
      const std::uint64_t tag = (id << 32) | done;
      void* block = pool.allocate(bytes);
      check.claim(block, tag);
      if (random() % 4 == 0 && held.size() < 6) {
        held.push_back({block, bytes, tag});  // kept across later pairs
      } else {
        check.unclaim(block, tag);
        pool.deallocate(block, bytes);
      }
      if (!held.empty() && random() % 3 == 0) {
        const Held h = held.back();
        held.pop_back();
        check.unclaim(h.block, h.tag);
        pool.deallocate(h.block, h.bytes);
      }
      ++done;
    }
    for (const Held& h : held) {
      check.unclaim(h.block, h.tag);
      pool.deallocate(h.block, h.bytes);
    }
    pairs.fetch_add(done, std::memory_order_relaxed);
  };

  constexpr int kWorkers = 4;
  std::vector<std::thread> threads;
  for (int t = 0; t < kWorkers; ++t) {
    threads.emplace_back(work, static_cast<std::uint64_t>(t + 1), UINT64_MAX);
  }
  threads.emplace_back([&] {  // registers, works a little, exits: retire() races the trims
    std::uint64_t id = 1000;
    while (!stop.load(std::memory_order_relaxed)) {
      std::thread(work, id++, 200).join();
      exited_threads.fetch_add(1, std::memory_order_relaxed);
    }
  });
  threads.emplace_back([&] {
    std::mt19937_64 random(7);
    while (!stop.load(std::memory_order_relaxed)) {
      pool.trim(random() % 2 == 0 ? 0 : 1_MiB);
      trims.fetch_add(1, std::memory_order_relaxed);
    }
  });
  std::this_thread::sleep_for(std::chrono::duration<double>(fence_stress_seconds()));
  stop = true;
  for (auto& thread : threads) thread.join();

  std::printf("[fence] mode %s: %llu pairs, %llu trims, %llu exited threads\n",
              detail::barrier_mode_name(GetParam()), static_cast<unsigned long long>(pairs.load()),
              static_cast<unsigned long long>(trims.load()),
              static_cast<unsigned long long>(exited_threads.load()));
  EXPECT_EQ(check.double_handouts.load(), 0U) << "a block was handed to two threads at once";
  EXPECT_EQ(check.corrupted_tags.load(), 0U);
  EXPECT_GT(pairs.load(), 1000U);
  EXPECT_GT(trims.load(), 10U);
  EXPECT_GT(exited_threads.load(), 0U);

  DevicePoolStats s = pool.stats();
  EXPECT_EQ(s.bytes_in_use, 0U);
  EXPECT_EQ(s.acquires, s.deallocations);
  EXPECT_EQ(s.invalid_deallocations, 0U);
  EXPECT_EQ(s.bytes_reserved, upstream->live_bytes());
  pool.trim(0);  // every cache (of live, idle and exited threads) and ring back
  s = pool.stats();
  EXPECT_EQ(s.bytes_cached_in_threads, 0U);
  EXPECT_EQ(s.bytes_cached_in_rings, 0U);
  EXPECT_EQ(s.bytes_reserved, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

// Pool destruction closes the caches while other threads still release leases through
// them (their claims find the cache closed and take the pool's slow path).
TEST_P(ThreadCacheHandshakeModes, DestructionRacingWarmReleasesLosesNothing) {
  VRAM_FORCE_MODE_OR_SKIP(GetParam());
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  for (int round = 0; round < 20; ++round) {
    DevicePool::Options options;
    options.validate_deallocations = false;
    auto pool = std::make_unique<DevicePool>(upstream, options);
    constexpr int kThreads = 3;
    std::vector<std::vector<DevicePool::Lease>> leases(kThreads);
    for (auto& mine : leases) {
      for (int i = 0; i < 64; ++i) mine.push_back(pool->acquire(256 * (1 + i % 8)));
    }
    std::atomic<int> started{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        started.fetch_add(1);
        while (started.load() < kThreads + 1) {
        }
        leases[t].clear();  // warm releases into this thread's cache, racing close()
      });
    }
    started.fetch_add(1);
    while (started.load() < kThreads + 1) {
    }
    pool.reset();
    for (auto& thread : threads) thread.join();
  }
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

INSTANTIATE_TEST_SUITE_P(Modes, ThreadCacheHandshakeModes,
                         ::testing::Values(BarrierMode::membarrier, BarrierMode::full_barrier,
                                           BarrierMode::seq_cst),
                         mode_test_name);

}  // namespace
}  // namespace vram::testing
