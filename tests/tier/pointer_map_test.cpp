// PointerMap (vram/detail/pointer_map.hpp): the open-addressing map of live blocks a tier
// and BlockRegistry keep, against a reference map, and its null key.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

#include "vram/detail/pointer_map.hpp"

namespace vram::detail {
namespace {

struct Value {
  int v = 0;
};

TEST(PointerMap, RandomOperationsMatchUnorderedMap) {
  std::mt19937_64 rng(7);
  PointerMap<Value> map;
  std::unordered_map<const void*, Value*> reference;
  std::vector<Value> values(64);
  std::vector<const void*> keys;
  for (int op = 0; op < 50000; ++op) {
    const unsigned what = static_cast<unsigned>(rng() % 8);
    // Aligned keys in a narrow range, so probe runs collide and wrap.
    const auto key =
        reinterpret_cast<const void*>(std::uintptr_t{0x7f0000000000} + (rng() % 4096) * 512);
    if (what < 4) {
      if (reference.count(key) != 0) continue;
      Value* value = &values[rng() % values.size()];
      map.reserve_one();
      map.insert(key, value);
      reference.emplace(key, value);
      keys.push_back(key);
    } else if (what < 6 && !keys.empty()) {
      const std::size_t i = rng() % keys.size();
      const void* k = keys[i];
      EXPECT_EQ(map.erase(k), reference.at(k));
      reference.erase(k);
      keys[i] = keys.back();
      keys.pop_back();
    } else {
      auto it = reference.find(key);
      EXPECT_EQ(map.find(key), it == reference.end() ? nullptr : it->second);
      if (it == reference.end()) {
        EXPECT_EQ(map.erase(key), nullptr);
      }
    }
    EXPECT_EQ(map.size(), reference.size());
  }
  for (const auto& [k, v] : reference) EXPECT_EQ(map.find(k), v);
  for (const void* k : keys) EXPECT_NE(map.erase(k), nullptr);
  EXPECT_EQ(map.size(), 0u);
  EXPECT_EQ(map.find(keys.empty() ? nullptr : keys.front()), nullptr);
}

// PointerMap's keys are documented non-null, but SegmentTier::free() hands it any pointer
// (a foreign one must come back false and change nothing). erase(nullptr) "finds" the
// first empty slot of its probe (an empty slot's key is null) and decrements size_.
TEST(PointerMap, EraseOfTheNullKeyChangesNothing) {
  PointerMap<int> map;
  int value = 1;
  map.reserve_one();
  map.insert(reinterpret_cast<const void*>(std::uintptr_t{0x7f0000001000}), &value);
  EXPECT_EQ(map.erase(nullptr), nullptr);
  EXPECT_EQ(map.size(), 1U) << "erase(nullptr) dropped the count of a live entry";
  EXPECT_EQ(map.find(nullptr), nullptr);
}

}  // namespace
}  // namespace vram::detail
