// src/tier/granule_map.hpp: a virtual-memory tier's granules: which are mapped, in which runs, and
// how far a map reaches ahead of the block that needs it.
//
// The tier reserves one address range (reserve_now(), set_base()) and maps granules in runs: one
// physical allocation and one map per run, taken back only whole. run_of_[g] is the first granule
// of g's run, kNoRun when g is unmapped; at a run's first granule, run_granules_ holds its
// length and handles_ its handle; bit g of mapped_bits_ is set exactly when g is mapped.
// Granules at or above mapped_high() were never mapped, so no work can use them whatever
// the tag of the range they lie in. Every run mapped adds its bytes to the tier's reserved
// and free bytes (GrowthBudget), every run unmapped takes them off.
//
// Reuse rule: a run is unmapped only when every one of its granules lies inside one free,
// untagged range (unmap_free()).
//
// Driver calls outside the tier's mutex: the reservation is taken by reserve_now() and
// filed by set_base(); a map is made in two steps, map_now() (the driver
// call, no state touched) and commit_run() (the books); a run leaves the books in
// unmap_free() as a DetachedMemory entry, and unmap_detached() makes the driver call later.
// Between the steps the granules are neither mapped nor free to map for anyone else: only
// the holder of the tier's growth mutex maps, detaches or unmaps (segment_tier.hpp).
//
// Not thread-safe: the owning tier calls it under its mutex (reserve_now, map_now and
// unmap_detached outside it, holding the growth mutex).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "free_ranges.hpp"
#include "growth_budget.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::detail {

// Memory already off a tier's books, still to be given back by a driver call made with no
// tier mutex held: a mapped run (virtual mode: its handle) or a segment (an upstream free).
struct DetachedMemory {
  char* addr;
  std::size_t bytes;
  std::uint64_t handle;  // the run's (virtual mode); 0 for a segment
};

class GranuleMap {
 public:
  using Range = FreeRanges::Range;
  struct Options {
    VirtualMemory* virtual_memory = nullptr;  // null: a segment tier, no granules
    std::size_t reservation = 0;
    std::size_t max_run_bytes = 0;
    std::size_t map_ahead_bytes = 0;
    std::size_t max_free_bytes = 0;
    bool unmap_before_map = false;
  };

  // Throws InvalidArgument when the granularity is not a power of two.
  GranuleMap(const Options& options, GrowthBudget& budget);
  GranuleMap(const GranuleMap&) = delete;
  GranuleMap& operator=(const GranuleMap&) = delete;

  // Sizes the run tables for the reservation; returns its bytes (whole granules). Then
  // reserve_now(those bytes) takes the range (the driver call alone: it throws what
  // VirtualMemory::reserve throws) and set_base() puts it on the books.
  std::size_t prepare();
  char* reserve_now(std::size_t bytes) const { return options_.virtual_memory->reserve(bytes); }
  void set_base(char* base) noexcept { base_ = base; }
  // Unmaps every run and frees the range (the tier's destruction) with the bytes prepare()
  // returned, which reserve_now() was given: a driver frees a range only with its reserved
  // size, and the reservation option need not be whole granules.
  void release() noexcept;

  char* base() const noexcept { return base_; }  // null until set_base()
  std::size_t granule() const noexcept { return granule_; }
  std::size_t mapped_high() const noexcept { return mapped_high_; }
  // The end of the granules ever mapped (reserved only).
  char* mapped_end() const noexcept { return base_ + mapped_high_ * granule_; }
  std::size_t granule_of(const char* address) const noexcept {
    return static_cast<std::size_t>(address - base_) >> granule_shift_;
  }
  bool mapped(std::size_t granule) const noexcept { return run_of_[granule] != kNoRun; }
  // Granules in [first, last] (inclusive) not mapped, a 64-granule word at a time: the large
  // tier's warm path asks this of every block it hands out.
  std::size_t unmapped_granules(std::size_t first, std::size_t last) const noexcept {
    std::size_t mapped_count = 0;
    for (std::size_t word = first / 64; word <= last / 64; ++word) {
      mapped_count += static_cast<std::size_t>(
          std::popcount(mapped_bits_[word] & granule_mask(word, first, last)));
    }
    return last - first + 1 - mapped_count;
  }
  bool all_mapped(std::size_t first, std::size_t last) const noexcept {  // unmapped == 0
    for (std::size_t word = first / 64; word <= last / 64; ++word) {
      const std::uint64_t want = granule_mask(word, first, last);
      if ((mapped_bits_[word] & want) != want) return false;
    }
    return true;
  }
  // Every granule under the first `bytes` of `r` is mapped (no driver call).
  bool mapped_under(const Range* r, std::size_t bytes) const noexcept {
    return all_mapped(granule_of(r->addr), granule_of(r->addr + bytes - 1));
  }

