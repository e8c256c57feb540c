#include "vram/device_pool.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "vram/cuda/error.hpp"
#include "vram/detail/mpmc_ring.hpp"
#include "vram/size_classes.hpp"

namespace vram::detail {
namespace {

constexpr std::size_t kMaxThreadCacheDepth = 16;

// Update of a counter written only by the holder of its cache's state word: a relaxed load
// + store is exact and needs no locked instruction; stats() reads it concurrently.
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

std::atomic<std::uint64_t> next_pool_uid{1};

}  // namespace

// Tier 1: one thread's blocks and counters for one pool.
//
// Ownership handshake (the state word). Whoever moves `state` from kFree to kOwner (its
// thread, for the length of one pool call) or kOther (trim(), for the length of a steal)
// owns the bins and the counters until it stores kFree again; the CAS is an acquire and
// the store a release, so each holder sees the previous holder's writes. The owner never
// waits for anything but a steal in progress (a few pointer moves); trim() never waits for
// an owner (it asks it to flush instead, see flush_requested). Pool destruction moves
// every state to kClosed for good (waiting for calls in progress to end); a thread that
// finds kClosed takes the pool's slow path.
struct ThreadCache {
  enum : std::uint32_t { kFree = 0, kOwner = 1, kOther = 2, kClosed = 3 };
  struct Bin {
    std::uint32_t count = 0;
    void* blocks[kMaxThreadCacheDepth] = {};
  };
  explicit ThreadCache(std::size_t classes) : bins(classes) {}

  alignas(kCacheLine) std::atomic<std::uint32_t> state{kFree};
  // Set by a trim() that found the owner inside a call: the owner frees its bins to the
  // upstream right after that call.
  std::atomic<bool> flush_requested{false};
  // Set by the owner around calls that may block (upstream calls, trim): trim() waits for
  // an owner inside a call only when this is clear, so two trimming owners never wait for
  // each other. See SlowSection.
  std::atomic<bool> in_slow_call{false};
  bool owner_alive = true;  // guarded by the pool's registry_mutex
  std::vector<Bin> bins;
  std::atomic<std::uint64_t> acquires{0};
  std::atomic<std::uint64_t> releases{0};
  std::atomic<std::uint64_t> acquired_bytes{0};
  std::atomic<std::uint64_t> released_bytes{0};
  std::atomic<std::uint64_t> cached_bytes{0};
};

// Accounting invariant (when quiescent):
//   bytes_reserved == bytes_in_use + shared_cached_bytes + sum(thread cached_bytes)
//   bytes_in_use   == sum(acquired_bytes) - sum(released_bytes)  (thread caches + slow path)
//
// Lifetime: ThreadCaches are owned by the core and live as long as it does (a cache of an
// exited thread is kept, empty, and adopted by the next thread that registers), so raw
// pointers to them stay valid. The core lives while the DevicePool handle lives, and after
// that while blocks are still leased (self_reference), see close().
struct DevicePoolCore : std::enable_shared_from_this<DevicePoolCore> {
  DevicePoolCore(std::shared_ptr<Upstream> upstream_in, const DevicePool::Options& options_in)
      : uid(next_pool_uid.fetch_add(1, std::memory_order_relaxed)),
        upstream(std::move(upstream_in)),
        options(options_in) {
    if (!upstream) throw InvalidArgument("vram::DevicePool: the upstream is null");
    upstream_alignment = upstream->alignment();
    options.thread_cache_blocks = std::min(options.thread_cache_blocks, kMaxThreadCacheDepth);
    thread_cache_classes =
        options.thread_cache_blocks == 0 || options.thread_cache_max_block_bytes == 0
            ? 0
            : SizeClasses::index_for(
                  std::min(options.thread_cache_max_block_bytes, SizeClasses::kMaxBytes)) +
                  1;
    ring_capacity = std::max<std::size_t>(options.max_cached_blocks_per_class, 1);
  }

