// BlockRegistry (src/stream_ordered_pool/block_registry.hpp): the blocks StreamOrderedPool
// handed out and their sizes, over a PointerMap; each comment states the rule its test holds.
#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "stream_ordered_pool/block_registry.hpp"
#include "vram/detail/pointer_map.hpp"

namespace vram::testing {
namespace {

// Checked, passes: PointerMap (sizes encoded as pointers in BlockRegistry) against a
// reference map under random insert/erase with clustered, aligned keys (long probe runs
// and wrap-around exercise the backward-shift deletion).
TEST(BlockRegistry, PointerMapMatchesAReferenceMap) {
  detail::PointerMap<std::byte> map;
  std::map<std::uintptr_t, std::uintptr_t> reference;
  std::mt19937_64 rng(9);
  for (int step = 0; step < 200000; ++step) {
    const std::uintptr_t key = (1 + rng() % 512) << 8;
    const auto* k = reinterpret_cast<const void*>(key);
    if (rng() % 3 != 0) {
      if (reference.count(key) == 0) {
        const std::uintptr_t value = 1 + rng() % 100000;
        map.reserve_one();
        map.insert(k, reinterpret_cast<std::byte*>(value));
        reference[key] = value;
      }
    } else {
      const auto* erased = map.erase(k);
      const auto it = reference.find(key);
      ASSERT_EQ(reinterpret_cast<std::uintptr_t>(erased), it == reference.end() ? 0 : it->second);
      if (it != reference.end()) reference.erase(it);
    }
    if (step % 997 == 0) {
      ASSERT_EQ(map.size(), reference.size());
      for (const auto& [key2, value] : reference) {
        ASSERT_EQ(reinterpret_cast<std::uintptr_t>(map.find(reinterpret_cast<const void*>(key2))),
                  value);
      }
    }
  }
}

// Checked, passes: racing releases of one block: exactly one takes it; wrong size leaves
// it recorded; sizes of any magnitude round-trip.
TEST(BlockRegistry, RacingTakesOfOneBlockTakeItOnce) {
  detail::BlockRegistry registry;
  std::size_t recorded = 0;
  registry.add(reinterpret_cast<void*>(0x100000), SIZE_MAX);
  EXPECT_EQ(registry.take(reinterpret_cast<void*>(0x100000), 1, recorded),
            detail::BlockRegistry::Deallocation::wrong_size);
  EXPECT_EQ(recorded, SIZE_MAX);
  EXPECT_EQ(registry.take(reinterpret_cast<void*>(0x100000), SIZE_MAX, recorded),
            detail::BlockRegistry::Deallocation::taken);
  for (int round = 0; round < 200; ++round) {
    std::vector<void*> blocks;
    for (std::uintptr_t i = 1; i <= 64; ++i) {
      blocks.push_back(reinterpret_cast<void*>(i << 12 | std::uintptr_t(round) << 24));
      registry.add(blocks.back(), 4096);
    }
    std::atomic<int> taken{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        for (void* b : blocks) {
          std::size_t r = 0;
          if (registry.take(b, 4096, r) == detail::BlockRegistry::Deallocation::taken) ++taken;
        }
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_EQ(taken.load(), 64);
    ASSERT_EQ(registry.size(), 0U);
  }
}

}  // namespace
}  // namespace vram::testing
