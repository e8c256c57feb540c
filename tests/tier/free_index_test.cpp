// FreeIndex (DevicePool's best-fit index of free ranges) against a std::set<(size, addr)>
// reference, and PointerMap (the tier's map of live blocks) against std::unordered_map.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <random>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tier/free_index.hpp"

namespace vram::detail {
namespace {

struct Node {
  std::size_t size = 0;
  char* addr = nullptr;
  Node* bin_prev = nullptr;
  Node* bin_next = nullptr;
  FreeIndex<Node>* index = nullptr;
};

using Key = std::pair<std::size_t, std::uintptr_t>;
Key key_of(const Node* n) { return {n->size, reinterpret_cast<std::uintptr_t>(n->addr)}; }

// The index and its reference together; nodes own distinct addresses.
class Harness {
 public:
  explicit Harness(unsigned shift) : index(shift) {}
  FreeIndex<Node> index;
  std::set<Key> reference;
  std::vector<std::unique_ptr<Node>> nodes;  // every node made (filed or not)

  Node* add(std::size_t size, std::uintptr_t addr) {
    nodes.push_back(std::make_unique<Node>());
    Node* n = nodes.back().get();
    n->size = size;
    n->addr = reinterpret_cast<char*>(addr);
    index.insert(n);
    reference.insert(key_of(n));
    return n;
  }
  void remove(Node* n) {
    index.erase(n);
    reference.erase(key_of(n));
  }
  // Checks best(), best_k() and the ordered walk for `need` against the reference.
  void check(std::size_t need) {
    auto it = reference.lower_bound({need, 0});
    Node* best = index.best(need);
    if (it == reference.end()) {
      EXPECT_EQ(best, nullptr) << "need " << need;
    } else {
      ASSERT_NE(best, nullptr) << "need " << need;
      EXPECT_EQ(key_of(best), *it) << "need " << need;
    }
    for (std::size_t k : {std::size_t{1}, std::size_t{3}, std::size_t{8}}) {
      Node* out[8];
      const std::size_t n = index.best_k(need, out, k);
      auto ref = it;
      std::size_t expected = 0;
      for (; ref != reference.end() && expected < k; ++ref, ++expected) {
        ASSERT_LT(expected, n) << "need " << need << " k " << k;
        EXPECT_EQ(key_of(out[expected]), *ref) << "need " << need << " k " << k;
      }
      EXPECT_EQ(n, expected) << "need " << need << " k " << k;
    }
  }
  void check_walks() {
    EXPECT_EQ(index.size(), reference.size());
    EXPECT_EQ(index.empty(), reference.empty());
    std::vector<Key> walked;
    std::vector<Node*> scratch;
    EXPECT_TRUE(index.for_each_ordered(scratch, [&](const Node* n) {
      walked.push_back(key_of(n));
      return true;
    }));
    EXPECT_EQ(walked, std::vector<Key>(reference.begin(), reference.end()));
    std::set<Key> unordered;
    index.for_each([&](const Node* n) { unordered.insert(key_of(n)); });
    EXPECT_EQ(unordered, reference);
  }
};

TEST(FreeIndex, BinsAreOrderedBySize) {
  FreeIndex<Node> index(9);
  std::size_t last = 0;
  for (std::size_t units = 1; units < (std::size_t{1} << 20); units += 1 + units / 7) {
    const std::size_t bin = index.bin_of(units << 9);
    EXPECT_GE(bin, last);
    EXPECT_LT(bin, FreeIndex<Node>::kBins);
    last = bin;
  }
  EXPECT_LT(index.bin_of(~std::size_t{0}), FreeIndex<Node>::kBins);
  EXPECT_LT(FreeIndex<Node>(0).bin_of(~std::size_t{0}), FreeIndex<Node>::kBins);
  // Small sizes have a bin each; 16 bins per power of two above.
  EXPECT_NE(index.bin_of(512), index.bin_of(1024));
  EXPECT_EQ(index.bin_of(std::size_t{1} << 30), index.bin_of((std::size_t{1} << 30) + 512));
  EXPECT_NE(index.bin_of(std::size_t{1} << 30),
            index.bin_of((std::size_t{1} << 30) + (std::size_t{1} << 26)));
}

TEST(FreeIndex, EmptyIndexFindsNothing) {
  Harness h(9);
  h.check(512);
  h.check(1);
  h.check(std::size_t{1} << 46);
  h.check_walks();
}

// clear() touches only the non-empty bins; afterwards the index is as a new one (a stream's
// index is cleared when the stream is fenced and reused as a spare for the next stream).
TEST(FreeIndex, ClearedIndexIsAsNewAndServesAgain) {
  Harness h(9);
  std::uintptr_t addr = 0x10000;
  for (std::size_t size : {std::size_t{512}, std::size_t{4096}, std::size_t{3} << 20,
                           std::size_t{1} << 30, std::size_t{5} << 40}) {
    for (int i = 0; i < 3; ++i) h.add(size, addr += 0x1000);
  }
  h.check(1 << 20);
  h.index.clear();
  for (auto& n : h.nodes) n->index = nullptr;  // the caller resets what it moves elsewhere
  h.reference.clear();
  h.check_walks();
  h.check(512);
  h.check(std::size_t{1} << 30);
  Node* again = h.add(std::size_t{3} << 20, 0x900000);
  h.add(std::size_t{1} << 30, 0xA00000);
  h.check(1 << 20);
  h.check(std::size_t{2} << 30);
  h.check_walks();
  h.remove(again);
  h.check(1 << 20);
  h.check_walks();
}

// Sizes at and around bin boundaries (a granule, one granule or one byte under and over
// powers of two and sub-bin edges), up to 2^46.
TEST(FreeIndex, EdgeSizesMatchReference) {
  for (unsigned shift : {0u, 9u}) {
    Harness h(shift);
    std::vector<std::size_t> sizes;
    for (unsigned p = 9; p <= 46; ++p) {
      const std::size_t base = std::size_t{1} << p;
      for (std::size_t step : {std::size_t{0}, base / 16, base / 16 * 3, base / 2}) {
        for (std::ptrdiff_t delta : {-512, -1, 0, 1, 512}) {
          const std::size_t s = base + step + static_cast<std::size_t>(delta);
          if (shift == 9 && s % 512 != 0) continue;
          sizes.push_back(s);
        }
      }
    }
    std::uintptr_t addr = 4096;
    for (std::size_t s : sizes) {
      h.add(s, addr);
      addr += 4096;
    }
    // Same sizes again at lower addresses: ties go to the lowest address.
    for (std::size_t i = 0; i < sizes.size(); i += 3) h.add(sizes[i], 16 + i);
    for (std::size_t s : sizes) {
      h.check(s);
      h.check(s - 1);
      h.check(s + 1);
    }
    h.check(1);
    h.check((std::size_t{1} << 47));
    h.check_walks();
    // Remove every other node, check again.
    for (std::size_t i = 0; i < h.nodes.size(); i += 2) h.remove(h.nodes[i].get());
    for (std::size_t s : sizes) h.check(s);
    h.check_walks();
  }
}

TEST(FreeIndex, RandomOperationsMatchReference) {
  std::mt19937_64 rng(20261130);
  for (unsigned shift : {0u, 9u}) {
    Harness h(shift);
    std::vector<Node*> filed;
    std::uintptr_t next_addr = 1 << 20;
    auto random_size = [&] {
      const unsigned p = 9 + static_cast<unsigned>(rng() % 30);  // 512 B .. 512 GiB
      std::size_t s = (std::size_t{1} << p) + rng() % (std::size_t{1} << p);
      if (rng() % 4 == 0) s = std::size_t{512} << (rng() % 8);  // many equal sizes
      return shift == 9 ? (s + 511) & ~std::size_t{511} : s;
    };
    for (int op = 0; op < 20000; ++op) {
      const unsigned what = static_cast<unsigned>(rng() % 10);
      if (what < 4 || filed.empty()) {
        // Addresses: mostly increasing, sometimes reusing a freed one's neighbourhood.
        const std::uintptr_t addr = rng() % 3 == 0 ? next_addr - (rng() % 4096) * 8 : next_addr;
        if (addr == next_addr) next_addr += 1 << 16;
        bool taken = false;
        for (const auto& n : h.nodes) {
          if (n->index != nullptr && reinterpret_cast<std::uintptr_t>(n->addr) == addr) {
            taken = true;
          }
        }
        if (taken) continue;
        filed.push_back(h.add(random_size(), addr));
      } else if (what < 7) {
        const std::size_t i = rng() % filed.size();
        h.remove(filed[i]);
        filed[i] = filed.back();
        filed.pop_back();
      } else {
        // Best fit for a random size, a size present, or just above one present.
        std::size_t need = random_size();
        if (what == 8) need = filed[rng() % filed.size()]->size;
        if (what == 9) need = filed[rng() % filed.size()]->size + 1;
        h.check(need);
        // Taking the fit out, as the tier does.
        if (Node* best = h.index.best(need); best != nullptr && rng() % 2 == 0) {
          h.remove(best);
          filed.erase(std::find(filed.begin(), filed.end(), best));
        }
      }
      if (op % 1000 == 0) h.check_walks();
    }
    h.check_walks();
    // Drain: the bitmaps must end empty.
    for (Node* n : filed) h.remove(n);
    EXPECT_TRUE(h.index.empty());
    h.check(512);
    h.check_walks();
  }
}

TEST(FreeIndex, OrderedWalkStopsWhenAsked) {
  Harness h(9);
  for (std::uintptr_t i = 0; i < 100; ++i) h.add(512 * (1 + i % 7), 4096 * (100 - i));
  std::vector<Node*> scratch;
  std::vector<Key> walked;
  EXPECT_FALSE(h.index.for_each_ordered(scratch, [&](const Node* n) {
    walked.push_back(key_of(n));
    return walked.size() < 10;
  }));
  EXPECT_EQ(walked, std::vector<Key>(h.reference.begin(), std::next(h.reference.begin(), 10)));
}

// FreeIndex at the top of the size range (rows 59-60; bin_of near 2^64).
TEST(FreeIndex, HugeSizesAreFoundInOrder) {
  struct Node {
    std::size_t size = 0;
    char* addr = nullptr;
    Node* bin_prev = nullptr;
    Node* bin_next = nullptr;
    detail::FreeIndex<Node>* index = nullptr;
  };
  for (unsigned shift : {0u, 9u, 21u}) {
    SCOPED_TRACE(shift);
    detail::FreeIndex<Node> index(shift);
    const std::size_t top = ~std::size_t{0} >> shift << shift;
    Node nodes[4];
    nodes[0].size = std::size_t{1} << 63;
    nodes[1].size = top;
    nodes[2].size = (std::size_t{1} << 63) - (std::size_t{1} << shift);
    nodes[3].size = std::size_t{1} << shift;
    for (int i = 0; i < 4; ++i) {
      nodes[i].addr = reinterpret_cast<char*>(std::uintptr_t{4096} * (i + 1));
      index.insert(&nodes[i]);
    }
    EXPECT_EQ(index.best(1), &nodes[3]);
    EXPECT_EQ(index.best(std::size_t{1} << 62), &nodes[2]);
    EXPECT_EQ(index.best(nodes[2].size), &nodes[2]);
    EXPECT_EQ(index.best(nodes[2].size + 1), &nodes[0]);
    EXPECT_EQ(index.best((std::size_t{1} << 63) + 1), &nodes[1]);
    EXPECT_EQ(index.best(top), &nodes[1]);
    if (top != ~std::size_t{0}) EXPECT_EQ(index.best(top + 1), nullptr);
    Node* out[4];
    ASSERT_EQ(index.best_k(1, out, 4), 4U);
    EXPECT_EQ(out[0], &nodes[3]);
    EXPECT_EQ(out[1], &nodes[2]);
    EXPECT_EQ(out[2], &nodes[0]);
    EXPECT_EQ(out[3], &nodes[1]);
    for (Node& n : nodes) index.erase(&n);
    EXPECT_TRUE(index.empty());
    EXPECT_EQ(index.best(1), nullptr);
  }
}

}  // namespace
}  // namespace vram::detail
