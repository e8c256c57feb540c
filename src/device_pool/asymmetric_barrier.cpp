#include "vram/detail/asymmetric_barrier.hpp"

#include <atomic>
#include <cerrno>
#include <thread>

#if defined(__linux__) && __has_include(<linux/membarrier.h>)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>
#define VRAM_DETAIL_HAVE_MEMBARRIER 1
#else
#define VRAM_DETAIL_HAVE_MEMBARRIER 0
#endif

namespace vram::detail {
namespace {

#if VRAM_DETAIL_HAVE_MEMBARRIER
long membarrier_call(int command) noexcept { return syscall(__NR_membarrier, command, 0U); }
#endif

// Registers this process for private expedited membarrier; true when it can be used.
// Registration is process-wide and permanent, so trying once is enough.
bool register_membarrier() noexcept {
#if VRAM_DETAIL_HAVE_MEMBARRIER && !VRAM_DETAIL_TSAN
  const long supported = membarrier_call(MEMBARRIER_CMD_QUERY);
  if (supported < 0 || (supported & MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return false;
  if (membarrier_call(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) != 0) return false;
  // One call now, so that a filter that allows the registration but not the barrier
  // (seccomp) is found before any pool relies on it.
  return membarrier_call(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0;
#else
  return false;
#endif
}

bool membarrier_registered() noexcept {
  static const bool registered = register_membarrier();
  return registered;
}

// -1: no forced mode; else a BarrierMode.
std::atomic<int> forced_mode{-1};

}  // namespace

const char* barrier_mode_name(BarrierMode mode) noexcept {
  switch (mode) {
    case BarrierMode::membarrier:
      return "membarrier";
    case BarrierMode::full_barrier:
      return "full barrier";
    case BarrierMode::seq_cst:
      return "seq_cst (TSan)";
  }
  return "unknown";
}

BarrierMode default_barrier_mode() noexcept {
  if (VRAM_DETAIL_TSAN) return BarrierMode::seq_cst;
  return membarrier_registered() ? BarrierMode::membarrier : BarrierMode::full_barrier;
}

const char* asymmetric_barrier_mode() noexcept {
  return barrier_mode_name(barrier_mode_for_new_pool());
}

bool force_barrier_mode_for_testing(BarrierMode mode) noexcept {
  const bool usable = VRAM_DETAIL_TSAN
                          ? mode == BarrierMode::seq_cst
                          : mode == BarrierMode::full_barrier ||
                                (mode == BarrierMode::membarrier && membarrier_registered());
  if (!usable) return false;
  forced_mode.store(static_cast<int>(mode), std::memory_order_release);
  return true;
}

void reset_barrier_mode_for_testing() noexcept { forced_mode.store(-1, std::memory_order_release); }

BarrierMode barrier_mode_for_new_pool() noexcept {
  const int forced = forced_mode.load(std::memory_order_acquire);
  return forced >= 0 ? static_cast<BarrierMode>(forced) : default_barrier_mode();
}

void membarrier_heavy() noexcept {
#if VRAM_DETAIL_HAVE_MEMBARRIER
  // Only a pool built in membarrier mode calls this, so the process is registered (the
  // registration survives fork(); only exec() drops it, and no pool survives exec). The
  // call can then fail only for lack of kernel memory (ENOMEM). Its owners run no hardware
  // memory barrier, so no other barrier would do: retry (registering again should EPERM say the
  // registration is gone).
  while (membarrier_call(MEMBARRIER_CMD_PRIVATE_EXPEDITED) != 0) {
    if (errno == EPERM) (void)membarrier_call(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED);
    std::this_thread::yield();
  }
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);  // unreachable: never this mode
#endif
}

}  // namespace vram::detail
