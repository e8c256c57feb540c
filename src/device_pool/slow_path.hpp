// src/device_pool/slow_path.hpp: the slow path of one DevicePool: the mutex that serialises the
// calls made without a usable thread cache (DevicePoolCore::claim_own_cache found none: the
// thread's directory is gone, or the host is out of memory) and every call once the pool is
// closed, and the counters of the blocks those calls handed out and took back.
//
// Rules:
// - Lock order (the pool's): this mutex first, then the registry's steal mutex, then the
//   registry's own lock / a tier's growth mutex, then that tier's mutex (segment_tier.hpp);
//   the quiescer's mutex (quiescer.hpp) after this one, before a tier's and the wants' mutex;
//   the validation's (deallocation_validation.hpp) after every other.
// - The counters are written only under this mutex: one writer at a time, so an update is a
//   relaxed load and store (bump(), thread_cache.hpp). totals() reads them with relaxed loads:
//   exact under the mutex (close()), exact when no call runs at the same moment (stats()).
// - The core's orphaned mode (orphaned_pool.hpp) is read and changed only under this mutex.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>

#include "thread_cache.hpp"

namespace vram::detail {

class SlowPath {
 public:
  // BasicLockable: `std::lock_guard lock(slow_path);`.
  void lock() { mutex_.lock(); }
  void unlock() noexcept { mutex_.unlock(); }

  // Under the lock: a block of `block_bytes` handed out, or taken back.
  void count_acquire(std::uint64_t block_bytes) noexcept {
    bump(acquires_, 1);
    bump(acquired_bytes_, block_bytes);
  }
  void count_deallocation(std::uint64_t block_bytes) noexcept {
    bump(deallocations_, 1);
    bump(deallocated_bytes_, block_bytes);
  }

  struct Totals {
    std::uint64_t acquires = 0;
    std::uint64_t deallocations = 0;
    std::uint64_t acquired_bytes = 0;
    std::uint64_t deallocated_bytes = 0;
  };
  Totals totals() const noexcept {
    return Totals{.acquires = acquires_.load(std::memory_order_relaxed),
                  .deallocations = deallocations_.load(std::memory_order_relaxed),
                  .acquired_bytes = acquired_bytes_.load(std::memory_order_relaxed),
                  .deallocated_bytes = deallocated_bytes_.load(std::memory_order_relaxed)};
  }

 private:
  std::mutex mutex_;
  std::atomic<std::uint64_t> acquires_{0};
  std::atomic<std::uint64_t> deallocations_{0};
  std::atomic<std::uint64_t> acquired_bytes_{0};
  std::atomic<std::uint64_t> deallocated_bytes_{0};
};

}  // namespace vram::detail
