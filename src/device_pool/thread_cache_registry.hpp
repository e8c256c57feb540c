// src/device_pool/thread_cache_registry.hpp: every ThreadCache of one DevicePool, for the threads
// that register and for the stealers (trim(), the flush of large caches before a growth, close()).
//
// Rule: a cache is registered once per thread and pool and never freed before the
// registry: an exited thread's cache is parked, empty, and adopted by the next thread that
// registers, so raw pointers to caches stay valid for the pool's life. Once closed, no cache
// registers: the list is frozen and frozen() may be walked without the lock (close() waits
// for owners that may themselves take the lock, so it must not hold it).
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "thread_cache.hpp"

namespace vram::detail {

class ThreadCacheRegistry {
 public:
  // What a new cache holds: `classes` bins, of which the first `cached_classes` keep up to
  // `depth` blocks; whether its large blocks' cache starts on (large_block_cache.hpp).
  struct Shape {
    std::size_t classes = 0;
    std::size_t cached_classes = 0;
    std::size_t depth = 0;
    bool large_from_start = false;
    std::uint64_t max_bytes = 0;  // the bins' byte bound of a thread alone
  };
  // Set once, before any thread registers (the core's constructor).
  void set_shape(const Shape& shape) noexcept { shape_ = shape; }

  // A cache for the calling thread: a parked one, else a new one of the registry's shape;
  // null once closed. Its large blocks' cache restarts (it is the new thread's own, not
  // the exited thread's whose cache it adopts). Throws std::bad_alloc.
  ThreadCache* adopt_or_create() {
    std::lock_guard lock(mutex_);
    if (closed_) return nullptr;
    ThreadCache* cache = nullptr;
    if (!spare_.empty()) {
      cache = spare_.back();
      spare_.pop_back();
    } else {
      caches_.push_back(
          std::make_unique<ThreadCache>(shape_.classes, shape_.cached_classes, shape_.depth));
      cache = caches_.back().get();
    }
    cache->large.restart(shape_.large_from_start);
    // Its heaps stay (with the blocks they hold) but serve the new thread only once it, too,
    // meets other threads on a tier: a thread alone places blocks as without heaps.
    cache->heaps_on = false;
    cache->max_bytes = shape_.max_bytes;
    cache->small_contentions.reset();  // counted from the new thread's first call
    cache->heap_home = kUntagged;
    cache->heap_candidate = kUntagged;
    cache->heap_streak = 0;
    cache->heap_streams_churn = false;
    cache->stream_ages.clear();  // the new thread's streams are its own
    return cache;
  }
  // An exited thread's cache, emptied by its owner: adoptable from now on.
  void park(ThreadCache* cache) noexcept {
    std::lock_guard lock(mutex_);
    try {
      spare_.push_back(cache);
    } catch (...) {  // not adoptable; it stays empty and counted
    }
  }
  // The caches registered so far that `keep` accepts. Throws std::bad_alloc.
  template <class Keep>
  std::vector<ThreadCache*> snapshot(Keep keep) const {
    std::lock_guard lock(mutex_);
    std::vector<ThreadCache*> list;
    list.reserve(caches_.size());
    for (const auto& cache : caches_) {
      if (keep(*cache)) list.push_back(cache.get());
    }
    return list;
  }
  // Calls `visit` on every cache, under the lock (a reader of counters).
  template <class Visit>
  void for_each(Visit visit) const {
    std::lock_guard lock(mutex_);
    for (const auto& cache : caches_) visit(static_cast<const ThreadCache&>(*cache));
  }
  // No cache registers from now on.
  void close() noexcept {
    std::lock_guard lock(mutex_);
    closed_ = true;
  }
  // Every cache, once closed (or while the pool is single-threaded: its destructor).
  const std::vector<std::unique_ptr<ThreadCache>>& frozen() const noexcept { return caches_; }
  // One stealer at a time: its holder writes every ThreadCache::steal. Lock order: before
  // the registry's own lock and a tier's growth mutex.
  std::mutex& steal_mutex() noexcept { return steal_mutex_; }

  // The stealer's side of the handshake (thread_cache.hpp) for trim() and the flush of large
  // caches, the caller holding steal_mutex(): raises `steal` on every cache of `caches` (none
  // closed: close() owns those), then one heavy barrier for all of them, then per cache waits
  // until its owner is out (state read kFree: take(cache)) or, while the owner is inside a
  // call that may block (in_slow_call), asks busy(cache) whether to leave the cache (true) or
  // look again at once (false); then clears the flag.
  // Invariant: a cache's blocks are touched by take() only between the flag's store and its
  // clear, after state read kFree following the heavy barrier: an owner that claims later
  // sees the flag (its light barrier pairs with the heavy one) and steps back, one that
  // claimed earlier is seen as kOwner. busy() may touch only the atomics the owner reads on
  // its way out; the seq_cst stores and loads of in_slow_call here and in SlowSection make
  // one side see the other.
  template <class Take, class Busy>
  void steal(const std::vector<ThreadCache*>& caches, const AsymmetricBarrier& barrier, Take take,
             Busy busy) noexcept {
    for (ThreadCache* cache : caches) cache->steal.store(ThreadCache::kStealing, kDekkerStore);
    if (!caches.empty()) barrier.heavy();
    for (ThreadCache* cache : caches) {
      Backoff backoff;
      for (;;) {
        if (cache->state.load(kDekkerLoad) == ThreadCache::kFree) {
          take(*cache);
          break;
        }
        if (cache->in_slow_call.load(std::memory_order_seq_cst)) {
          if (busy(*cache)) break;
          continue;
        }
        backoff.pause();
      }
      cache->steal.store(ThreadCache::kNoSteal, std::memory_order_release);
    }
  }

 private:
  std::mutex steal_mutex_;
  mutable std::mutex mutex_;  // guards caches_, spare_, closed_
  std::vector<std::unique_ptr<ThreadCache>> caches_;
  std::vector<ThreadCache*> spare_;  // of exited threads, empty, adoptable
  Shape shape_;
  bool closed_ = false;
};

}  // namespace vram::detail
