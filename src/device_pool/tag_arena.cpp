// One sleep tag's range, blocks and granules (tag_arena.hpp).
#include "tag_arena.hpp"

#include <algorithm>

#include "vram/cuda/error.hpp"

namespace vram::detail {

TagArena::TagArena(VirtualMemory& memory, ReservedGauge& gauge, std::size_t reservation_bytes,
                   std::size_t map_ahead_bytes, std::size_t max_run_bytes)
    : memory_(memory),
      gauge_(gauge),
      granularity_(memory.granularity()),
      reservation_((std::max<std::size_t>(reservation_bytes, 1) + granularity_ - 1) / granularity_ *
                   granularity_),
      map_ahead_granules_(map_ahead_bytes / granularity_),
      max_run_granules_(std::max<std::size_t>(max_run_bytes / granularity_, 1)) {
  users_.assign(reservation_ / granularity_, 0);
  mapped_.assign(reservation_ / granularity_, 0);
  base_ = memory_.reserve(reservation_);
  insert_free(0, reservation_, kUntagged);
}

TagArena::~TagArena() {
  unmap_all();
  memory_.unreserve(base_, reservation_);
}

void TagArena::erase_free(std::map<std::size_t, FreeRange>::iterator it) {
  by_size_.erase({it->second.key, it->second.bytes, it->first});
  free_.erase(it);
}

void TagArena::insert_free(std::size_t offset, std::size_t bytes, StreamKey key) {
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first == offset + bytes && next->second.key == key) {
    bytes += next->second.bytes;
    auto after = std::next(next);
    erase_free(next);
    next = after;
  }
  if (next != free_.begin()) {
    auto previous = std::prev(next);
    if (previous->first + previous->second.bytes == offset && previous->second.key == key) {
      offset = previous->first;
      bytes += previous->second.bytes;
      erase_free(previous);
    }
  }
  free_.emplace(offset, FreeRange{bytes, key});
  by_size_.emplace(key, bytes, offset);
}

std::map<std::size_t, TagArena::FreeRange>::iterator TagArena::best_fit(std::size_t bytes,
                                                                        StreamKey key) {
  auto fit = by_size_.lower_bound({key, bytes, 0});
  if (fit == by_size_.end() || std::get<0>(*fit) != key) return free_.end();
  return free_.find(std::get<2>(*fit));
}

void* TagArena::allocate(std::size_t block_bytes, StreamKey key) {
  auto it = best_fit(block_bytes, key);
  if (it == free_.end() && key != kUntagged) it = best_fit(block_bytes, kUntagged);
  if (it == free_.end()) {
    throw OutOfMemory(block_bytes, 0, live_bytes_,
                      "the sleep tag's address range is full. Fix: a larger "
                      "SleepTagOptions::reservation_bytes");
  }
  const std::size_t offset = it->first;
  const FreeRange range = it->second;
  erase_free(it);
  if (range.bytes > block_bytes) {
    free_.emplace(offset + block_bytes, FreeRange{range.bytes - block_bytes, range.key});
    by_size_.emplace(range.key, range.bytes - block_bytes, offset + block_bytes);
  }
  const std::size_t first = offset / granularity_;
  const std::size_t last = (offset + block_bytes - 1) / granularity_;
  std::vector<std::size_t> made;
  try {
    map_span(first, last, map_ahead_granules_, made);
  } catch (...) {
    for (std::size_t start : made) unmap_run(runs_.find(start));
    insert_free(offset, block_bytes, range.key);
    throw;
  }
  for (std::size_t g = first; g <= last; ++g) ++users_[g];
  live_.emplace(offset, block_bytes);
  live_bytes_ += block_bytes;
  return base_ + offset;
}

void TagArena::map_span(std::size_t first, std::size_t last, std::size_t ahead_granules,
                        std::vector<std::size_t>& made) {
  const std::size_t granules = users_.size();
  std::size_t g = first;
  while (g <= last) {
    if (mapped_[g] != 0) {
      ++g;
      continue;
    }
    std::size_t end = g;  // inclusive
    while (end + 1 <= last && mapped_[end + 1] == 0 && end + 1 - g < max_run_granules_) ++end;
    // Map ahead past the block: later blocks of a growing tag find their granules mapped.
    std::size_t ahead_end = end;
    if (end == last) {
      std::size_t ahead = ahead_granules;
      while (ahead > 0 && ahead_end + 1 < granules && mapped_[ahead_end + 1] == 0 &&
             ahead_end + 1 - g < max_run_granules_) {
        ++ahead_end;
        --ahead;
      }
    }
    // Every run filed in `made` is in runs_ and mapped: what fails first is undone here.
    made.push_back(g);
    std::uint64_t handle = 0;
    try {
      try {
        handle = memory_.map(base_ + g * granularity_, (ahead_end - g + 1) * granularity_);
      } catch (const OutOfMemory&) {
        if (ahead_end == end) throw;
        ahead_end = end;  // without the granules ahead
        handle = memory_.map(base_ + g * granularity_, (end - g + 1) * granularity_);
      }
    } catch (...) {
      made.pop_back();
      throw;
    }
    try {
      runs_.emplace(g, Run{ahead_end - g + 1, handle});
    } catch (...) {
      memory_.unmap(base_ + g * granularity_, (ahead_end - g + 1) * granularity_, handle);
      made.pop_back();
      throw;
    }
    for (std::size_t m = g; m <= ahead_end; ++m) mapped_[m] = 1;
    mapped_bytes_ += (ahead_end - g + 1) * granularity_;
    gauge_.add_total((ahead_end - g + 1) * granularity_);
    g = ahead_end + 1;
  }
}

