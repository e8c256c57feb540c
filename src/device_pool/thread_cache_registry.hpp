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
  // A cache for the calling thread: a parked one, else a new one with `classes` bins of
  // which the first `cached_classes` hold up to `depth` blocks; null once closed. Its large
  // blocks' cache restarts with `large_from_start` (it is the new thread's own). Throws
  // std::bad_alloc.
  ThreadCache* adopt_or_create(std::size_t classes, std::size_t cached_classes, std::size_t depth,
                               bool large_from_start) {
    std::lock_guard lock(mutex_);
    if (closed_) return nullptr;
    ThreadCache* cache = nullptr;
    if (!spare_.empty()) {
      cache = spare_.back();
      spare_.pop_back();
    } else {
      caches_.push_back(std::make_unique<ThreadCache>(classes, cached_classes, depth));
      cache = caches_.back().get();
    }
    cache->large.restart(large_from_start);
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

 private:
  std::mutex steal_mutex_;
  mutable std::mutex mutex_;  // guards caches_, spare_, closed_
  std::vector<std::unique_ptr<ThreadCache>> caches_;
  std::vector<ThreadCache*> spare_;  // of exited threads, empty, adoptable
  bool closed_ = false;
};

}  // namespace vram::detail
