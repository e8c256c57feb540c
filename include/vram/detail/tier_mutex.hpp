// vram/detail/tier_mutex.hpp: the segment tiers' mutex: one compare-exchange to lock and
// one exchange to unlock when uncontended, inline; a holder may block (a tier growing past
// its budget waits for stream markers under it; upstream calls are made outside it), so a
// contended lock spins, then sleeps in std::atomic::wait (a futex on Linux) instead of
// spinning on.
//
// State: 0 free; 1 held, no thread asleep on it; 2 held, a thread may be asleep. A thread
// that goes to sleep first sets 2 (and then owns the lock once it finds the state was 0),
// so an unlock that finds 2 wakes one sleeper; one that finds 1 needs no system call.
// (U. Drepper, "Futexes Are Tricky", mutex 2.) Not recursive; BasicLockable and Lockable.
//
// No convoy: a spinning thread takes the lock whenever it finds it free, also while others
// sleep (a woken sleeper that finds it taken again sets 2 and sleeps on, so no wake-up is
// lost), and a spinner never joins the sleepers early because some already sleep. A
// critical section is far shorter than a futex sleep and wake; handing the lock to a
// sleeper on every unlock (which joining the sleepers at once amounts to) would make every
// hand-off cost a wake-up and a reschedule while the running threads wait behind it. The
// spin covers a queue of running threads each holding it briefly; a holder that blocks on a
// marker outlasts it, and then its waiters sleep.
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
  // How many lock() calls found it already locked (relaxed; wraps): whether threads meet here.
  std::uint32_t contentions() const noexcept {
    return contentions_.load(std::memory_order_relaxed);
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
  // Pause instructions between checks before a waiter sleeps: long enough for a queue of
  // running threads to pass the lock through many short critical sections.
  static constexpr int kSpins = 1024;

  // Spins until the lock is seen free (true) or the spin is over (false).
  bool spin_until_free() const noexcept {
    for (int i = 0; i < kSpins; ++i) {
      if (state_.load(std::memory_order_relaxed) == kFree) return true;
      pause();
    }
    return false;
  }

  [[gnu::noinline]] void lock_contended() noexcept {
    contentions_.fetch_add(1, std::memory_order_relaxed);
    // Test and test-and-set while the holder runs: barging (see the header comment).
    while (spin_until_free()) {
      std::uint32_t expected = kFree;
      if (state_.compare_exchange_weak(expected, kHeld, std::memory_order_acquire,
                                       std::memory_order_relaxed)) {
        return;
      }
    }
    // From here this thread holds the lock only as kSleepers: it cannot tell whether
    // other threads sleep, so its unlock wakes one (at worst a spurious wake). Woken, it
    // spins again before it sleeps again: the lock may have been taken by a spinner.
    while (state_.exchange(kSleepers, std::memory_order_acquire) != kFree) {
      state_.wait(kSleepers, std::memory_order_relaxed);
      (void)spin_until_free();
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
  std::atomic<std::uint32_t> contentions_{0};  // written only by contended lock() calls
};

}  // namespace vram::detail
