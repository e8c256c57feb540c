#include "foreign_pool.hpp"

#include <algorithm>
#include <exception>
#include <iterator>
#include <new>

namespace vram_torch {

std::size_t ForeignPool::round(std::size_t size) noexcept {
  if (size <= kMinBlock) return kMinBlock;
  return (size + kMinBlock - 1) / kMinBlock * kMinBlock;
}

std::size_t ForeignPool::segment_bytes(std::size_t rounded) noexcept {
  if (rounded <= kSmallRequest) return kSmallSegment;
  if (rounded < kMinLargeAlone) return kLargeSegment;
  return (rounded + kLargeRound - 1) / kLargeRound * kLargeRound;
}

ForeignPool::~ForeignPool() {
  for (const auto& [address, segment] : segments_) {
    tell(address, segment.bytes, segment.stream, false);
    source_->deallocate(reinterpret_cast<void*>(address));
  }
}

bool ForeignPool::free_key(const Block& b, std::uintptr_t address, FreeKey& key) const noexcept {
  const auto segment = segments_.find(b.segment);
  if (segment == segments_.end()) return false;
  key = FreeKey{segment->second.stream, segment->second.large, b.bytes, address};
  return true;
}

void ForeignPool::carve(std::map<std::uintptr_t, Block>::iterator at, std::size_t rounded,
                        std::size_t requested) {
  Block& block = at->second;
  const std::size_t rest = block.bytes - rounded;
  const bool large = segments_.at(block.segment).large;
  if (large ? rest > kSmallRequest : rest >= kMinBlock) {
    // The rest first (both insertions may throw): the block itself changes last.
    const std::uintptr_t rest_at = at->first + rounded;
    // The rest keeps the free block's last request (cut to it), as PyTorch's remainder does.
    const auto made =
        blocks_.emplace(rest_at, Block{block.segment, rest, std::min(block.requested, rest), false})
            .first;
    FreeKey key;
    free_key(made->second, rest_at, key);
    try {
      free_.insert(key);
    } catch (...) {
      blocks_.erase(made);
      throw;
    }
    block.bytes = rounded;
  }
  block.live = true;
  block.requested = requested;
}

std::uintptr_t ForeignPool::take_free(std::size_t rounded, std::size_t requested,
                                      cudaStream_t stream, bool large) {
  const auto it = free_.lower_bound(FreeKey{stream, large, rounded, 0});
  if (it == free_.end() || std::get<0>(*it) != stream || std::get<1>(*it) != large) return 0;
  const std::uintptr_t address = std::get<3>(*it);
  auto node = free_.extract(it);
  try {
    carve(blocks_.find(address), rounded, requested);
  } catch (...) {
    free_.insert(std::move(node));  // no allocation: the node is reused
    throw;
  }
  return address;
}

ForeignPool::Given ForeignPool::allocate(std::size_t size, cudaStream_t stream) {
  const std::size_t rounded = round(size);
  const bool large = rounded > kSmallRequest;
  {
    std::lock_guard lock(mutex_);
    if (const std::uintptr_t at = take_free(rounded, size, stream, large)) {
      return {reinterpret_cast<void*>(at), blocks_.at(at).bytes};
    }
  }
  const std::size_t bytes = segment_bytes(rounded);
  // No cached segment is given back to make room: one may be baked into a captured graph
  // of this pool (PyTorch frees only pools without a use, and none during a capture).
  void* ptr = source_->allocate(bytes, stream);
  if (ptr == nullptr) return {};
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  // Told before any block of it can be handed out (its rest is free to other threads once
  // it is filed below).
  tell(address, bytes, stream, true);
  std::size_t given = 0;
  try {
    std::lock_guard lock(mutex_);
    const auto segment =
        segments_.emplace(address, Segment{bytes, stream, large, next_order_}).first;
    try {
      const auto block = blocks_.emplace(address, Block{address, bytes, 0, false}).first;
      try {
        carve(block, rounded, size);
      } catch (...) {
        blocks_.erase(block);
        throw;
      }
      given = block->second.bytes;
    } catch (...) {
      segments_.erase(segment);
      throw;
    }
    ++next_order_;
    reserved_ += bytes;
  } catch (...) {
    tell(address, bytes, stream, false);
    source_->deallocate(ptr);
    throw;
  }
  return {ptr, given};
}

bool ForeignPool::deallocate(void* ptr) noexcept {
  std::lock_guard lock(mutex_);
  auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == blocks_.end() || !it->second.live) return false;
  it->second.live = false;
  // A free block keeps the requested bytes of the block freed last into it (PyTorch's
  // snapshot shows them); a snapshot counts requested bytes of live blocks only.
  // Joins the free neighbours of the same segment (erasing allocates nothing).
  const auto join = [&](std::map<std::uintptr_t, Block>::iterator into,
                        std::map<std::uintptr_t, Block>::iterator from) {
    FreeKey key;
    if (free_key(from->second, from->first, key)) free_.erase(key);
    into->second.bytes += from->second.bytes;
    blocks_.erase(from);
  };
  if (const auto next = std::next(it);
      next != blocks_.end() && next->second.segment == it->second.segment && !next->second.live) {
    join(it, next);
  }
  if (it != blocks_.begin()) {
    const auto prev = std::prev(it);
    if (prev->second.segment == it->second.segment && !prev->second.live) {
      FreeKey key;
      if (free_key(prev->second, prev->first, key)) free_.erase(key);
      prev->second.requested = it->second.requested;  // the block just freed
      join(prev, it);
      it = prev;
    }
  }
  FreeKey key;
  if (free_key(it->second, it->first, key)) {
    try {
      free_.insert(key);
    } catch (...) {  // no host memory: the block is not reused; its segment still goes back
    }
  }
  return true;
}

