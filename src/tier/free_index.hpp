// src/tier/free_index.hpp: an intrusive index of free ranges for best-fit placement
// (the smallest range of at least `need` bytes, ties: lowest address), TLSF-style.
//
// Ranges are filed in segregated bins by size: sizes of fewer than 2*kSub units (a unit
// is 2^unit_shift bytes, the tier's granularity) have a bin each; above that every power
// of two is split into kSub bins of equal width. Bins are ordered: every size in bin i is
// below every size in bin j > i. A two-level bitmap (one bit per row of kSub bins, one
// per bin) finds the next non-empty bin in O(1). Within a bin the ranges are unordered
// (O(1) insert and erase through the intrusive links); a search scans the first bin that
// may hold a fit for its minimum (size, address) among the ranges of at least `need`,
// then, if none qualifies there, the whole next non-empty bin. The result is
// std::set<(size, address)>::lower_bound(need) over the same ranges.
//
// Node: a struct with `std::size_t size`, `char* addr` (any pointer type compared with <),
// `Node* bin_prev`, `Node* bin_next` and `FreeIndex<Node>* index` (the index it is filed
// in, null when it is in none). A node's size must not change while it is filed. Insert
// and erase never allocate and never throw.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace vram::detail {

template <class Node>
class FreeIndex {
 public:
  static constexpr unsigned kSubBits = 4;
  static constexpr std::size_t kSub = std::size_t{1} << kSubBits;  // bins per power of two
  static constexpr std::size_t kRows = 64 - kSubBits + 1;          // row 0: exact small sizes
  static constexpr std::size_t kBins = kRows * kSub;

  explicit FreeIndex(unsigned unit_shift = 0) noexcept : shift_(unit_shift) {
    heads_.fill(nullptr);
  }
  FreeIndex(const FreeIndex&) = delete;
  FreeIndex& operator=(const FreeIndex&) = delete;

  bool empty() const noexcept { return count_ == 0; }
  std::size_t size() const noexcept { return count_; }

  // Monotone in `bytes`: bin_of(a) < bin_of(b) implies a < b.
  std::size_t bin_of(std::size_t bytes) const noexcept {
    const std::size_t units = bytes >> shift_;
    if (units < kSub) return units;
    const unsigned top = static_cast<unsigned>(std::bit_width(units)) - 1;  // >= kSubBits
    return (top - kSubBits + 1) * kSub + ((units >> (top - kSubBits)) & (kSub - 1));
  }

  void insert(Node* node) noexcept {
    assert(node->index == nullptr);
    const std::size_t bin = bin_of(node->size);
    Node* head = heads_[bin];
    node->bin_prev = nullptr;
    node->bin_next = head;
    if (head != nullptr) head->bin_prev = node;
    heads_[bin] = node;
    node->index = this;
    if (head == nullptr) {
      rows_ |= std::uint64_t{1} << (bin / kSub);
      bins_[bin / kSub] |= static_cast<std::uint16_t>(1u << (bin % kSub));
    }
    ++count_;
  }

  void erase(Node* node) noexcept {
    assert(node->index == this);
    if (node->bin_prev != nullptr) {
      node->bin_prev->bin_next = node->bin_next;
    } else {
      const std::size_t bin = bin_of(node->size);
      assert(heads_[bin] == node);
      heads_[bin] = node->bin_next;
      if (node->bin_next == nullptr) {
        const std::size_t row = bin / kSub;
        bins_[row] = static_cast<std::uint16_t>(bins_[row] & ~(1u << (bin % kSub)));
        if (bins_[row] == 0) rows_ &= ~(std::uint64_t{1} << row);
      }
    }
    if (node->bin_next != nullptr) node->bin_next->bin_prev = node->bin_prev;
    node->bin_prev = node->bin_next = nullptr;
    node->index = nullptr;
    --count_;
  }

  // Forgets every node without touching them (their links and `index` stay stale: the
  // caller resets them, e.g. when it moves them elsewhere). Touches only the non-empty
  // bins: a cleared index is as a new one, at the cost of its ranges, not of its bins.
  void clear() noexcept {
    for_each_bin([this](std::size_t bin) { heads_[bin] = nullptr; });
    bins_.fill(0);
    rows_ = 0;
    count_ = 0;
  }

  // The smallest range of at least `need` bytes (ties: lowest address); null when none.
  Node* best(std::size_t need) const noexcept {
    std::size_t bin = bin_of(need);
    if (Node* found = min_in(heads_[bin], need)) return found;
    bin = next_bin(bin + 1);
    return bin == kBins ? nullptr : min_in(heads_[bin], 0);
  }

