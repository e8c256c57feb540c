// src/tier/lease_owner.hpp: what the large tier knows of the thread cache a large block was
// handed to (large_block_cache.hpp), so that a release of that block on another path
// (another thread, the pool's slow path) stays exact without the owner taking the tier's
// mutex on its warm path.
//
// The tier files the owner with the used range (SegmentTier::allocate's `owner`). A release
// through the tier by anyone but the owner then asks it:
//   - holds(block): the owner holds the block cached (released to it): this release is a
//     double release, rejected;
//   - otherwise the owner's record of the block as leased is stale from now on: revoke()
//     posts the block to the owner's mailbox, and the owner drops that record before its
//     next release (a full mailbox: every leased record, counted in overflows_).
// Ordering: the owner writes a slot (release) before its release returns, and clears it
// only after the block is back in the tier (or live again for the owner's own request); the
// tier reads the slots (acquire) under its mutex. A release ordered after the owner's (by
// the caller's own synchronisation) therefore sees the slot or finds the block free in the
// tier; two releases of one block racing each other on two threads are undefined. Slots
// move only downwards, the new position written before the old is cleared, and holds()
// scans from the top: a scan concurrent with a move still finds every block.
// The mailbox has one producer at a time (the large tier under its mutex, or a thread heap
// under its own, taking turns in revoke()) and one consumer (the cache's holder, under its
// handshake).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace vram::detail {

class LeaseOwner {
 public:
  static constexpr std::size_t kCachedSlots = 32;
  static constexpr std::size_t kMailbox = 64;

  // The owner of every thread heap's chunk (thread_heap.hpp): a block of the tier lent whole
  // to a heap, which only that heap gives back (SegmentTier::free_pieces); a deallocation of
  // it by anyone else is refused.
  static LeaseOwner& heap_chunks() noexcept {
    static LeaseOwner owner;
    return owner;
  }
  bool holds(const void* block) const noexcept {
    for (std::size_t i = kCachedSlots; i-- > 0;) {
      if (slots_[i].load(std::memory_order_acquire) == block) return true;
    }
    return false;
  }
  // Under the large tier's mutex or a thread heap's (thread_heap.hpp): producers take turns
  // on a spin flag of their own, so the mailbox still has one producer at a time.
  void revoke(void* block) noexcept {
    while (producing_.test_and_set(std::memory_order_acquire)) {
    }
    const std::uint64_t head = mail_head_.load(std::memory_order_relaxed);
    if (head - mail_tail_.load(std::memory_order_acquire) >= kMailbox) {
      overflows_.fetch_add(1, std::memory_order_release);
    } else {
      mail_[head % kMailbox].store(block, std::memory_order_relaxed);
      mail_head_.store(head + 1, std::memory_order_release);
    }
    producing_.clear(std::memory_order_release);
  }

 protected:
  // The holder's side: `forget_all()` when the mailbox overflowed since the last call, then
  // `forget(block)` for each block posted.
  template <class ForgetAll, class Forget>
  void read_mail(ForgetAll forget_all, Forget forget) noexcept {
    if (const std::uint32_t seen = overflows_.load(std::memory_order_acquire);
        seen != seen_overflows_) [[unlikely]] {
      seen_overflows_ = seen;
      forget_all();
    }
    const std::uint64_t head = mail_head_.load(std::memory_order_acquire);
    std::uint64_t tail = mail_tail_.load(std::memory_order_relaxed);
    if (head == tail) [[likely]]
      return;
    for (; tail != head; ++tail) forget(mail_[tail % kMailbox].load(std::memory_order_relaxed));
    mail_tail_.store(tail, std::memory_order_release);
  }

  std::array<std::atomic<void*>, kCachedSlots> slots_{};  // cached blocks; null: empty

 private:
  std::array<std::atomic<void*>, kMailbox> mail_{};
  std::atomic<std::uint64_t> mail_head_{0};  // written by the producer
  std::atomic<std::uint64_t> mail_tail_{0};  // written by the holder
  std::atomic<std::uint32_t> overflows_{0};
  std::atomic_flag producing_;        // clear: no producer in revoke()
  std::uint32_t seen_overflows_ = 0;  // the holder's
};

}  // namespace vram::detail