void ForeignPool::take_whole_free(std::vector<std::pair<std::uintptr_t, Segment>>& whole) {
  for (auto it = segments_.begin(); it != segments_.end();) {
    const auto block = blocks_.find(it->first);
    if (block == blocks_.end() || block->second.live || block->second.bytes != it->second.bytes) {
      ++it;
      continue;
    }
    whole.emplace_back(*it);  // may throw: nothing changed for this segment
    FreeKey key;
    if (free_key(block->second, block->first, key)) free_.erase(key);
    blocks_.erase(block);
    reserved_ -= it->second.bytes;
    it = segments_.erase(it);
  }
}

std::size_t ForeignPool::release_free() noexcept {
  std::vector<std::pair<std::uintptr_t, Segment>> whole;
  {
    std::lock_guard lock(mutex_);
    try {
      take_whole_free(whole);
    } catch (...) {  // no host memory: what was taken out still goes back below
    }
  }
  give_back(whole);
  std::size_t bytes = 0;
  for (const auto& [address, segment] : whole) bytes += segment.bytes;
  return bytes;
}

void ForeignPool::tell(std::uintptr_t address, std::size_t bytes, cudaStream_t stream,
                       bool made) const noexcept {
  if (!listener_) return;
  try {
    listener_(address, bytes, stream, made);
  } catch (...) {  // what it missed is its own; the pool goes on
  }
}

void ForeignPool::give_back(
    const std::vector<std::pair<std::uintptr_t, Segment>>& segments) noexcept {
  for (const auto& [address, segment] : segments) {
    tell(address, segment.bytes, segment.stream, false);
    source_->deallocate(reinterpret_cast<void*>(address));
  }
}

std::vector<ForeignPool::SegmentView> ForeignPool::segments() const {
  std::lock_guard lock(mutex_);
  std::vector<SegmentView> views;
  views.reserve(segments_.size());
  for (const auto& [address, segment] : segments_) {
    SegmentView& view = views.emplace_back();
    view.address = address;
    view.bytes = segment.bytes;
    view.stream = segment.stream;
    view.large = segment.large;
    view.order = segment.order;
    for (auto it = blocks_.lower_bound(address);
         it != blocks_.end() && it->first < address + segment.bytes; ++it) {
      view.blocks.push_back({it->first, it->second.bytes, it->second.requested, it->second.live});
    }
  }
  return views;
}

std::size_t ForeignPool::reserved_bytes() const noexcept {
  std::lock_guard lock(mutex_);
  return reserved_;
}

std::size_t ForeignPool::segment_count() const noexcept {
  std::lock_guard lock(mutex_);
  return segments_.size();
}

}  // namespace vram_torch
