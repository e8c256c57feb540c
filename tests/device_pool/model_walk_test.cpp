// Model-based random walk: seeded sequences of pool operations checked against a simple
// reference model after every step (VRAM_WALK_SEED replays one; the seed is printed).
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <random>

#include "test_upstreams.hpp"
#include "vram/device_pool.hpp"
#include "vram/pinned_staging_pool.hpp"
#include "vram/size_classes.hpp"
#include "vram/testing/witness.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

std::uint64_t walk_seed() {
  const char* text = std::getenv("VRAM_WALK_SEED");
  return text ? std::strtoull(text, nullptr, 10) : 20261130;
}

// `validate`: Options::validate_deallocations. Without it (release builds' default) the warm
// paths serve the calls; the model must hold either way. Size-class options vary per run,
// and a second pool's calls interleave on the thread (the warm paths serve only the pool a
// thread used last; the others register or switch).
void walk_device_pool(bool validate) {
  const std::uint64_t base = walk_seed();
  for (std::uint64_t run = 0; run < 20; ++run) {
    const std::uint64_t seed = base + run;
    SCOPED_TRACE("VRAM_WALK_SEED=" + std::to_string(seed));
    std::mt19937_64 random(seed);
    const std::size_t capacity = (4 + random() % 28) * 1_MiB;
    auto upstream = std::make_shared<TestUpstream>(
        std::make_shared<HostMemoryUpstream>(), TestUpstream::Options{.capacity_bytes = capacity});
    DevicePool::Options options;
    options.validate_deallocations = validate;
    options.max_cached_bytes = (random() % 8) * 1_MiB;
    options.max_cached_blocks_per_class = 1 + random() % 8;
    options.thread_cache.blocks = random() % 18;  // above 16: capped
    const std::size_t small_max[] = {256, 4_KiB, 256_KiB, 1_MiB, 2_MiB};
    options.small_tier.max_block_bytes = small_max[random() % 5];
    const std::size_t cached_max[] = {0, 256, 64_KiB, 1_MiB, 2_MiB};
    options.thread_cache.max_block_bytes = cached_max[random() % 5];
    options.thread_cache.max_bytes = (random() % 3) * 4_MiB;
    DevicePool pool(upstream, options);
    DevicePool other(std::make_shared<HostMemoryUpstream>(),
                     DevicePool::Options{.validate_deallocations = validate});
    std::map<void*, std::size_t> model;  // live block -> class bytes
    std::size_t model_in_use = 0;
    for (int step = 0; step < 1500; ++step) {
      const unsigned action = random() % 100;
      if (action < 55) {
        const std::size_t bytes = 1 + random() % (2_MiB);
        try {
          void* block = pool.allocate(bytes);
          const std::size_t class_bytes = pool.block_bytes(bytes);
          // No overlap with any live block.
          auto next = model.lower_bound(block);
          if (next != model.end()) {
            ASSERT_LE(static_cast<char*>(block) + class_bytes, static_cast<char*>(next->first));
          }
          if (next != model.begin()) {
            auto previous = std::prev(next);
            ASSERT_LE(static_cast<char*>(previous->first) + previous->second,
                      static_cast<char*>(block));
          }
          model[block] = class_bytes;
          model_in_use += class_bytes;
        } catch (const OutOfMemory&) {
          // Legitimate only when the upstream really is full once the pool has given back
          // everything it could (free ranges inside used segments stay: fragmentation).
          const auto after = pool.stats();
          ASSERT_EQ(after.bytes_cached_in_threads + after.bytes_cached_in_rings, 0U);
          ASSERT_GT(upstream->live_bytes() + pool.block_bytes(bytes), capacity);
        }
      } else if (action < 60) {
        const std::size_t bytes = 1 + random() % (1_MiB);
        other.deallocate(other.allocate(bytes), bytes);
      } else if (action < 95 && !model.empty()) {
        auto it = model.begin();
        std::advance(it, static_cast<long>(random() % model.size()));
        pool.deallocate(it->first, it->second);
        model_in_use -= it->second;
        model.erase(it);
      } else {
        const std::size_t keep = (random() % 4) * 1_MiB;
        pool.trim(keep);
        const auto trimmed = pool.stats();
        ASSERT_EQ(trimmed.bytes_cached_in_threads + trimmed.bytes_cached_in_rings, 0U);
      }
      const auto s = pool.stats();
      ASSERT_EQ(s.bytes_in_use, model_in_use) << "step " << step;
      ASSERT_EQ(s.bytes_reserved, upstream->live_bytes()) << "step " << step;
      ASSERT_EQ(s.bytes_reserved, s.bytes_in_use + s.bytes_cached) << "step " << step;
      ASSERT_LE(s.bytes_cached_in_threads, options.thread_cache.max_bytes);
      ASSERT_EQ(s.invalid_deallocations, 0U);
    }
    for (auto& [block, bytes] : model) pool.deallocate(block, bytes);
    pool.trim(0);
    ASSERT_EQ(upstream->live_bytes(), 0U);
    ASSERT_EQ(other.stats().bytes_in_use, 0U);
    ASSERT_EQ(other.stats().invalid_deallocations, 0U);
  }
}

TEST(ModelWalk, DevicePoolMatchesTheReferenceModel) { walk_device_pool(/*validate=*/true); }

TEST(ModelWalk, DevicePoolWithoutValidationMatchesTheReferenceModel) {
  walk_device_pool(/*validate=*/false);
}

TEST(ModelWalk, StagingPoolStaysWithinItsBounds) {
  std::mt19937_64 random(walk_seed());
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  PinnedStagingPool pool(upstream, {.max_buffers = 3, .max_bytes = 8_MiB});
  std::vector<PooledStaging> live;
  std::uint64_t acquires = 0;
  for (int step = 0; step < 3000; ++step) {
    const unsigned action = random() % 10;
    if (action < 5 || live.empty()) {
      live.push_back(pool.acquire(1 + random() % (4_MiB)));
      ++acquires;
    } else {
      const std::size_t index = random() % live.size();
      PooledStaging staging = std::move(live[index]);
      live.erase(live.begin() + static_cast<long>(index));
      if (action < 9) {
        staging.retire(WitnessMint::completed_copy_of(staging));
      }  // else dropped without a witness
    }
    const auto s = pool.stats();
    ASSERT_LE(s.free_buffers, 3U);
    ASSERT_LE(s.free_bytes, 8_MiB);
    ASSERT_EQ(s.pin_calls + s.reuses, acquires);
    std::size_t live_capacity = 0;
    for (auto& staging : live) live_capacity += staging.capacity();
    ASSERT_EQ(upstream->live_bytes(), live_capacity + s.free_bytes);
  }
}

}  // namespace
}  // namespace vram::testing
