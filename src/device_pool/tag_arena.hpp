// src/device_pool/tag_arena.hpp: the memory of one sleep tag: its own reserved address range
// of the pool's virtual memory, best-fit blocks carved out of it, and the granules mapped
// under them.
//
// Invariants (the owner's mutex guards every call):
//   - every byte of the range is in exactly one live block or one free range; free ranges
//     carry the stream key they were freed on (kUntagged: free for all) and merge only with
//     neighbours of the same key;
//   - users_[g] is the number of live blocks touching granule g; a granule with users is
//     mapped whenever the arena is awake (mapped_[g]); a mapped granule belongs to exactly
//     one run (one physical allocation, taken back whole);
//   - mapped_bytes() is the sum of the runs' bytes, all of them charged to the pool's gauge
//     (ReservedGauge::add_total) while mapped.
// Requests on stream key K take a free range of K or an untagged one (stream order on K
// makes the first safe, the second is free for all); nothing else waits for a marker: other
// streams' frees become free for all at the next sleep (after its proof) or untag_free().
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "tier/growth_budget.hpp"
#include "tier/stream_key.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::detail {

class TagArena {
 public:
  static constexpr std::size_t kBlockGranularity = 512;
  struct Range {
    std::size_t offset = 0;
    std::size_t bytes = 0;
  };
  // Reserves `reservation_bytes` (rounded up to granules; at most kMaxReservationBytes of
  // pool_options.hpp, which SleepTags::create checks: the rounding cannot wrap and the
  // per-granule vectors stay small). Throws as VirtualMemory::reserve.
  // Every run mapped is charged to `gauge` (add_total), and taken off it when unmapped.
  TagArena(VirtualMemory& memory, ReservedGauge& gauge, std::size_t reservation_bytes,
           std::size_t map_ahead_bytes, std::size_t max_run_bytes);
  ~TagArena();  // unmaps every run and frees the range
  TagArena(const TagArena&) = delete;
  TagArena& operator=(const TagArena&) = delete;

  char* base() const noexcept { return base_; }
  std::size_t reservation_bytes() const noexcept { return reservation_; }
  std::size_t granularity() const noexcept { return granularity_; }
  bool contains(const void* pointer) const noexcept {
    const auto* p = static_cast<const char*>(pointer);
    return p >= base_ && p < base_ + reservation_;
  }
  static std::size_t round(std::size_t bytes) noexcept {
    return (bytes + kBlockGranularity - 1) / kBlockGranularity * kBlockGranularity;
  }

  // A block of `block_bytes` (a multiple of kBlockGranularity) for stream key `key`, its
  // granules mapped. Throws vram::OutOfMemory (range full, or no physical memory: nothing
  // changed).
  void* allocate(std::size_t block_bytes, StreamKey key);
  // The block bytes of the live block at `block`, or 0.
  std::size_t block_bytes_of(const void* block) const noexcept;
  // Frees a live block (block_bytes_of() != 0) on `key`; its granules stay mapped.
  void free(void* block, StreamKey key) noexcept;

  // The live blocks in address order, neighbours merged where the gap between them is at
  // most `max_gap` bytes (below one granule: such a gap lies in mapped granules).
  std::vector<Range> live_ranges(std::size_t max_gap) const;
  // Takes back every run (the caller holds the proof that no work uses them).
  void unmap_all() noexcept;
  // The byte offsets at which the mapped runs end, ascending.
  std::vector<std::size_t> run_ends() const;
  // Takes back every run that ends at or below byte offset `end` (the caller holds the proof
  // that no work uses them).
  void unmap_below(std::size_t end) noexcept;
  // Maps the granules under live blocks in address order, in runs of at most
  // max_run_bytes; after each run, mapped_below(end) says that every live granule below
  // byte offset `end` is mapped (work may be queued into them while the next run maps). On
  // failure the runs mapped so far stay mapped and the error is thrown: the caller waits
  // for what it queued into them, then unmap_all().
  void map_live(const std::function<void(std::size_t end)>& mapped_below);
  // Takes back the runs no live block touches; returns their bytes.
  std::size_t unmap_free_runs() noexcept;
  // Every free range becomes free for all (after a proof that no stream uses them).
  void untag_free();

  std::size_t mapped_bytes() const noexcept { return mapped_bytes_; }
  std::size_t live_bytes() const noexcept { return live_bytes_; }
  std::size_t live_blocks() const noexcept { return live_.size(); }

 private:
  struct FreeRange {
    std::size_t bytes;
    StreamKey key;
  };
  struct Run {
    std::size_t granules;
    std::uint64_t handle;
  };
  void insert_free(std::size_t offset, std::size_t bytes, StreamKey key);  // merges
  void erase_free(std::map<std::size_t, FreeRange>::iterator it);
  std::map<std::size_t, FreeRange>::iterator best_fit(std::size_t bytes, StreamKey key);
  // Maps granules [first, last] that are unmapped, in runs, the last one extended by up to
  // `ahead_granules` unmapped granules; appends each run's start to `made`. Throws after
  // unmapping nothing (the caller undoes `made`).
  void map_span(std::size_t first, std::size_t last, std::size_t ahead_granules,
                std::vector<std::size_t>& made);
  void unmap_run(std::map<std::size_t, Run>::iterator it) noexcept;

  VirtualMemory& memory_;
  ReservedGauge& gauge_;
  std::size_t granularity_;
  std::size_t reservation_;
  std::size_t map_ahead_granules_;
  std::size_t max_run_granules_;
  char* base_ = nullptr;
  std::map<std::size_t, FreeRange> free_;                              // by offset
  std::set<std::tuple<StreamKey, std::size_t, std::size_t>> by_size_;  // key, bytes, offset
  std::map<std::size_t, std::size_t> live_;                            // offset -> block bytes
  std::map<std::size_t, Run> runs_;                                    // first granule -> run
  std::vector<std::uint32_t> users_;
  std::vector<std::uint8_t> mapped_;
  std::size_t mapped_bytes_ = 0;
  std::size_t live_bytes_ = 0;
};

}  // namespace vram::detail
