// src/lease_owner.hpp: what the large tier knows of the thread cache a large block was
// handed to (large_block_cache.hpp), so that a release of that block on another path (an
// other thread, the pool's slow path) stays exact without the owner taking the tier's
// mutex on its warm path.
//
// The tier files the owner with the used range (SegmentTier::allocate's `owner`). A release
// through the tier by anyone but the owner then asks it:
//   - holds(block): the owner holds the block cached (released to it): this release is a
//     double release, rejected;
//   - otherwise the owner's record of the block as leased is stale from now on: revoke()
//     counts it, and the owner drops its leased records at its next release (then those
//     releases go through the tier, which decides).
// Ordering: the owner writes a slot (release) before its release returns and clears it
// before the block leaves its cache; the tier reads the slots (acquire) under its mutex. A
// release ordered after the owner's (by the caller's own synchronisation) therefore sees
// the slot; two releases of one block racing each other on two threads are undefined.
// Slots move only downwards, the new position written before the old is cleared, and
// holds() scans from the top: a scan concurrent with a move still finds every block.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace vram::detail {

class LeaseOwner {
 public:
  static constexpr std::size_t kSlots = 32;

  bool holds(const void* block) const noexcept {
    for (std::size_t i = kSlots; i-- > 0;) {
      if (slots_[i].load(std::memory_order_acquire) == block) return true;
    }
    return false;
  }
  void revoke() noexcept { revocations_.fetch_add(1, std::memory_order_release); }

 protected:
  std::array<std::atomic<void*>, kSlots> slots_{};  // cached blocks; null: empty
  std::atomic<std::uint32_t> revocations_{0};
};

}  // namespace vram::detail