  // The first (at most) `k` ranges of at least `need` bytes in (size, address) order, into
  // `out`; returns how many.
  std::size_t best_k(std::size_t need, Node** out, std::size_t k) const noexcept {
    std::size_t n = 0;
    if (k == 0) return 0;
    for (std::size_t bin = bin_of(need); bin < kBins; bin = next_bin(bin + 1)) {
      for (Node* r = heads_[bin]; r != nullptr; r = r->bin_next) {
        if (r->size < need) continue;
        if (n == k && !before(r, out[k - 1])) continue;
        std::size_t at = n < k ? n++ : k - 1;
        while (at > 0 && before(r, out[at - 1])) {
          out[at] = out[at - 1];
          --at;
        }
        out[at] = r;
      }
      if (n == k) break;  // every later bin holds larger ranges only
    }
    return n;
  }

  // Calls f(node) for every node, in no particular order. f may not change the index.
  template <class F>
  void for_each(F&& f) const {
    for_each_bin([this, &f](std::size_t bin) {
      for (Node* r = heads_[bin]; r != nullptr; r = r->bin_next) f(r);
    });
  }

  // Calls f(node) in ascending (size, address) order until it returns false. f may not
  // change the index. Each bin is sorted in `scratch` (reused; when it cannot grow, the
  // bin is walked by repeated minimum search instead, same order). Returns false when f did.
  template <class F>
  bool for_each_ordered(std::vector<Node*>& scratch, F&& f) const noexcept(noexcept(f(nullptr))) {
    for (std::size_t bin = next_bin(0); bin < kBins; bin = next_bin(bin + 1)) {
      bool sorted = true;
      try {
        scratch.clear();
        for (Node* r = heads_[bin]; r != nullptr; r = r->bin_next) scratch.push_back(r);
      } catch (...) {
        sorted = false;
      }
      if (sorted) {
        std::sort(scratch.begin(), scratch.end(),
                  [](const Node* a, const Node* b) { return before(a, b); });
        for (Node* r : scratch) {
          if (!f(r)) return false;
        }
        continue;
      }
      for (const Node* last = nullptr;;) {  // no memory: successive minima
        Node* next = nullptr;
        for (Node* r = heads_[bin]; r != nullptr; r = r->bin_next) {
          if ((last == nullptr || before(last, r)) && (next == nullptr || before(r, next))) {
            next = r;
          }
        }
        if (next == nullptr) break;
        if (!f(next)) return false;
        last = next;
      }
    }
    return true;
  }

  static bool before(const Node* a, const Node* b) noexcept {
    return a->size != b->size ? a->size < b->size : a->addr < b->addr;
  }

 private:
  // The minimum (size, address) in the bin list starting at `r` among sizes >= need.
  static Node* min_in(Node* r, std::size_t need) noexcept {
    Node* found = nullptr;
    for (; r != nullptr; r = r->bin_next) {
      if (r->size >= need && (found == nullptr || before(r, found))) found = r;
    }
    return found;
  }
  // Calls g(bin) for every non-empty bin, through the bitmap.
  template <class G>
  void for_each_bin(G&& g) const {
    for (std::uint64_t rows = rows_; rows != 0; rows &= rows - 1) {
      const auto row = static_cast<std::size_t>(std::countr_zero(rows));
      for (unsigned bins = bins_[row]; bins != 0; bins &= bins - 1) {
        g(row * kSub + static_cast<std::size_t>(std::countr_zero(bins)));
      }
    }
  }
  // The first non-empty bin at or after `bin` (kBins: none).
  std::size_t next_bin(std::size_t bin) const noexcept {
    if (bin >= kBins) return kBins;
    std::size_t row = bin / kSub;
    const unsigned in_row = bins_[row] & (~0u << (bin % kSub));
    if (in_row != 0) return row * kSub + static_cast<std::size_t>(std::countr_zero(in_row));
    if (row + 1 >= kRows) return kBins;
    const std::uint64_t later = rows_ & (~std::uint64_t{0} << (row + 1));
    if (later == 0) return kBins;
    row = static_cast<std::size_t>(std::countr_zero(later));
    return row * kSub +
           static_cast<std::size_t>(std::countr_zero(static_cast<unsigned>(bins_[row])));
  }

  unsigned shift_;
  std::size_t count_ = 0;
  std::uint64_t rows_ = 0;                   // bit r: row r has a non-empty bin
  std::array<std::uint16_t, kRows> bins_{};  // bit b of row r: bin r*kSub+b is non-empty
  std::array<Node*, kBins> heads_;
};

}  // namespace vram::detail