  ~DevicePoolCore() {
    // close() has run (the handle's destructor) and every block is back: only the cache
    // remains, which close() already freed; free whatever a racing thread exit parked.
    for (auto& cache : caches) take_bins(*cache, nullptr);
    for (std::size_t index = 0; index < rings.size(); ++index) {
      MpmcRing<void*>* ring = rings[index].load(std::memory_order_acquire);
      if (ring == nullptr) continue;
      void* block = nullptr;
      while (ring->try_pop(block)) free_to_upstream(block, SizeClasses::bytes_of(index));
      delete ring;
    }
  }

  MpmcRing<void*>* ring_of(std::size_t index) const noexcept {
    return rings[index].load(std::memory_order_acquire);
  }
  // Creates the class's ring on its first release; null when the host is out of memory.
  MpmcRing<void*>* ring_for_release(std::size_t index) noexcept {
    MpmcRing<void*>* ring = rings[index].load(std::memory_order_acquire);
    if (ring != nullptr) [[likely]]
      return ring;
    MpmcRing<void*>* fresh = nullptr;
    try {
      fresh = new MpmcRing<void*>(ring_capacity);
    } catch (...) {  // std::bad_alloc from the ring or its cells: cache nothing
      return nullptr;
    }
    if (!rings[index].compare_exchange_strong(ring, fresh, std::memory_order_acq_rel)) {
      delete fresh;  // another thread won; `ring` now holds its ring
      return ring;
    }
    return fresh;
  }

  // This thread's cache, locked (kOwner); null when there is none (the thread's
  // thread_local directory is gone, registering failed, or the pool is closed).
  ThreadCache* lock_own_cache() noexcept;
  void unlock_own_cache(ThreadCache& cache) noexcept;
  ThreadCache* find_or_register() noexcept;
  void retire(ThreadCache* cache) noexcept;

  void* allocate(std::size_t bytes, std::size_t alignment);
  void deallocate(void* block, std::size_t bytes) noexcept;
  void* allocate_from_upstream(std::size_t requested, std::size_t class_bytes, ThreadCache* held);
  void* take_shared_or_upstream(std::size_t requested, std::size_t index, ThreadCache* held);
  void release_to_shared(std::size_t index, void* block, std::size_t class_bytes) noexcept;
  void free_to_upstream(void* block, std::size_t class_bytes) noexcept;
  // Moves a cache's blocks (its holder calls this) to the shared tier, or frees them to the
  // upstream when `to_shared` is null.
  struct Taken {
    std::size_t index;
    void* block;
  };
  void take_bins(ThreadCache& cache, std::vector<Taken>* out, bool to_upstream = false) noexcept;
  void put_taken(std::vector<Taken>& taken, bool to_shared) noexcept;
  // Frees cached blocks: every thread cache (idle, exited or `held`, the caller's own,
  // already locked), then the shared tier down to keep_bytes.
  void trim(std::size_t keep_bytes, ThreadCache* held) noexcept;
  // Called once by the handle's destructor. Returns true when blocks are still leased (the
  // core then keeps itself alive until the last one is released).
  bool close(std::uint64_t& blocks, std::uint64_t& bytes) noexcept;
  bool validate_release(void* block, std::size_t class_bytes) noexcept;
  DevicePoolStats stats() const;

  const std::uint64_t uid;
  std::shared_ptr<Upstream> upstream;
  DevicePool::Options options;
  std::size_t thread_cache_classes = 0;
  std::size_t upstream_alignment = 256;
  std::size_t ring_capacity = 1;
  // Tier 2: one lazily created ring per size class (at most max_cached_blocks_per_class).
  std::array<std::atomic<MpmcRing<void*>*>, SizeClasses::kCount> rings{};

  alignas(kCacheLine) std::atomic<std::size_t> shared_cached_bytes{0};
  alignas(kCacheLine) std::atomic<std::size_t> reserved_bytes{0};
  std::atomic<std::size_t> peak_reserved_bytes{0};
  std::atomic<std::uint64_t> upstream_allocations{0};
  std::atomic<std::uint64_t> upstream_frees{0};
  std::atomic<std::uint64_t> failed_upstream_allocations{0};
  std::atomic<std::uint64_t> oom_retries{0};
  std::atomic<std::uint64_t> invalid_releases{0};

