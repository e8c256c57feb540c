// The owner's side of the thread caches (thread_cache.hpp): the contended claim, the
// thread's directory of caches (one per pool it used) and what happens at thread exit.
// Rule: a cache is registered once per thread and pool (thread_cache_registry.hpp); at
// thread exit its owner empties it and parks it for the next thread that registers.
#include "thread_cache.hpp"

#include <memory>
#include <vector>

#include "pool_core.hpp"

namespace vram::detail {

constinit thread_local LastPool tl_last VRAM_DETAIL_TLS_MODEL;

namespace {

// Per thread: which ThreadCache belongs to which pool. tl_last is the fast path
// (the pool used last); the directory is consulted on a switch and retires the caches of
// pools still alive when the thread exits. A thread whose directory is already destroyed
// (thread_local teardown order) uses the pool's slow path and parks nothing.
thread_local bool tl_directory_gone = false;

struct ThreadDirectory {
  struct Entry {
    std::uint64_t uid;
    std::weak_ptr<DevicePoolCore> core;
    ThreadCache* cache;
  };
  std::vector<Entry> entries;

  ~ThreadDirectory() {
    tl_last = LastPool{};
    tl_directory_gone = true;
    for (Entry& entry : entries) {
      if (auto core = entry.core.lock()) core->retire(entry.cache);
    }
  }
};
thread_local ThreadDirectory tl_directory;

}  // namespace

ThreadCache* claim_contended(ThreadCache& cache, const AsymmetricBarrier& barrier) noexcept {
  Backoff backoff;
  for (;;) {
    // A steal is in progress or the pool is closing: step back without touching the bins
    // so that the stealer (waiting for kFree) may go on.
    cache.state.store(ThreadCache::kFree, std::memory_order_release);
    std::uint32_t steal = cache.steal.load(std::memory_order_acquire);
    while (steal == ThreadCache::kStealing) {
      backoff.pause();
      steal = cache.steal.load(std::memory_order_acquire);
    }
    if (steal == ThreadCache::kClosed) return nullptr;
    cache.state.store(ThreadCache::kOwner, kDekkerStore);
    barrier.light();
    if (cache.steal.load(kDekkerLoad) == ThreadCache::kNoSteal) return &cache;
  }
}

ThreadCache* DevicePoolCore::find_or_register() noexcept {
  if (tl_directory_gone) return nullptr;
  try {
    auto& entries = tl_directory.entries;
    for (auto& entry : entries) {
      if (entry.uid == uid) {
        tl_last = LastPool{uid, entry.cache};
        return entry.cache;
      }
    }
    std::erase_if(entries, [](const ThreadDirectory::Entry& e) { return e.core.expired(); });
    entries.reserve(entries.size() + 1);  // the push_back below cannot throw
    ThreadCache* cache = registry.adopt_or_create();
    if (cache == nullptr) return nullptr;  // closed
    entries.push_back({uid, weak_from_this(), cache});
    tl_last = LastPool{uid, cache};
    return cache;
  } catch (...) {  // host out of memory: this call takes the slow path
    return nullptr;
  }
}

void DevicePoolCore::retire(ThreadCache* cache) noexcept {
  // The exiting thread still owns its cache: it claims it like any call.
  if (claim(*cache, dekker) == nullptr) return;  // closed: close() took its blocks already
  drain_bins(*cache);                            // its counters stay in the cache
  (void)return_idle_chunks(cache, cache);
  cache->flush_requested.store(false, std::memory_order_relaxed);
  cache->state.store(ThreadCache::kFree, std::memory_order_release);
  registry.park(cache);
}

}  // namespace vram::detail