  // The longest run to map now, in granules, with `available` physical bytes left
  // (VirtualMemory::available_bytes(), asked once per map).
  std::size_t run_granule_cap(std::size_t available) const noexcept;
  // The last granule to map for `range` (whose granules up to `last` include `new_granules`
  // unmapped ones), extended by map-ahead where its rules allow.
  std::size_t map_ahead_end(const Range* range, std::size_t last, std::size_t new_granules,
                            std::size_t cap, std::size_t available) const noexcept;
  // Maps granules [first, end) (all unmapped) as one run, the driver call alone (no state
  // read or changed but the base): returns the run's handle for commit_run(); throws what
  // VirtualMemory::map throws (OutOfMemory when no physical memory is left).
  std::uint64_t map_now(std::size_t first, std::size_t end) const {
    return options_.virtual_memory->map(base_ + first * granule_, (end - first) * granule_);
  }
  // The books of a run mapped by map_now(): mapped, reserved and free.
  void commit_run(std::size_t first, std::size_t end, std::uint64_t handle) noexcept;
  // Takes whole runs inside the free ranges of `untagged` other than `except` off the books,
  // smallest ranges first, until at most `keep_free` bytes of the tier are free. Each goes
  // to `detached` for unmap_detached() (without `detached`, or when it cannot grow, it is
  // unmapped at once).
  void unmap_free(const FreeRanges::Index& untagged, std::size_t keep_free, const Range* except,
                  std::vector<DetachedMemory>* detached) noexcept;
  void unmap_detached(const DetachedMemory& run) const noexcept {
    options_.virtual_memory->unmap(run.addr, run.bytes, run.handle);
  }

 private:
  static constexpr std::size_t kNoRun = SIZE_MAX;
  static constexpr std::size_t kRunShareOfAvailable = 16;
  // The bits of mapped_bits_[word] that stand for granules in [first, last].
  static std::uint64_t granule_mask(std::size_t word, std::size_t first,
                                    std::size_t last) noexcept {
    std::uint64_t mask = ~std::uint64_t{0};
    if (word == first / 64) mask &= ~std::uint64_t{0} << (first % 64);
    if (word == last / 64 && last % 64 != 63) mask &= (std::uint64_t{1} << (last % 64 + 1)) - 1;
    return mask;
  }
  void set_mapped_bits(std::size_t first, std::size_t end, bool mapped) noexcept;
  // Takes the run starting at `first` off the books (its granules unmapped, its bytes off
  // reserved) and returns what unmap_detached() needs.
  DetachedMemory detach_run(std::size_t first) noexcept;

  const Options options_;
  GrowthBudget& budget_;
  char* base_ = nullptr;
  std::size_t granule_ = 0;
  unsigned granule_shift_ = 0;  // granule_ == 1 << granule_shift_ (the warm path shifts)
  std::vector<std::size_t> run_of_;
  std::vector<std::size_t> run_granules_;
  std::vector<std::uint64_t> handles_;
  std::vector<std::uint64_t> mapped_bits_;
  std::size_t mapped_high_ = 0;
  std::vector<Range*> scratch_;  // unmap_free()'s ordered walk
};

}  // namespace vram::detail