  // Lock order: slow_mutex, then registry_mutex. Nobody waits for a cache's state word
  // while holding either, except close() after it has closed every cache.
  mutable std::mutex registry_mutex;  // guards caches, spare_caches, closing
  std::vector<std::unique_ptr<ThreadCache>> caches;
  std::vector<ThreadCache*> spare_caches;  // of exited threads, empty, adoptable
  bool closing = false;

  // The slow path: calls on threads without a usable cache (see lock_own_cache) and
  // every call once the pool is closed. Counters written under slow_mutex.
  std::mutex slow_mutex;
  std::atomic<std::uint64_t> slow_acquires{0};
  std::atomic<std::uint64_t> slow_releases{0};
  std::atomic<std::uint64_t> slow_acquired_bytes{0};
  std::atomic<std::uint64_t> slow_released_bytes{0};
  bool orphaned = false;                           // guarded by slow_mutex
  std::uint64_t orphan_blocks_outstanding = 0;     // guarded by slow_mutex
  std::shared_ptr<DevicePoolCore> self_reference;  // set only while orphaned

  std::mutex live_mutex;  // validate_releases only
  std::unordered_map<void*, std::size_t> live_blocks;
};

namespace {

// Per thread: which ThreadCache belongs to which pool. The two scalars are the fast path
// (the pool used last); the directory is consulted on a switch and retires the caches of
// pools still alive when the thread exits. A thread whose directory is already destroyed
// (thread_local teardown order) uses the pool's slow path and parks nothing.
thread_local std::uint64_t tl_last_uid = 0;
thread_local ThreadCache* tl_last_cache = nullptr;
thread_local bool tl_directory_gone = false;

struct ThreadDirectory {
  struct Entry {
    std::uint64_t uid;
    std::weak_ptr<DevicePoolCore> core;
    ThreadCache* cache;
  };
  std::vector<Entry> entries;

