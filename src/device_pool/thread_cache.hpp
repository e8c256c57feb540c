// src/device_pool/thread_cache.hpp: tier 1 of DevicePool, one thread's small blocks for one pool,
// and the handshake that lets trim() and pool destruction take them without a lock on the owner's
// side.
//
// Ownership handshake: two words, no locked instruction on the owner's side (a Dekker
// handshake over an asymmetric memory barrier, vram/detail/asymmetric_barrier.hpp, which argues
// why at least one side always sees the other).
//   `state` is written only by the owner thread (its thread; at thread exit retire(), on
//   that thread; later the thread that adopts the cache): kOwner for the length of one
//   pool call, kFree otherwise (a release store).
//   `steal` is written only by a stealer holding the registry's steal mutex (trim(), close();
//   thread_cache_registry.hpp):
//   kStealing for the length of a steal, kNoSteal after it (a release store), kClosed for good
//   once the pool is being destroyed.
// Invariant: the bins, the tag and cached_bytes are touched only by
//   - the owner, between a claim (state = kOwner, light barrier, steal read as kNoSteal)
//     and its store of kFree; a claim that reads any other steal value stores kFree
//     without touching them, waits until steal is no longer kStealing, and either retries
//     or, on kClosed, takes the pool's slow path (nullptr);
//   - a stealer, between reading state == kFree (acquire) after its flag store and one
//     heavy barrier, and its clear of the flag (or, for close(), for good);
//   - anyone once the core is single-threaded (its destructor).
// The owner's counters (acquires, ...) are written only by the owner (stats() reads them).
// trim() waits for an owner inside a short call and asks an owner inside a call that may
// block (in_slow_call) to flush on its way out (that owner empties its own bins, so the
// stealer skips the cache). close() waits for every call in progress.
//
// Large blocks (above small_tier.max_block_bytes) are cached apart, by exact size, each with
// its own stream (`large`, large_block_cache.hpp), under the same handshake.
//
// Stream tag: every block in the bins may be used by work on stream `tag` at once; with
// kUntagged, by any stream (its work has completed). A stream-ordered free on another
// stream first moves the bins to their tiers under their old tag.
//
// Which cache is the calling thread's: tl_last names the cache of the pool this thread
// used last (the warm paths look only there); the thread's directory (thread_cache.cpp)
// holds the others, and retires them when the thread exits.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include "large_block_cache.hpp"
#include "stream_ages.hpp"
#include "thread_heap.hpp"
#include "tier/contention_watch.hpp"
#include "tier/segment_tier.hpp"
#include "vram/detail/asymmetric_barrier.hpp"
#include "vram/detail/mpmc_ring.hpp"

// The thread-local model GCC gives a variable defined in the same translation unit: in a
// position-dependent or position-independent executable, local-exec (one instruction per
// read); in a shared object (the plug-in's copy of the library), the default dynamic model.
// See CMakeLists.txt (TLS) for why the plug-in must not use the static models.
#if defined(__PIE__) || !defined(__PIC__)
#define VRAM_DETAIL_TLS_MODEL [[gnu::tls_model("local-exec")]]
#else
#define VRAM_DETAIL_TLS_MODEL
#endif

namespace vram::detail {

inline constexpr std::size_t kMaxThreadCacheDepth = 16;

// Update of a counter written only by the holder of its cache's state word (or under
// the slow path's mutex, slow_path.hpp): a relaxed load + store is exact and needs no locked
// instruction; stats() reads it concurrently.
inline void bump(std::atomic<std::uint64_t>& counter, std::uint64_t delta) noexcept {
  counter.store(counter.load(std::memory_order_relaxed) + delta, std::memory_order_relaxed);
}

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// Spins briefly, then yields: the thread waited for may be descheduled (more threads than
// cores), and spinning through its time slice would only delay it.
class Backoff {
 public:
  void pause() noexcept {
    if (++spins_ < 64) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }

 private:
  unsigned spins_ = 0;
};

struct ThreadCache {
  enum : std::uint32_t { kFree = 0, kOwner = 1 };                     // state
  enum : std::uint32_t { kNoSteal = 0, kStealing = 1, kClosed = 2 };  // steal
  // One bin per small class; `limit` is the depth the options allow for the class (0 for
  // a class the thread cache does not keep), so the warm paths test only the count.
  struct Bin {
    std::uint32_t count = 0;
    std::uint32_t limit = 0;
    void* blocks[kMaxThreadCacheDepth] = {};
  };
  ThreadCache(std::size_t classes, std::size_t cached_classes, std::size_t depth) : bins(classes) {
    for (std::size_t index = 0; index < cached_classes; ++index) {
      bins[index].limit = static_cast<std::uint32_t>(depth);
    }
  }

