#include "thread_heap.hpp"

#include <cassert>
#include <new>

namespace vram::detail {

ThreadHeap::~ThreadHeap() {
  // The chunks are the large tier's blocks: the tier gives them back with its memory.
  for (Chunk& chunk : chunk_books_) {
    if (chunk.segment != nullptr) FreeRanges::destroy(chunk.segment);
  }
}

ThreadHeap::Range* ThreadHeap::fit(StreamKey key, std::size_t need) noexcept {
  FreeRanges::Index* any = ranges_.index_of(kUntagged);
  Range* r = any->empty() ? nullptr : any->best(need);
  if (key != kUntagged) {
    if (FreeRanges::Index* own = ranges_.index_of(key); own != nullptr && !own->empty()) {
      Range* mine = own->best(need);
      if (mine != nullptr && (r == nullptr || mine->size <= r->size)) r = mine;
    }
  }
  return r;
}

void* ThreadHeap::take(Range* r, std::size_t need, LeaseOwner* owner) noexcept {
  const std::size_t segment_slot = slot_of(r->segment);
  Chunk& chunk = chunk_books_[segment_slot];
  ranges_.remove_free(r);
  ranges_.split(r, need);
  r->state = Range::State::used;
  r->owner = owner;
  live_.insert(r->addr, r);
  if (chunk.used == 0) {  // no longer wholly free
    idle_bytes_ -= chunk.segment->size + guard_;
    unask(segment_slot);
  }
  ++chunk.used;
  free_bytes_.store(free_bytes_.load(std::memory_order_relaxed) - need, std::memory_order_relaxed);
  return r->addr;
}

std::size_t ThreadHeap::slot_of(const Segment* segment) const noexcept {
  return segment->holder_slot;
}

void* ThreadHeap::allocate(std::size_t need, StreamKey key, LeaseOwner* owner) noexcept {
  const Lock locked(mutex_);
  Range* r = fit(key, need);
  if (r == nullptr) return nullptr;
  try {
    ranges_.keep_spares(1);
    live_.reserve_one();
  } catch (...) {
    return nullptr;  // no host memory for the books: the caller asks the tier
  }
  return take(r, need, owner);
}

void* ThreadHeap::allocate_in_new_chunk(void* chunk, std::size_t chunk_bytes, std::size_t need,
                                        StreamKey key, StreamKey served,
                                        LeaseOwner* owner) noexcept {
  assert(chunk_bytes >= need + guard_);
  const Lock locked(mutex_);
  std::size_t slot = 0;
  while (slot < kMaxChunks && chunk_books_[slot].segment != nullptr) ++slot;
  if (slot == kMaxChunks) return nullptr;
  Segment* segment = nullptr;
  try {
    ranges_.keep_spares(2);
    live_.reserve_one();
    segment = new Segment{static_cast<char*>(chunk) + guard_, chunk_bytes - guard_, nullptr, slot};
  } catch (...) {
    return nullptr;
  }
  Range* whole = ranges_.take_range();
  // Cut from the request's stream's own free range: safe only for that stream.
  *whole = Range{segment->base, segment->size, segment};
  whole->tag = served == key ? key : kUntagged;
  whole->epoch = epoch_;  // a quiesce marked before now does not cover the stream's work on it
  segment->first = whole;
  if (!ranges_.file(whole)) {  // no host memory for the stream's index
    ranges_.recycle(whole);
    delete segment;
    return nullptr;
  }
  chunk_books_[slot] = Chunk{segment, 0};
  slots_[slot].begin.store(reinterpret_cast<std::uintptr_t>(chunk), std::memory_order_relaxed);
  slots_[slot].bytes.store(chunk_bytes, std::memory_order_release);
  chunks_.store(chunks_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  chunk_total_.store(chunk_total_.load(std::memory_order_relaxed) + chunk_bytes,
                     std::memory_order_relaxed);
  free_bytes_.store(free_bytes_.load(std::memory_order_relaxed) + segment->size,
                    std::memory_order_relaxed);
  idle_bytes_ += chunk_bytes;
  return take(whole, need, owner);
}

ThreadHeap::Freed ThreadHeap::deallocate(void* block, std::size_t need, StreamKey tag,
                                         Returned& out, const LeaseOwner* by) noexcept {
  out.block = nullptr;
  const Lock locked(mutex_);
  // As the tier's free (segment_tier.cpp): a block its owner holds cached was deallocated to
  // that cache already.
  Range* r = live_.erase_if(block, [need, by](const Range* live) {
    if (live->size != need) return false;
    return live->owner == nullptr || live->owner == by || !live->owner->holds(live->addr);
  });
  if (r == nullptr) return Freed::foreign;
  if (r->owner != nullptr && r->owner != by) r->owner->revoke(block);  // its record is stale
  r->owner = nullptr;
  Segment* segment = r->segment;
  const std::size_t slot = slot_of(segment);
  Chunk& chunk = chunk_books_[slot];
  --chunk.used;
  r->tag = tag;
  r->epoch = epoch_;
  ranges_.insert_free(r);
  free_bytes_.store(free_bytes_.load(std::memory_order_relaxed) + need, std::memory_order_relaxed);
  if (chunk.used != 0) return Freed::kept;
  // Wholly free: kept for this thread's next requests only while it holds no other stream's
  // ranges than `tag`'s and the heap's wholly free chunks stay within keep_idle.
  const std::size_t bytes = segment->size + guard_;
  if (!holds_others(segment, tag) && idle_bytes_ + bytes <= options_.keep_idle) {
    idle_bytes_ += bytes;
    return Freed::kept;
  }
  idle_bytes_ += bytes;  // detach() takes it off again
  if (!detach(slot, out)) out.block = nullptr;
  return Freed::kept;
}

bool ThreadHeap::detach(std::size_t slot, Returned& out) noexcept {
  Chunk& chunk = chunk_books_[slot];
  Segment* segment = chunk.segment;
  std::size_t count = 0;
  for (const Range* p = segment->first; p != nullptr; p = p->next) ++count;
  try {
    out.pieces.clear();
    out.pieces.reserve(count + 1);
  } catch (...) {
    return false;  // kept: a later flush tries again
  }
  char* const base = segment->base - guard_;
  out.block = base;
  out.bytes = segment->size + guard_;
  out.pieces.push_back(SegmentTier::Piece{guard_, kUntagged});  // never handed out
  std::size_t freed = 0;
  for (Range* p = segment->first; p != nullptr; p = p->next) {
    out.pieces.push_back(SegmentTier::Piece{p->size, p->tag});
    freed += p->size;
    ranges_.remove_free(p);
  }
  // Unpublished before the books let go: contains() may still say yes (a hint).
  slots_[slot].bytes.store(0, std::memory_order_release);
  slots_[slot].begin.store(0, std::memory_order_relaxed);
  unask(slot);
  FreeRanges::destroy(segment);
  chunk = Chunk{};
  idle_bytes_ -= out.bytes;
  chunks_.store(chunks_.load(std::memory_order_relaxed) - 1, std::memory_order_relaxed);
  chunk_total_.store(chunk_total_.load(std::memory_order_relaxed) - out.bytes,
                     std::memory_order_relaxed);
  free_bytes_.store(free_bytes_.load(std::memory_order_relaxed) - freed, std::memory_order_relaxed);
  return true;
}

std::size_t ThreadHeap::take_idle(Returned* out, std::size_t most, Idle which,
                                  StreamKey key) noexcept {
  const Lock locked(mutex_);
  std::size_t taken = 0;
  for (std::size_t slot = 0; slot < kMaxChunks && taken < most; ++slot) {
    const Chunk& chunk = chunk_books_[slot];
    if (chunk.segment == nullptr || chunk.used != 0) continue;
    if (which == Idle::asked &&
        (asked_slots_.load(std::memory_order_relaxed) & (std::uint32_t{1} << slot)) == 0) {
      continue;
    }
    if (which != Idle::all && holds_others(chunk.segment, key) != (which == Idle::holding_others)) {
      if (which == Idle::usable) ask(slot);
      // Not for this stream's marker: no later free asks about it again (it goes back when
      // the heap takes a new chunk, or at a flush).
      if (which == Idle::asked) unask(slot);
      continue;
    }
    if (detach(slot, out[taken])) ++taken;
  }
  return taken;
}

std::uint64_t ThreadHeap::mark_frees() noexcept {
  const Lock locked(mutex_);
  return ++epoch_;
}

void ThreadHeap::forget_streams(std::uint64_t mark) noexcept {
  const Lock locked(mutex_);
  for (Chunk& chunk : chunk_books_) {
    if (chunk.segment == nullptr) continue;
    // First unfile and untag every such range, then file each again (merging with its
    // untagged neighbours): a merge recycles nodes, so the walk restarts after each.
    bool any = false;
    for (Range* r = chunk.segment->first; r != nullptr; r = r->next) {
      if (r->state == Range::State::free && r->tag != kUntagged && r->epoch < mark) {
        ranges_.remove_free(r);
        r->tag = kUntagged;
        any = true;
      }
    }
    for (Range* r = any ? chunk.segment->first : nullptr; r != nullptr;) {
      if (r->state == Range::State::free && r->index == nullptr && r->tag == kUntagged) {
        ranges_.insert_free(r);
        r = chunk.segment->first;
        continue;
      }
      r = r->next;
    }
  }
}

ThreadHeaps::Marks ThreadHeaps::mark_frees() noexcept {
  Marks marks;
  for_each([&marks](ThreadHeap& heap) { marks.mark[marks.count++] = heap.mark_frees(); });
  return marks;
}

void ThreadHeaps::forget_streams(const Marks& marks) noexcept {
  std::size_t i = 0;
  for_each([&marks, &i](ThreadHeap& heap) {
    if (i < marks.count) heap.forget_streams(marks.mark[i]);
    ++i;
  });
}

ThreadHeap* ThreadHeaps::make() noexcept {
  const std::lock_guard locked(mutex_);
  const std::size_t n = count_.load(std::memory_order_relaxed);
  if (n == kMaxHeaps) return nullptr;
  try {
    owned_.reserve(n + 1);
    owned_.push_back(std::make_unique<ThreadHeap>(options_));
  } catch (...) {
    return nullptr;
  }
  ThreadHeap* heap = owned_.back().get();
  heaps_[n].store(heap, std::memory_order_release);
  count_.store(n + 1, std::memory_order_release);
  return heap;
}

}  // namespace vram::detail
