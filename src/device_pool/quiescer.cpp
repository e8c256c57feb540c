#include "quiescer.hpp"

namespace vram::detail {

void Quiescer::quiesce() noexcept {
  std::lock_guard lock(mutex_);
  quiesce_locked();
}

bool Quiescer::quiesce_since(std::uint64_t seen) noexcept {
  std::lock_guard lock(mutex_);
  // One that began after `seen` has ended (its holder released the mutex): its marks came
  // after the frees that made the caller ask, so they are free for all already.
  if (generation_.load(std::memory_order_relaxed) != seen) return false;
  for_streams_.fetch_add(1, std::memory_order_relaxed);
  quiesce_locked();
  return true;
}

void Quiescer::quiesce_locked() noexcept {
  generation_.fetch_add(1, std::memory_order_relaxed);
  quiesces_.fetch_add(1, std::memory_order_relaxed);
  const std::uint64_t small_mark = small_.mark_frees();
  const std::uint64_t large_mark = large_.mark_frees();
  const ThreadHeaps::Marks large_heap_marks = large_heaps_.mark_frees();
  const ThreadHeaps::Marks small_heap_marks = small_heaps_.mark_frees();
  // A failed synchronize (another thread's capture in global mode refuses it, say) proves
  // nothing: every range keeps its stream.
  if (!fence_.try_quiesce()) return;
  small_.forget_streams(small_mark);
  large_.forget_streams(large_mark);
  large_heaps_.forget_streams(large_heap_marks);
  small_heaps_.forget_streams(small_heap_marks);
  wants_.clear();  // what they were for is free for all now (later frees want again)
}

}  // namespace vram::detail
