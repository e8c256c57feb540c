// vram/detail/asymmetric_barrier.hpp: an asymmetric memory barrier (not a stream marker: see
// vram/stream_fence.hpp for those), for a Dekker handshake whose frequent side pays no locked
// instruction (the owner of a thread cache) and whose rare side pays for both (a stealer).
//
// The handshake. Two threads each store to one word and then load the other's word:
//
//   owner (every pool call)                 stealer (trim(), pool destruction)
//   state.store(kOwner)       (A)           flag.store(kStealing)     (C)
//   light()                                 heavy()
//   if flag.load() != 0: back off (B)       if state.load() == kOwner: wait (D)
//
// Correctness requires that the two loads cannot both miss the other side's store: either
// (B) sees the flag or (D) sees kOwner (or a later value of state). Plain stores and loads
// do not promise that: a CPU (x86 too) may let a load pass an earlier store to another
// address (store buffering), and the compiler may reorder them.
//
// The three modes (chosen once per process at the first pool's construction; each pool
// keeps the mode it was built with, so both sides of one pool's caches always agree):
//  - "membarrier" (Linux with MEMBARRIER_CMD_PRIVATE_EXPEDITED registered):
//    light() = std::atomic_signal_fence (compiler only: keeps A before B in the program),
//    heavy() = membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED). The kernel makes every CPU
//    running a thread of this process execute a full memory barrier before the call
//    returns, and a thread that is not running passes through the scheduler's full
//    barrier before it runs again. So in the owner's instruction stream there is a point P
//    where it behaves as if it executed a seq_cst fence, ordered after C (the stealer's
//    own barrier inside the syscall publishes C before the IPIs are sent) and before D.
//    If P falls after A, A is globally visible before the syscall returns, so D sees
//    kOwner or a later value. If P falls before A, then B (after A in program order, the
//    signal fence keeps the compiler from hoisting it) executes after P and so after C
//    became visible: B sees the flag. Either way at least one side sees the other.
//  - full_barrier, printed "full barrier" (membarrier unavailable: old kernel, seccomp, not Linux):
//    light() and heavy() are both std::atomic_thread_fence(seq_cst): the classic symmetric
//    Dekker, correct by the C++ fence rules (two seq_cst fences order a store-load pair on
//    each side). The owner then pays one full fence per call, about what a locked
//    instruction costs.
//  - "seq_cst (TSan)" (ThreadSanitizer builds): TSan models neither membarrier nor
//    fences, so A, B, C and D themselves are seq_cst (kDekkerStore / kDekkerLoad below)
//    and light()/heavy() do nothing; the total order of seq_cst operations gives the same
//    either/or, and TSan sees every handoff as a reads-from of a release store (the
//    owner's kFree on exit, the stealer's flag clear).
//
// What follows either/or (the protocol, ThreadCache in src/device_pool/thread_cache.hpp):
//  - The owner that saw no flag at B owns the data until it stores kFree (release). A
//    stealer that sets the flag later waits at D until it reads that kFree (acquire), so
//    it sees all of the owner's writes.
//  - A stealer that read kFree at D (so its flag is visible to every later B) owns the
//    data until it clears the flag (release); an owner that arrived meanwhile read the
//    flag at B, stored kFree without touching the data and waits until it reads the
//    cleared flag (acquire), so it sees the stealer's writes.
//  - heavy() covers every flag stored before it: a stealer may flag many caches, call
//    heavy() once, and then visit each.
//
// If the membarrier syscall fails after a successful registration (it can only fail for
// lack of kernel memory then), heavy() retries it, yielding in between: the owners of a
// pool in membarrier mode run no hardware fence, so no other barrier would be correct.
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__SANITIZE_THREAD__)
#define VRAM_DETAIL_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define VRAM_DETAIL_TSAN 1
#endif
#endif
#ifndef VRAM_DETAIL_TSAN
#define VRAM_DETAIL_TSAN 0
#endif

namespace vram::detail {

enum class BarrierMode : std::uint8_t { membarrier, full_barrier, seq_cst };

// "membarrier", "full barrier" or "seq_cst (TSan)".
const char* barrier_mode_name(BarrierMode mode) noexcept;

// The mode this process gives new pools: membarrier when it could be registered (tried
// once, on the first call), else full_barrier; seq_cst in ThreadSanitizer builds.
BarrierMode default_barrier_mode() noexcept;

// The name of the mode new pools use (for `vram info` and benchmarks).
const char* asymmetric_barrier_mode() noexcept;

// Tests and benchmarks only: pools constructed from now on use `mode` (existing pools keep
// theirs). Returns false and changes nothing when `mode` cannot be used here (membarrier
// not registered; any mode but seq_cst under TSan, and seq_cst outside TSan).
bool force_barrier_mode_for_testing(BarrierMode mode) noexcept;
// Undoes force_barrier_mode_for_testing: new pools use default_barrier_mode() again.
void reset_barrier_mode_for_testing() noexcept;
// The mode a pool constructed now takes (the forced one, else the default).
BarrierMode barrier_mode_for_new_pool() noexcept;

// The membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) call (retried until it succeeds).
void membarrier_heavy() noexcept;

// Memory orders of the handshake's own store and load (A/C and B/D above).
inline constexpr std::memory_order kDekkerStore =
    VRAM_DETAIL_TSAN ? std::memory_order_seq_cst : std::memory_order_relaxed;
inline constexpr std::memory_order kDekkerLoad =
    VRAM_DETAIL_TSAN ? std::memory_order_seq_cst : std::memory_order_acquire;

// Both barriers of one pool. Immutable after construction: the branch on the mode is
// perfectly predictable and both sides of a handshake use the same object.
class AsymmetricBarrier {
 public:
  explicit AsymmetricBarrier(BarrierMode mode) noexcept : mode_(mode) {}
  BarrierMode mode() const noexcept { return mode_; }

  // The frequent side, between its store and its load.
  void light() const noexcept {
#if !VRAM_DETAIL_TSAN
    if (mode_ == BarrierMode::membarrier) [[likely]] {
      std::atomic_signal_fence(std::memory_order_seq_cst);
    } else {
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
#endif
  }

  // The rare side, between its store(s) and its load(s).
  void heavy() const noexcept {
#if !VRAM_DETAIL_TSAN
    if (mode_ == BarrierMode::membarrier) {
      membarrier_heavy();
    } else {
      std::atomic_thread_fence(std::memory_order_seq_cst);
    }
#endif
  }

 private:
  BarrierMode mode_;
};

}  // namespace vram::detail