  ~ThreadDirectory() {
    tl_last_uid = 0;
    tl_last_cache = nullptr;
    tl_directory_gone = true;
    for (Entry& entry : entries) {
      if (auto core = entry.core.lock()) core->retire(entry.cache);
    }
  }
};
thread_local ThreadDirectory tl_directory;

}  // namespace

ThreadCache* DevicePoolCore::find_or_register() noexcept {
  if (tl_directory_gone) return nullptr;
  try {
    auto& entries = tl_directory.entries;
    for (auto& entry : entries) {
      if (entry.uid == uid) {
        tl_last_uid = uid;
        tl_last_cache = entry.cache;
        return entry.cache;
      }
    }
    std::erase_if(entries, [](const ThreadDirectory::Entry& e) { return e.core.expired(); });
    entries.reserve(entries.size() + 1);  // the push_back below cannot throw
    ThreadCache* cache = nullptr;
    {
      std::lock_guard lock(registry_mutex);
      if (closing) return nullptr;
      if (!spare_caches.empty()) {
        cache = spare_caches.back();
        spare_caches.pop_back();
      } else {
        caches.push_back(std::make_unique<ThreadCache>(thread_cache_classes));
        cache = caches.back().get();
      }
      cache->owner_alive = true;
    }
    entries.push_back({uid, weak_from_this(), cache});
    tl_last_uid = uid;
    tl_last_cache = cache;
    return cache;
  } catch (...) {  // host out of memory: this call takes the slow path
    return nullptr;
  }
}

inline ThreadCache* DevicePoolCore::lock_own_cache() noexcept {
  ThreadCache* cache = tl_last_uid == uid ? tl_last_cache : find_or_register();
  if (cache == nullptr) return nullptr;
  Backoff backoff;
  for (;;) {
    std::uint32_t expected = ThreadCache::kFree;
    if (cache->state.compare_exchange_weak(expected, ThreadCache::kOwner, std::memory_order_acquire,
                                           std::memory_order_relaxed)) [[likely]] {
      return cache;
    }
    if (expected == ThreadCache::kClosed) return nullptr;
    backoff.pause();  // a trim() is moving this cache's blocks out: a few pointer moves
  }
}

inline void DevicePoolCore::unlock_own_cache(ThreadCache& cache) noexcept {
  // The request is honoured before the release of the state word: once kFree is stored,
  // close() may take the cache and destroy the pool, so nothing after it may touch them.
  if (cache.flush_requested.load(std::memory_order_seq_cst)) [[unlikely]] {
    cache.flush_requested.store(false, std::memory_order_relaxed);
    take_bins(cache, nullptr, /*to_upstream=*/true);
  }
  cache.state.store(ThreadCache::kFree, std::memory_order_release);
}

void DevicePoolCore::retire(ThreadCache* cache) noexcept {
  std::uint32_t expected = ThreadCache::kFree;
  Backoff backoff;
  while (!cache->state.compare_exchange_weak(expected, ThreadCache::kOwner,
                                             std::memory_order_acquire)) {
    if (expected == ThreadCache::kClosed) return;  // close() took its blocks already
    expected = ThreadCache::kFree;
    backoff.pause();
  }
  take_bins(*cache, nullptr);  // to the shared tier; its counters stay in the cache
  cache->flush_requested.store(false, std::memory_order_relaxed);
  cache->state.store(ThreadCache::kFree, std::memory_order_release);
  std::lock_guard lock(registry_mutex);
  cache->owner_alive = false;
  try {
    spare_caches.push_back(cache);
  } catch (...) {  // not adoptable; it stays empty and counted
  }
}

void DevicePoolCore::free_to_upstream(void* block, std::size_t class_bytes) noexcept {
  upstream->deallocate(block, class_bytes);
  upstream_frees.fetch_add(1, std::memory_order_relaxed);
  reserved_bytes.fetch_sub(class_bytes, std::memory_order_relaxed);
}

void DevicePoolCore::take_bins(ThreadCache& cache, std::vector<Taken>* out,
                               bool to_upstream) noexcept {
  for (std::size_t index = 0; index < cache.bins.size(); ++index) {
    auto& bin = cache.bins[index];
    const std::size_t class_bytes = SizeClasses::bytes_of(index);
    for (std::uint32_t i = 0; i < bin.count; ++i) {
      if (out != nullptr) {
        try {
          out->push_back({index, bin.blocks[i]});
          continue;
        } catch (...) {  // no host memory for the list: free it here
          free_to_upstream(bin.blocks[i], class_bytes);
          continue;
        }
      }
      if (to_upstream) {
        free_to_upstream(bin.blocks[i], class_bytes);
      } else {
        release_to_shared(index, bin.blocks[i], class_bytes);
      }
    }
    bin.count = 0;
  }
  cache.cached_bytes.store(0, std::memory_order_relaxed);
}

void DevicePoolCore::put_taken(std::vector<Taken>& taken, bool to_shared) noexcept {
  for (const Taken& t : taken) {
    const std::size_t class_bytes = SizeClasses::bytes_of(t.index);
    if (to_shared) {
      release_to_shared(t.index, t.block, class_bytes);
    } else {
      free_to_upstream(t.block, class_bytes);
    }
  }
  taken.clear();
}

void DevicePoolCore::release_to_shared(std::size_t index, void* block,
                                       std::size_t class_bytes) noexcept {
  const std::size_t cached =
      shared_cached_bytes.fetch_add(class_bytes, std::memory_order_relaxed) + class_bytes;
  MpmcRing<void*>* ring = nullptr;
  if (cached > options.max_cached_bytes || (ring = ring_for_release(index)) == nullptr ||
      !ring->try_push(block)) {
    shared_cached_bytes.fetch_sub(class_bytes, std::memory_order_relaxed);
    free_to_upstream(block, class_bytes);
  }
}

void DevicePoolCore::trim(std::size_t keep_bytes, ThreadCache* held) noexcept {
  std::vector<ThreadCache*> snapshot;
  try {
    std::lock_guard lock(registry_mutex);
    snapshot.reserve(caches.size());
    for (auto& cache : caches) snapshot.push_back(cache.get());
  } catch (...) {  // no host memory for the list: only the shared tier is trimmed
  }
  std::vector<Taken> taken;
  for (ThreadCache* cache : snapshot) {
    if (cache == held) {
      take_bins(*cache, &taken);
      continue;
    }
    // Waits for an owner inside a short call; an owner inside a call that may block (an
    // upstream call, its own trim) is asked to flush before it returns instead. The seq_cst
    // store/load pairs here and in SlowSection guarantee one side sees the other.
    Backoff backoff;
    for (;;) {
      std::uint32_t expected = ThreadCache::kFree;
      if (cache->state.compare_exchange_weak(expected, ThreadCache::kOther,
                                             std::memory_order_acquire)) {
        take_bins(*cache, &taken);
        cache->flush_requested.store(false, std::memory_order_relaxed);
        cache->state.store(ThreadCache::kFree, std::memory_order_release);
        break;
      }
      if (expected == ThreadCache::kClosed) break;  // close() took its blocks
      if (expected == ThreadCache::kOwner && cache->in_slow_call.load(std::memory_order_seq_cst)) {
        cache->flush_requested.store(true, std::memory_order_seq_cst);
        if (cache->in_slow_call.load(std::memory_order_seq_cst)) break;  // it will see it
        continue;
      }
      backoff.pause();
    }
    put_taken(taken, false);
  }
  put_taken(taken, false);
  for (std::size_t index = rings.size(); index-- > 0;) {
    const std::size_t class_bytes = SizeClasses::bytes_of(index);
    MpmcRing<void*>* ring = ring_of(index);
    void* block = nullptr;
    while (ring != nullptr && shared_cached_bytes.load(std::memory_order_relaxed) > keep_bytes &&
           ring->try_pop(block)) {
      shared_cached_bytes.fetch_sub(class_bytes, std::memory_order_relaxed);
      free_to_upstream(block, class_bytes);
    }
  }
}

bool DevicePoolCore::close(std::uint64_t& blocks, std::uint64_t& bytes) noexcept {
  std::vector<ThreadCache*> all;
  {
    std::lock_guard lock(registry_mutex);
    closing = true;  // no cache registers from now on: `caches` is frozen
  }
  // Close every cache, waiting for calls in progress on them (each is short: no call waits
  // for anything while holding its cache except upstream calls and trim's bounded tries).
  for (auto& cache : caches) {
    std::uint32_t expected = ThreadCache::kFree;
    Backoff backoff;
    while (!cache->state.compare_exchange_weak(expected, ThreadCache::kClosed,
                                               std::memory_order_acquire)) {
      expected = ThreadCache::kFree;
      backoff.pause();
    }
    take_bins(*cache, nullptr);
  }
  // Every call from now on takes the slow path, serialised by slow_mutex: the count of
  // leased blocks is exact.
  std::lock_guard slow(slow_mutex);
  std::uint64_t acquires = slow_acquires.load(std::memory_order_relaxed);
  std::uint64_t releases = slow_releases.load(std::memory_order_relaxed);
  std::uint64_t acquired = slow_acquired_bytes.load(std::memory_order_relaxed);
  std::uint64_t released = slow_released_bytes.load(std::memory_order_relaxed);
  for (auto& cache : caches) {
    acquires += cache->acquires.load(std::memory_order_relaxed);
    releases += cache->releases.load(std::memory_order_relaxed);
    acquired += cache->acquired_bytes.load(std::memory_order_relaxed);
    released += cache->released_bytes.load(std::memory_order_relaxed);
  }
  trim(0, nullptr);
  blocks = acquires - releases;
  bytes = acquired - released;
  if (blocks == 0) return false;
  orphaned = true;
  orphan_blocks_outstanding = blocks;
  self_reference = shared_from_this();
  return true;
}

// Marks the holder of `cache` as inside a call that may block (see ThreadCache).
class SlowSection {
 public:
  explicit SlowSection(ThreadCache* cache) noexcept : cache_(cache) {
    if (cache_ != nullptr) cache_->in_slow_call.store(true, std::memory_order_seq_cst);
  }
  ~SlowSection() {
    if (cache_ != nullptr) cache_->in_slow_call.store(false, std::memory_order_seq_cst);
  }
  SlowSection(const SlowSection&) = delete;
  SlowSection& operator=(const SlowSection&) = delete;

