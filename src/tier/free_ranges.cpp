#include "free_ranges.hpp"

#include <cassert>
#include <new>
#include <utility>

namespace vram::detail {

FreeRanges::~FreeRanges() {
  while (spare_ranges_ != nullptr) {
    Range* next = spare_ranges_->next;
    delete spare_ranges_;
    spare_ranges_ = next;
  }
}

void FreeRanges::destroy(Segment* segment) noexcept {
  for (Range* r = segment->first; r != nullptr;) {
    Range* next = r->next;
    delete r;
    r = next;
  }
  delete segment;
}

std::size_t FreeRanges::stream_slot(StreamKey key) const noexcept {
  std::size_t slot = 0;
  while (slot < tagged_.size() && tagged_[slot].key != key) ++slot;
  return slot;
}

FreeRanges::Index* FreeRanges::stream_index(StreamKey key) noexcept {
  const std::size_t slot = stream_slot(key);
  if (slot == tagged_.size()) return nullptr;
  cached_key_ = key;
  cached_index_ = tagged_[slot].index.get();
  return cached_index_;
}

void FreeRanges::erase_index(std::size_t slot) noexcept {
  assert(tagged_[slot].index->empty());
  if (spare_indices_.size() < spare_indices_.capacity()) {  // reserved in file(): no throw
    spare_indices_.push_back(std::move(tagged_[slot].index));
  }
  if (slot + 1 != tagged_.size()) tagged_[slot] = std::move(tagged_.back());
  tagged_.pop_back();
  cached_index_ = nullptr;
}

bool FreeRanges::file_new_index(Range* range) noexcept {
  Index* index = nullptr;
  try {
    if (tagged_.size() == tagged_.capacity()) tagged_.reserve(2 * tagged_.size() + 4);
    spare_indices_.reserve(kSpareIndices);
    std::unique_ptr<Index> fresh;
    if (!spare_indices_.empty()) {
      fresh = std::move(spare_indices_.back());
      spare_indices_.pop_back();
    } else {
      fresh = std::make_unique<Index>(unit_shift_);
    }
    index = fresh.get();
    tagged_.push_back(StreamIndex{range->tag, std::move(fresh)});  // reserved: no throw
  } catch (...) {
    return false;
  }
  cached_key_ = range->tag;
  cached_index_ = index;
  index->insert(range);
  return true;
}

void FreeRanges::drop_index(const Index* index) noexcept {
  std::size_t slot = 0;
  while (tagged_[slot].index.get() != index) ++slot;  // filed in it: present
  erase_index(slot);
}

FreeRanges::Range* FreeRanges::split_off_untagged(Range* last, char* at) noexcept {
  Range* tail = take_range();
  if (tail == nullptr) {
    tail = new (std::nothrow) Range{nullptr, 0, nullptr};
    if (tail == nullptr) return nullptr;
  }
  char* end = last->addr + last->size;
  *tail = Range{at,
                static_cast<std::size_t>(end - at),
                last->segment,
                last,
                nullptr,
                Range::State::free,
                kUntagged,
                0};
  const bool filed = last->state == Range::State::free;
  if (filed) remove_free(last);  // its size is its key
  last->size = static_cast<std::size_t>(at - last->addr);
  last->next = tail;
  if (filed) file(last);  // false: left unfiled (accounting unchanged)
  untagged_.insert(tail);
  return tail;
}

}  // namespace vram::detail
