// src/device_pool/orphaned_pool.hpp: the mode of a DevicePool destroyed while blocks are still
// leased.
//
// The core then keeps itself alive (a reference to itself) until the last leased block is
// back. Every call takes the slow path (the thread caches are closed): a request throws, a
// deallocation gives wholly free segments straight back to the upstream. Every member function
// is called under the lock of the core's slow path (slow_path.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

namespace vram::detail {

class DevicePoolCore;

class OrphanedPool {
 public:
  bool active() const noexcept { return active_; }
  // The pool was destroyed with `blocks` (> 0) leased; `self` keeps the core alive.
  void begin(std::uint64_t blocks, std::shared_ptr<DevicePoolCore> self) noexcept {
    active_ = true;
    outstanding_ = blocks;
    self_ = std::move(self);
  }
  // One leased block is back: the self reference when it was the last. The caller drops it
  // after it unlocked the slow path (that may destroy the core).
  std::shared_ptr<DevicePoolCore> block_returned() noexcept {
    return --outstanding_ == 0 ? std::move(self_) : nullptr;
  }

 private:
  bool active_ = false;
  std::uint64_t outstanding_ = 0;
  std::shared_ptr<DevicePoolCore> self_;  // set while blocks are outstanding
};

}  // namespace vram::detail