 private:
  ThreadCache* cache_;
};

void* DevicePoolCore::allocate_from_upstream(std::size_t requested, std::size_t class_bytes,
                                             ThreadCache* held) {
  SlowSection slow(held);
  void* block = nullptr;
  try {
    block = upstream->allocate(class_bytes);
  } catch (const OutOfMemory&) {
    oom_retries.fetch_add(1, std::memory_order_relaxed);
    trim(0, held);
    try {
      block = upstream->allocate(class_bytes);
    } catch (const OutOfMemory& second) {
      failed_upstream_allocations.fetch_add(1, std::memory_order_relaxed);
      const DevicePoolStats now = stats();
      throw OutOfMemory(requested, now.bytes_cached, now.bytes_in_use,
                        std::string("upstream ") + std::string(upstream->name()) +
                            " failed after trimming the cache and retrying (" + second.what() +
                            ")");
    }
  }
  upstream_allocations.fetch_add(1, std::memory_order_relaxed);
  const std::size_t reserved =
      reserved_bytes.fetch_add(class_bytes, std::memory_order_relaxed) + class_bytes;
  std::size_t peak = peak_reserved_bytes.load(std::memory_order_relaxed);
  while (reserved > peak &&
         !peak_reserved_bytes.compare_exchange_weak(peak, reserved, std::memory_order_relaxed)) {
  }
  return block;
}

void* DevicePoolCore::take_shared_or_upstream(std::size_t requested, std::size_t index,
                                              ThreadCache* held) {
  const std::size_t class_bytes = SizeClasses::bytes_of(index);
  void* block = nullptr;
  if (MpmcRing<void*>* ring = ring_of(index); ring != nullptr && ring->try_pop(block)) {
    shared_cached_bytes.fetch_sub(class_bytes, std::memory_order_relaxed);
    return block;
  }
  return allocate_from_upstream(requested, class_bytes, held);
}

void* DevicePoolCore::allocate(std::size_t bytes, std::size_t alignment) {
  if (bytes == 0) [[unlikely]] {
    throw InvalidArgument(
        "vram::DevicePool::allocate: zero bytes requested. Fix: keep zero-sized buffers as "
        "null sentinels and ask for at least one byte.");
  }
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > upstream_alignment)
      [[unlikely]] {
    throw InvalidArgument("vram::DevicePool::allocate: alignment " + std::to_string(alignment) +
                          " is not a power of two up to " + std::to_string(upstream_alignment) +
                          ". Fix: blocks are 256-byte aligned; ask for 256 or less.");
  }
  if (bytes > SizeClasses::kMaxBytes) [[unlikely]] {
    const DevicePoolStats now = stats();
    throw OutOfMemory(bytes, now.bytes_cached, now.bytes_in_use,
                      "larger than the largest size class (1 TiB)");
  }
  const std::size_t index = SizeClasses::index_for(bytes);
  const std::size_t class_bytes = SizeClasses::bytes_of(index);
  void* block = nullptr;
  if (ThreadCache* cache = lock_own_cache(); cache != nullptr) [[likely]] {
    try {
      if (index < thread_cache_classes && cache->bins[index].count > 0) {
        auto& bin = cache->bins[index];
        block = bin.blocks[--bin.count];
        bump(cache->cached_bytes, 0 - std::uint64_t{class_bytes});
      } else {
        block = take_shared_or_upstream(bytes, index, cache);
      }
    } catch (...) {
      unlock_own_cache(*cache);
      throw;
    }
    bump(cache->acquires, 1);
    bump(cache->acquired_bytes, class_bytes);
    unlock_own_cache(*cache);
  } else {
    std::lock_guard lock(slow_mutex);
    if (orphaned) [[unlikely]] {
      throw InvalidArgument(
          "vram::DevicePool::allocate: the pool was destroyed. Fix: keep the DevicePool alive "
          "while it is used.");
    }
    block = take_shared_or_upstream(bytes, index, nullptr);
    bump(slow_acquires, 1);
    bump(slow_acquired_bytes, class_bytes);
  }
  if (options.validate_releases) {
    try {
      std::lock_guard lock(live_mutex);
      live_blocks[block] = class_bytes;
    } catch (...) {  // could not record it: undo the acquire so nothing is lost
      {
        std::lock_guard lock(slow_mutex);
        bump(slow_releases, 1);
        bump(slow_released_bytes, class_bytes);
      }
      release_to_shared(index, block, class_bytes);
      throw;
    }
  }
  return block;
}