  alignas(kCacheLine) std::atomic<std::uint32_t> state{kFree};
  std::atomic<std::uint32_t> steal{kNoSteal};
  std::atomic<bool> flush_requested{false};
  std::atomic<bool> in_slow_call{false};
  StreamKey tag = kUntagged;
  // The bound of cached_bytes: thread_cache.max_bytes from the owner's registration (a new
  // owner of an adopted cache starts there again), raised to max(max_bytes,
  // contended_max_bytes) when its heaps turn on (DevicePoolCore::start_heap). Written and read
  // only by the owner, and by the registry under its lock before the owner's first claim.
  std::uint64_t max_bytes = 0;
  std::vector<Bin> bins;
  std::atomic<std::uint64_t> acquires{0};
  std::atomic<std::uint64_t> deallocations{0};
  std::atomic<std::uint64_t> acquired_bytes{0};
  std::atomic<std::uint64_t> deallocated_bytes{0};
  std::atomic<std::uint64_t> cached_bytes{0};
  LargeBlockCache large;
  // The thread's heap of large blocks (thread_heap.hpp), once it has one; owned by the
  // pool's ThreadHeaps, kept with the cache when another thread adopts it.
  ThreadHeap* heap = nullptr;
  // The same over the small tier (its classes' blocks that bins and rings do not serve).
  ThreadHeap* small_heap = nullptr;
  // The heaps serve this thread's requests (it met other threads on a tier); an adopting
  // thread starts without (its frees still reach them).
  bool heaps_on = false;
  // Whether the small tier's mutex was contended between two of this thread's calls (what
  // starts its heaps, DevicePoolCore::note_small_contentions).
  ContentionWatch small_contentions;
  // The stream the heap serves (besides requests without a stream): the one the thread has
  // asked on kHeapStreak times in a row (DevicePoolCore::heap_serves).
  StreamKey heap_home = kUntagged;
  StreamKey heap_candidate = kUntagged;
  std::uint32_t heap_streak = 0;
  std::uint32_t heap_checks = 0;     // requests on heap_home since its stream was last named
  std::uint64_t heap_stream_id = 0;  // StreamFence::stream_id of the candidate, then the home
  bool heap_streams_churn = false;   // streams came and went behind one handle: no home
  // The caller streams this thread frees on, young or steady (stream_ages.hpp): a young one's
  // key never tags the cache.
  StreamAges stream_ages;
};

// Marks the holder of `cache` as inside a call that may block (see ThreadCache).
// Sections nest (a growth's flush gives memory back inside the growth's section): one restores
// what it found, so an inner one never ends the outer one's (only the holder writes the flag).
class SlowSection {
 public:
  explicit SlowSection(ThreadCache* cache) noexcept : cache_(cache) {
    if (cache_ == nullptr) return;
    outer_ = cache_->in_slow_call.load(std::memory_order_relaxed);
    cache_->in_slow_call.store(true, std::memory_order_seq_cst);
  }
  ~SlowSection() {
    if (cache_ != nullptr) cache_->in_slow_call.store(outer_, std::memory_order_seq_cst);
  }
  SlowSection(const SlowSection&) = delete;
  SlowSection& operator=(const SlowSection&) = delete;

 private:
  ThreadCache* cache_;
  bool outer_ = false;
};

// The pool this thread used last and its cache there (cache is not null when uid is not 0).
struct LastPool {
  std::uint64_t uid = 0;
  ThreadCache* cache = nullptr;
};
// Defined in thread_cache.cpp; constinit, so a read from another translation unit needs no
// initialization check (one thread-pointer access for both words, see CMakeLists.txt: TLS).
extern thread_local constinit LastPool tl_last VRAM_DETAIL_TLS_MODEL;

// The owner's claim of its cache when a stealer is about (steal was not kNoSteal): steps
// back, waits for the steal to end, and retries; null once the pool is closed.
ThreadCache* claim_contended(ThreadCache& cache, const AsymmetricBarrier& barrier) noexcept;

// The owner's claim of its cache: the cache, or null once the pool is closed.
inline ThreadCache* claim(ThreadCache& cache, const AsymmetricBarrier& barrier) noexcept {
  cache.state.store(ThreadCache::kOwner, kDekkerStore);
  barrier.light();
  if (cache.steal.load(kDekkerLoad) == ThreadCache::kNoSteal) [[likely]] {
    return &cache;
  }
  return claim_contended(cache, barrier);
}

// The warm paths' claim: only the cache of pool `uid` when this thread used it last, only
// when no stealer is about. Null: nothing is claimed (the state word is back to kFree) and the
// caller takes its slow path, which registers, waits for a stealer or finds the pool
// closed. Calls nothing, so the warm paths need no stack frame.
inline ThreadCache* claim_warm(std::uint64_t uid, const AsymmetricBarrier& barrier) noexcept {
  if (tl_last.uid != uid) [[unlikely]]
    return nullptr;
  ThreadCache* cache = tl_last.cache;
  cache->state.store(ThreadCache::kOwner, kDekkerStore);
  barrier.light();
  if (cache->steal.load(kDekkerLoad) == ThreadCache::kNoSteal) [[likely]]
    return cache;
  cache->state.store(ThreadCache::kFree, std::memory_order_release);
  return nullptr;
}

}  // namespace vram::detail
