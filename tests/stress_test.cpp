// Stress: many threads, random sizes, random order, leases handed between threads. Every
// block carries its owner's tag from acquire to release, so one block given to two owners
// at once is caught. Bounded in time (VRAM_STRESS_SECONDS, default 2 per test); the seed
// is printed (VRAM_STRESS_SEED replays it).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "gpu_test_policy.hpp"
#include "test_upstreams.hpp"
#include "vram/cuda/event.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/pending_work.hpp"
#include "vram/units.hpp"
#ifdef VRAM_HAVE_TEST_KERNELS
#include "test_kernels.hpp"
#endif

namespace vram::testing {
namespace {

using namespace vram::literals;

double stress_seconds() {
  const char* text = std::getenv("VRAM_STRESS_SECONDS");
  return text ? std::atof(text) : 2.0;
}

std::uint64_t stress_seed() {
  const char* text = std::getenv("VRAM_STRESS_SEED");
  return text ? std::strtoull(text, nullptr, 10)
              : static_cast<std::uint64_t>(
                    std::chrono::steady_clock::now().time_since_epoch().count());
}

struct Tagged {
  DevicePool::Lease lease;
  std::uint32_t tag = 0;
};

// The tag covers the first 64 KiB of a block (two owners of one block share its start).
std::size_t tagged_words(const Tagged& t) {
  return std::min<std::size_t>(t.lease.size(), 64_KiB) / 4;
}

void write_tag(Tagged& t) {
  auto* words = static_cast<std::uint32_t*>(t.lease.data());
  const std::size_t count = tagged_words(t);
  for (std::size_t i = 0; i < count; ++i) words[i] = t.tag;
}

bool tag_intact(const Tagged& t) {
  const auto* words = static_cast<const std::uint32_t*>(t.lease.data());
  const std::size_t count = tagged_words(t);
  for (std::size_t i = 0; i < count; ++i) {
    if (words[i] != t.tag) return false;
  }
  return true;
}

// Segments (a host upstream's default): blocks up to 64 KiB. Virtual memory (the H200's
// default, emulated): sizes across the small classes carved out of the large tier (above
// 256 KiB) and into the large tier, which also unmaps past max_cached_bytes as blocks go.
void run_host_stress(bool validate_deallocations, bool virtual_memory = false) {
  const std::uint64_t seed = stress_seed();
  std::printf("[stress] seed %llu (VRAM_STRESS_SEED=%llu replays it), validation %s\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed),
              validate_deallocations ? "on" : "off");
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Options options;
  options.validate_deallocations = validate_deallocations;
  options.max_cached_bytes = 8_MiB;  // small: exercise upstream frees too
  if (virtual_memory) {
    options.large_tier.memory = LargeTierMemory::virtual_memory;
    options.large_tier.virtual_reservation_bytes = 4_GiB;
  }
  DevicePool pool(upstream, options);
  ASSERT_EQ(pool.uses_virtual_memory(), virtual_memory);
  constexpr int kThreads = 8;
  std::mutex handoff_mutex;
  std::deque<Tagged> handoff;  // leases passed from one thread to another
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> operations{0};
  std::atomic<std::uint64_t> corruptions{0};
  std::atomic<std::uint32_t> next_tag{1};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 random(seed + static_cast<std::uint64_t>(t));
      std::vector<Tagged> mine;
      auto release_one = [&](std::size_t index) {
        if (!tag_intact(mine[index])) ++corruptions;
        mine[index] = std::move(mine.back());
        mine.pop_back();
      };
      while (!stop.load(std::memory_order_relaxed)) {
        const unsigned action = random() % 10;
        if (action < 5 || mine.empty()) {
          const unsigned kind = virtual_memory ? random() % 20 : 0;
          const std::size_t bytes =
              kind < 14   ? 4 * (1 + random() % (16_KiB))    // up to 64 KiB
              : kind < 19 ? 256_KiB + random() % (768_KiB)   // large tier's small classes
                          : 1_MiB + 1 + random() % (7_MiB);  // large blocks
          Tagged fresh{pool.acquire(bytes), next_tag.fetch_add(1)};
          write_tag(fresh);
          mine.push_back(std::move(fresh));
        } else if (action < 8) {
          release_one(random() % mine.size());
        } else if (action < 9) {
          std::lock_guard lock(handoff_mutex);
          handoff.push_back(std::move(mine.back()));
          mine.pop_back();
        } else {
          std::lock_guard lock(handoff_mutex);
          if (!handoff.empty()) {
            mine.push_back(std::move(handoff.front()));
            handoff.pop_front();
          }
        }
        if (mine.size() > 64) release_one(0);
        if (random() % 4096 == 0) pool.trim((random() % 4) * 1_MiB);  // trims race the rest
        ++operations;
      }
      while (!mine.empty()) release_one(mine.size() - 1);
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(stress_seconds()));
  stop = true;
  for (auto& thread : threads) thread.join();
  for (auto& t : handoff) EXPECT_TRUE(tag_intact(t));
  handoff.clear();
  std::printf("[stress] %llu operations over %d threads\n",
              static_cast<unsigned long long>(operations.load()), kThreads);
  EXPECT_EQ(corruptions.load(), 0U) << "a block was handed to two owners (seed " << seed << ")";
  const auto s = pool.stats();
  EXPECT_EQ(s.invalid_deallocations, 0U);
  EXPECT_EQ(s.bytes_in_use, 0U);
  EXPECT_EQ(s.acquires, s.deallocations);
  EXPECT_EQ(s.bytes_reserved, upstream->live_bytes());
  EXPECT_EQ(upstream->bad_frees(), 0U);
  EXPECT_GT(operations.load(), 1000U);
}

TEST(Stress, HostPoolManyThreadsRandomSizesHandedBetweenThreads) { run_host_stress(true); }

// The shipped release path: no validation mutex to hide races.
TEST(Stress, HostPoolManyThreadsWithoutReleaseValidation) { run_host_stress(false); }

// Virtual memory (the large tier carves the small classes above 256 KiB), with and without
// release validation.
TEST(Stress, HostVirtualPoolManyThreadsAcrossTheTiers) { run_host_stress(true, true); }
TEST(Stress, HostVirtualPoolManyThreadsWithoutReleaseValidation) { run_host_stress(false, true); }

#ifdef VRAM_HAVE_TEST_KERNELS
TEST(StressGpu, KernelsTagBlocksOnManyStreamsWithPendingRelease) {
  VRAM_GPU_TEST_OR_SKIP();
  const std::uint64_t seed = stress_seed();
  std::printf("[stress-gpu] seed %llu\n", static_cast<unsigned long long>(seed));
  DevicePool pool(0, DevicePool::Options{.max_cached_bytes = 256_MiB});
  constexpr int kThreads = 4;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> dispatches{0};
  std::vector<unsigned long long> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 random(seed + static_cast<std::uint64_t>(t));
      cuda::Stream stream;
      unsigned long long* counter = nullptr;
      cuda::check(cudaMalloc(reinterpret_cast<void**>(&counter), sizeof *counter), "cudaMalloc");
      cuda::check(cudaMemsetAsync(counter, 0, sizeof *counter, stream.get()), "cudaMemsetAsync");
      PendingWorkQueue<cuda::Event> in_flight;
      std::uint32_t tag = static_cast<std::uint32_t>(t) << 24;
      while (!stop.load(std::memory_order_relaxed)) {
        const std::size_t bytes = 4 * (1 + random() % (256_KiB));
        auto lease = pool.acquire(bytes);
        ++tag;
        // Fill with this owner's tag, let other streams run, then verify on the device.
        launch_fill(lease.data(), bytes / 4, tag, stream.get());
        launch_spin_then_fill(counter, 0, 0, 20'000, stream.get());
        launch_count_mismatches(lease.data(), bytes / 4, tag, counter, stream.get());
        cuda::Event done;
        done.record(stream.get());
        in_flight.submit(std::move(done), std::move(lease));
        in_flight.collect();
        ++dispatches;
      }
      in_flight.drain();
      cuda::check(cudaMemcpy(&mismatches[t], counter, sizeof *counter, cudaMemcpyDeviceToHost),
                  "cudaMemcpy");
      cudaFree(counter);
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(stress_seconds()));
  stop = true;
  for (auto& thread : threads) thread.join();
  std::printf("[stress-gpu] %llu dispatches on %d streams\n",
              static_cast<unsigned long long>(dispatches.load()), kThreads);
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(mismatches[t], 0U) << "stream " << t << " saw its block overwritten (seed " << seed
                                 << ")";
  }
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  EXPECT_GT(dispatches.load(), 100U);
}
#endif

}  // namespace
}  // namespace vram::testing