bool DevicePoolCore::validate_release(void* block, std::size_t class_bytes) noexcept {
  std::lock_guard lock(live_mutex);
  auto it = live_blocks.find(block);
  const char* problem = nullptr;
  if (it == live_blocks.end()) {
    problem = "it was never handed out by this pool or was already released (double release)";
  } else if (it->second != class_bytes) {
    problem = "the byte count does not match the one it was allocated with";
  } else {
    live_blocks.erase(it);
    return true;
  }
  invalid_releases.fetch_add(1, std::memory_order_relaxed);
  std::fprintf(stderr,
               "vram::DevicePool: release of %p (%zu class bytes) rejected: %s. The block was "
               "not cached.\n",
               block, class_bytes, problem);
  return false;
}

void DevicePoolCore::deallocate(void* block, std::size_t bytes) noexcept {
  if (block == nullptr) return;
  if (bytes == 0 || bytes > SizeClasses::kMaxBytes) {
    invalid_releases.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const std::size_t index = SizeClasses::index_for(bytes);
  const std::size_t class_bytes = SizeClasses::bytes_of(index);
  if (options.validate_releases && !validate_release(block, class_bytes)) return;
  if (ThreadCache* cache = lock_own_cache(); cache != nullptr) [[likely]] {
    bump(cache->releases, 1);
    bump(cache->released_bytes, class_bytes);
    if (index < thread_cache_classes && cache->bins[index].count < options.thread_cache_blocks &&
        cache->cached_bytes.load(std::memory_order_relaxed) + class_bytes <=
            options.thread_cache_max_bytes) {
      auto& bin = cache->bins[index];
      bin.blocks[bin.count++] = block;
      bump(cache->cached_bytes, class_bytes);
    } else {
      release_to_shared(index, block, class_bytes);
    }
    unlock_own_cache(*cache);
    return;
  }
  // Slow path. When orphaned, the last release drops the self-reference after the lock is
  // released (declared first, destroyed last): that may destroy *this.
  std::shared_ptr<DevicePoolCore> last;
  std::lock_guard lock(slow_mutex);
  bump(slow_releases, 1);
  bump(slow_released_bytes, class_bytes);
  if (!orphaned) {
    release_to_shared(index, block, class_bytes);
    return;
  }
  free_to_upstream(block, class_bytes);
  if (--orphan_blocks_outstanding == 0) last = std::move(self_reference);
}

DevicePoolStats DevicePoolCore::stats() const {
  DevicePoolStats s;
  std::uint64_t acquired_bytes = slow_acquired_bytes.load(std::memory_order_relaxed);
  std::uint64_t released_bytes = slow_released_bytes.load(std::memory_order_relaxed);
  s.acquires = slow_acquires.load(std::memory_order_relaxed);
  s.releases = slow_releases.load(std::memory_order_relaxed);
  std::size_t thread_cached = 0;
  {
    std::lock_guard lock(registry_mutex);
    for (const auto& cache : caches) {
      s.acquires += cache->acquires.load(std::memory_order_relaxed);
      s.releases += cache->releases.load(std::memory_order_relaxed);
      acquired_bytes += cache->acquired_bytes.load(std::memory_order_relaxed);
      released_bytes += cache->released_bytes.load(std::memory_order_relaxed);
      thread_cached += cache->cached_bytes.load(std::memory_order_relaxed);
    }
  }
  s.upstream_allocations = upstream_allocations.load(std::memory_order_relaxed);
  s.upstream_frees = upstream_frees.load(std::memory_order_relaxed);
  s.misses = s.upstream_allocations + failed_upstream_allocations.load(std::memory_order_relaxed);
  s.hits = s.acquires > s.upstream_allocations ? s.acquires - s.upstream_allocations : 0;
  s.oom_retries = oom_retries.load(std::memory_order_relaxed);
  s.invalid_releases = invalid_releases.load(std::memory_order_relaxed);
  s.bytes_in_use = acquired_bytes > released_bytes ? acquired_bytes - released_bytes : 0;
  s.bytes_cached_in_threads = thread_cached;
  s.bytes_cached = shared_cached_bytes.load(std::memory_order_relaxed) + thread_cached;
  s.bytes_reserved = reserved_bytes.load(std::memory_order_relaxed);
  s.peak_bytes_reserved = peak_reserved_bytes.load(std::memory_order_relaxed);
  return s;
}

}  // namespace vram::detail

