// vram/detail/tier_mutex.hpp: the segment tier's mutex: one compare-exchange to lock and
// one exchange to unlock when uncontended, inline; a holder may block (the virtual-memory
// tier maps under it, a driver call), so a contended lock spins briefly, then sleeps in
// std::atomic::wait (a futex on Linux) instead of spinning on.
//
// State: 0 free; 1 held, no thread asleep on it; 2 held, a thread may be asleep. A thread
// that goes to sleep first sets 2 (and then owns the lock once it finds the state was 0),
// so an unlock that finds 2 wakes one sleeper; one that finds 1 needs no system call.
// (U. Drepper, "Futexes Are Tricky", mutex 2.) Not recursive; BasicLockable and Lockable.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>

namespace vram::detail {

class TierMutex {
 public:
  TierMutex() = default;
  TierMutex(const TierMutex&) = delete;
  TierMutex& operator=(const TierMutex&) = delete;

  void lock() noexcept {
    std::uint32_t expected = kFree;
    if (state_.compare_exchange_strong(expected, kHeld, std::memory_order_acquire,
                                       std::memory_order_relaxed)) [[likely]] {
      return;
    }
    lock_contended();
  }
  bool try_lock() noexcept {
    std::uint32_t expected = kFree;
    return state_.compare_exchange_strong(expected, kHeld, std::memory_order_acquire,
                                          std::memory_order_relaxed);
  }
  void unlock() noexcept {
    if (state_.exchange(kFree, std::memory_order_release) == kSleepers) [[unlikely]] {
      state_.notify_one();
    }
  }

 private:
  static constexpr std::uint32_t kFree = 0;
  static constexpr std::uint32_t kHeld = 1;
  static constexpr std::uint32_t kSleepers = 2;
  static constexpr int kSpins = 64;

  [[gnu::noinline]] void lock_contended() noexcept {
    // A holder usually leaves within a few hundred instructions: spin a little first.
    for (int i = 0; i < kSpins; ++i) {
      pause();
      std::uint32_t state = state_.load(std::memory_order_relaxed);
      if (state == kFree && state_.compare_exchange_weak(state, kHeld, std::memory_order_acquire,
                                                         std::memory_order_relaxed)) {
        return;
      }
      if (state == kSleepers) break;  // others already sleep: join them
    }
    // From here this thread holds the lock only as kSleepers: it cannot tell whether
    // other threads sleep, so its unlock wakes one (at worst a spurious wake).
    while (state_.exchange(kSleepers, std::memory_order_acquire) != kFree) {
      state_.wait(kSleepers, std::memory_order_relaxed);
    }
  }
  static void pause() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield" ::: "memory");
#endif
  }

  std::atomic<std::uint32_t> state_{kFree};
};

}  // namespace vram::detail