std::size_t TagArena::block_bytes_of(const void* block) const noexcept {
  if (!contains(block)) return 0;
  const auto it = live_.find(static_cast<std::size_t>(static_cast<const char*>(block) - base_));
  return it == live_.end() ? 0 : it->second;
}

void TagArena::free(void* block, StreamKey key) noexcept {
  const auto it = live_.find(static_cast<std::size_t>(static_cast<char*>(block) - base_));
  if (it == live_.end()) return;
  const std::size_t offset = it->first;
  const std::size_t bytes = it->second;
  live_.erase(it);
  live_bytes_ -= bytes;
  for (std::size_t g = offset / granularity_; g <= (offset + bytes - 1) / granularity_; ++g) {
    --users_[g];
  }
  try {
    insert_free(offset, bytes, key);
  } catch (...) {  // no host memory for a node: the range stays out of the free ranges
  }
}

std::vector<TagArena::Range> TagArena::live_ranges(std::size_t max_gap) const {
  std::vector<Range> ranges;
  for (const auto& [offset, bytes] : live_) {
    if (!ranges.empty()) {
      Range& last = ranges.back();
      const std::size_t end = last.offset + last.bytes;
      if (offset - end <= max_gap && max_gap < granularity_) {
        last.bytes = offset + bytes - last.offset;
        continue;
      }
    }
    ranges.push_back({offset, bytes});
  }
  return ranges;
}

void TagArena::unmap_run(std::map<std::size_t, Run>::iterator it) noexcept {
  const std::size_t first = it->first;
  const Run run = it->second;
  memory_.unmap(base_ + first * granularity_, run.granules * granularity_, run.handle);
  for (std::size_t g = first; g < first + run.granules; ++g) mapped_[g] = 0;
  mapped_bytes_ -= run.granules * granularity_;
  gauge_.sub_total(run.granules * granularity_);
  runs_.erase(it);
}

void TagArena::unmap_all() noexcept {
  while (!runs_.empty()) unmap_run(runs_.begin());
}

std::vector<std::size_t> TagArena::run_ends() const {
  std::vector<std::size_t> ends;
  ends.reserve(runs_.size());
  for (const auto& [first, run] : runs_) ends.push_back((first + run.granules) * granularity_);
  return ends;
}

void TagArena::unmap_below(std::size_t end) noexcept {
  // Runs are disjoint and ordered by their first granule: the first that ends above `end`
  // is followed by none that ends at or below it.
  while (!runs_.empty()) {
    const auto first = runs_.begin();
    if ((first->first + first->second.granules) * granularity_ > end) return;
    unmap_run(first);
  }
}

void TagArena::map_live(const std::function<void(std::size_t end)>& mapped_below) {
  std::vector<std::size_t> made;  // map_span's record; the caller undoes runs by unmap_all()
  const std::size_t granules = users_.size();
  std::size_t g = 0;
  while (g < granules) {
    if (users_[g] == 0 || mapped_[g] != 0) {
      ++g;
      continue;
    }
    std::size_t end = g;  // inclusive: one run, exactly live granules
    while (end + 1 < granules && users_[end + 1] != 0 && mapped_[end + 1] == 0 &&
           end + 1 - g < max_run_granules_) {
      ++end;
    }
    map_span(g, end, 0, made);
    g = end + 1;
    mapped_below(g * granularity_);
  }
}

std::size_t TagArena::unmap_free_runs() noexcept {
  std::size_t bytes = 0;
  for (auto it = runs_.begin(); it != runs_.end();) {
    const auto next = std::next(it);
    bool used = false;
    for (std::size_t g = it->first; g < it->first + it->second.granules && !used; ++g) {
      used = users_[g] != 0;
    }
    if (!used) {
      bytes += it->second.granules * granularity_;
      unmap_run(it);
    }
    it = next;
  }
  return bytes;
}

void TagArena::untag_free() {
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  ranges.reserve(free_.size());
  for (const auto& [offset, range] : free_) ranges.emplace_back(offset, range.bytes);
  free_.clear();
  by_size_.clear();
  for (const auto& [offset, bytes] : ranges) insert_free(offset, bytes, kUntagged);
}

}  // namespace vram::detail