namespace vram {

DevicePool::Lease::Lease(Lease&& other) noexcept
    : core_(std::exchange(other.core_, nullptr)),
      block_(std::exchange(other.block_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

DevicePool::Lease& DevicePool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    reset();
    core_ = std::exchange(other.core_, nullptr);
    block_ = std::exchange(other.block_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DevicePool::Lease::reset() noexcept {
  if (block_ != nullptr) core_->deallocate(block_, bytes_);
  core_ = nullptr;
  block_ = nullptr;
  bytes_ = 0;
}

void* DevicePool::Lease::release() noexcept {
  core_ = nullptr;
  bytes_ = 0;
  return std::exchange(block_, nullptr);
}

DevicePool::DevicePool(int device, Options options)
    : DevicePool(std::make_shared<DeviceMemoryUpstream>(device), options) {}

DevicePool::DevicePool(std::shared_ptr<Upstream> upstream, Options options)
    : core_(std::make_shared<detail::DevicePoolCore>(std::move(upstream), options)) {}

DevicePool& DevicePool::operator=(DevicePool&& other) noexcept {
  if (this != &other) {
    DevicePool dying(std::move(*this));
    core_ = std::move(other.core_);
  }
  return *this;
}

DevicePool::~DevicePool() {
  if (!core_) return;
  std::uint64_t blocks = 0;
  std::uint64_t bytes = 0;
  if (core_->close(blocks, bytes)) {
    std::fprintf(stderr,
                 "vram::DevicePool destroyed with %llu block(s), %llu bytes, still leased; the "
                 "pool's bookkeeping stays alive until they are released, and each then goes "
                 "straight back to the upstream.\n",
                 static_cast<unsigned long long>(blocks), static_cast<unsigned long long>(bytes));
  }
  core_.reset();
}

void* DevicePool::allocate(std::size_t bytes, std::size_t alignment) {
  return core_->allocate(bytes, alignment);
}

void DevicePool::deallocate(void* block, std::size_t bytes, std::size_t /*alignment*/) noexcept {
  core_->deallocate(block, bytes);
}

DevicePool::Lease DevicePool::acquire(std::size_t bytes) {
  void* block = core_->allocate(bytes, kDefaultAlignment);
  return Lease(core_.get(), block, bytes);
}

void DevicePool::trim(std::size_t keep_bytes) { core_->trim(keep_bytes, nullptr); }

DevicePoolStats DevicePool::stats() const { return core_->stats(); }

void DevicePool::reset_peak() noexcept {
  core_->peak_reserved_bytes.store(core_->reserved_bytes.load(std::memory_order_relaxed),
                                   std::memory_order_relaxed);
}

const DevicePool::Options& DevicePool::options() const noexcept { return core_->options; }

Upstream& DevicePool::upstream() const noexcept { return *core_->upstream; }

}  // namespace vram
