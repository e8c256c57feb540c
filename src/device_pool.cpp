#include "vram/device_pool.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "vram/cuda/error.hpp"
#include "vram/detail/mpmc_ring.hpp"
#include "vram/size_classes.hpp"

namespace vram::detail {
namespace {

constexpr std::size_t kMaxThreadCacheDepth = 16;

// Single-writer counter update: only the owning thread writes, others only read, so a
// relaxed load + store is exact and needs no locked instruction.
inline void bump(std::atomic<std::uint64_t>& counter, std::uint64_t delta) noexcept {
  counter.store(counter.load(std::memory_order_relaxed) + delta, std::memory_order_relaxed);
}

std::atomic<std::uint64_t> next_pool_uid{1};

}  // namespace

// Tier 1: one thread's blocks and counters for one pool. Invariant: only the owning thread
// touches bins and writes the counters while it lives; after retire() nobody does.
struct ThreadCache {
  struct Bin {
    std::uint32_t count = 0;
    void* blocks[kMaxThreadCacheDepth] = {};
  };
  explicit ThreadCache(std::size_t classes, std::uint64_t epoch)
      : bins(classes), seen_epoch(epoch) {}

  std::vector<Bin> bins;
  std::uint64_t seen_epoch;
  std::atomic<std::uint64_t> acquires{0};
  std::atomic<std::uint64_t> releases{0};
  std::atomic<std::uint64_t> acquired_bytes{0};
  std::atomic<std::uint64_t> released_bytes{0};
  std::atomic<std::uint64_t> cached_bytes{0};
};

// Accounting invariant (when quiescent):
//   bytes_reserved == bytes_in_use + shared_cached_bytes + sum(thread cached_bytes)
//   bytes_in_use   == sum(acquired_bytes) - sum(released_bytes)   (threads + retired)
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
    for (auto& cache : caches) empty_thread_cache(*cache, false);
    for (std::size_t index = 0; index < rings.size(); ++index) {
      MpmcRing<void*>* ring = rings[index].load(std::memory_order_acquire);
      if (ring == nullptr) continue;
      void* block = nullptr;
      while (ring->try_pop(block)) free_to_upstream(block, SizeClasses::bytes_of(index));
      delete ring;
    }
  }

  // The shared free list of a class, or null if no block of that class was ever cached.
  MpmcRing<void*>* ring_of(std::size_t index) const noexcept {
    return rings[index].load(std::memory_order_acquire);
  }
  // Creates the class's ring on its first release (host allocation off the warm path).
  MpmcRing<void*>* ring_for_release(std::size_t index) noexcept {
    MpmcRing<void*>* ring = rings[index].load(std::memory_order_acquire);
    if (ring != nullptr) [[likely]]
      return ring;
    MpmcRing<void*>* fresh = new (std::nothrow) MpmcRing<void*>(ring_capacity);
    if (fresh == nullptr) return nullptr;
    if (!rings[index].compare_exchange_strong(ring, fresh, std::memory_order_acq_rel)) {
      delete fresh;  // another thread won; `ring` now holds its ring
      return ring;
    }
    return fresh;
  }

  ThreadCache& cache_for_this_thread();
  ThreadCache& register_thread();
  void retire(ThreadCache* cache) noexcept;

  void* allocate(std::size_t bytes, std::size_t alignment);
  void deallocate(void* block, std::size_t bytes) noexcept;
  void* allocate_from_upstream(std::size_t requested, std::size_t class_bytes);
  void release_to_shared(std::size_t index, void* block, std::size_t class_bytes) noexcept;
  void free_to_upstream(void* block, std::size_t class_bytes) noexcept;
  // Moves a thread cache's blocks to the shared tier (thread exit) or frees them (trim).
  void empty_thread_cache(ThreadCache& cache, bool keep_in_shared) noexcept;
  void trim(std::size_t keep_bytes) noexcept;
  // Called when a thread sees a new trim epoch. Returns true when the pool is orphaned.
  bool on_epoch_change(ThreadCache& cache) noexcept;
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
  alignas(kCacheLine) std::atomic<std::uint64_t> trim_epoch{0};
  alignas(kCacheLine) std::atomic<std::size_t> reserved_bytes{0};
  std::atomic<std::size_t> peak_reserved_bytes{0};
  std::atomic<std::uint64_t> upstream_allocations{0};
  std::atomic<std::uint64_t> upstream_frees{0};
  std::atomic<std::uint64_t> failed_upstream_allocations{0};
  std::atomic<std::uint64_t> oom_retries{0};
  std::atomic<std::uint64_t> invalid_releases{0};

  mutable std::mutex registry_mutex;  // guards caches and the retired_* totals
  std::vector<std::unique_ptr<ThreadCache>> caches;
  std::uint64_t retired_acquires = 0;
  std::uint64_t retired_releases = 0;
  std::uint64_t retired_acquired_bytes = 0;
  std::uint64_t retired_released_bytes = 0;

  std::mutex live_mutex;  // validate_releases only
  std::unordered_map<void*, std::size_t> live_blocks;

  // Set when the DevicePool handle died with blocks still leased: the core keeps itself
  // alive through self_reference until the last of those blocks is released.
  std::atomic<bool> orphaned{false};
  std::atomic<std::int64_t> orphan_blocks_outstanding{0};
  std::shared_ptr<DevicePoolCore> self_reference;  // set only while orphaned
};

namespace {

// Per thread: which ThreadCache belongs to which pool. The two scalars are the fast path
// (the pool used last); the directory is consulted on a switch and retires the caches
// of pools still alive when the thread exits.
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

inline ThreadCache& DevicePoolCore::cache_for_this_thread() {
  if (tl_last_uid == uid) [[likely]]
    return *tl_last_cache;
  return register_thread();
}

ThreadCache& DevicePoolCore::register_thread() {
  if (!tl_directory_gone) {
    auto& entries = tl_directory.entries;
    for (auto& entry : entries) {
      if (entry.uid == uid) {
        tl_last_uid = uid;
        tl_last_cache = entry.cache;
        return *entry.cache;
      }
    }
    std::erase_if(entries, [](const ThreadDirectory::Entry& e) { return e.core.expired(); });
  }
  // An orphaned pool keeps every thread on the slow path (an epoch no thread can match).
  const std::uint64_t epoch = orphaned.load(std::memory_order_acquire)
                                  ? ~std::uint64_t{0}
                                  : trim_epoch.load(std::memory_order_relaxed);
  auto cache = std::make_unique<ThreadCache>(thread_cache_classes, epoch);
  ThreadCache* raw = cache.get();
  {
    std::lock_guard lock(registry_mutex);
    caches.push_back(std::move(cache));
  }
  if (!tl_directory_gone) {
    tl_directory.entries.push_back({uid, weak_from_this(), raw});
    tl_last_uid = uid;
    tl_last_cache = raw;
  }
  return *raw;
}

void DevicePoolCore::retire(ThreadCache* cache) noexcept {
  std::lock_guard lock(registry_mutex);
  auto it = std::find_if(caches.begin(), caches.end(),
                         [cache](const auto& owned) { return owned.get() == cache; });
  if (it == caches.end()) return;
  empty_thread_cache(*cache, /*keep_in_shared=*/!orphaned.load(std::memory_order_relaxed));
  retired_acquires += cache->acquires.load(std::memory_order_relaxed);
  retired_releases += cache->releases.load(std::memory_order_relaxed);
  retired_acquired_bytes += cache->acquired_bytes.load(std::memory_order_relaxed);
  retired_released_bytes += cache->released_bytes.load(std::memory_order_relaxed);
  caches.erase(it);
}

void DevicePoolCore::free_to_upstream(void* block, std::size_t class_bytes) noexcept {
  upstream->deallocate(block, class_bytes);
  upstream_frees.fetch_add(1, std::memory_order_relaxed);
  reserved_bytes.fetch_sub(class_bytes, std::memory_order_relaxed);
}

void DevicePoolCore::empty_thread_cache(ThreadCache& cache, bool keep_in_shared) noexcept {
  for (std::size_t index = 0; index < cache.bins.size(); ++index) {
    auto& bin = cache.bins[index];
    const std::size_t class_bytes = SizeClasses::bytes_of(index);
    for (std::uint32_t i = 0; i < bin.count; ++i) {
      if (keep_in_shared) {
        release_to_shared(index, bin.blocks[i], class_bytes);
      } else {
        free_to_upstream(bin.blocks[i], class_bytes);
      }
    }
    bin.count = 0;
  }
  cache.cached_bytes.store(0, std::memory_order_relaxed);
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

bool DevicePoolCore::on_epoch_change(ThreadCache& cache) noexcept {
  empty_thread_cache(cache, false);
  if (orphaned.load(std::memory_order_acquire)) return true;  // stay on the slow path
  cache.seen_epoch = trim_epoch.load(std::memory_order_relaxed);
  return false;
}

void DevicePoolCore::trim(std::size_t keep_bytes) noexcept {
  if (tl_last_uid == uid) empty_thread_cache(*tl_last_cache, false);
  trim_epoch.fetch_add(1, std::memory_order_release);
  if (tl_last_uid == uid) tl_last_cache->seen_epoch = trim_epoch.load(std::memory_order_relaxed);
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

void* DevicePoolCore::allocate_from_upstream(std::size_t requested, std::size_t class_bytes) {
  void* block = nullptr;
  try {
    block = upstream->allocate(class_bytes);
  } catch (const OutOfMemory&) {
    oom_retries.fetch_add(1, std::memory_order_relaxed);
    trim(0);
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
  ThreadCache& cache = cache_for_this_thread();
  if (cache.seen_epoch != trim_epoch.load(std::memory_order_relaxed)) [[unlikely]] {
    (void)on_epoch_change(cache);
  }
  void* block = nullptr;
  if (index < thread_cache_classes && cache.bins[index].count > 0) {
    auto& bin = cache.bins[index];
    block = bin.blocks[--bin.count];
    cache.cached_bytes.store(cache.cached_bytes.load(std::memory_order_relaxed) - class_bytes,
                             std::memory_order_relaxed);
  } else if (MpmcRing<void*>* ring = ring_of(index); ring != nullptr && ring->try_pop(block)) {
    shared_cached_bytes.fetch_sub(class_bytes, std::memory_order_relaxed);
  } else {
    block = allocate_from_upstream(bytes, class_bytes);
  }
  bump(cache.acquires, 1);
  bump(cache.acquired_bytes, class_bytes);
  if (options.validate_releases) {
    try {
      std::lock_guard lock(live_mutex);
      live_blocks[block] = class_bytes;
    } catch (...) {  // could not record it: undo the acquire so nothing is lost
      bump(cache.releases, 1);
      bump(cache.released_bytes, class_bytes);
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
  ThreadCache* cache = nullptr;
  try {
    cache = &cache_for_this_thread();
  } catch (...) {  // registering this thread could not allocate: bypass the caches
    release_to_shared(index, block, class_bytes);
    return;
  }
  if (cache->seen_epoch != trim_epoch.load(std::memory_order_relaxed)) [[unlikely]] {
    if (on_epoch_change(*cache)) {  // orphaned: straight back to the upstream
      bump(cache->releases, 1);
      bump(cache->released_bytes, class_bytes);
      free_to_upstream(block, class_bytes);
      if (orphan_blocks_outstanding.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        // Last lease back: drop the self-reference as the very last action (this may
        // destroy *this, like `delete this`).
        std::shared_ptr<DevicePoolCore> last = std::move(self_reference);
      }
      return;
    }
  }
  bump(cache->releases, 1);
  bump(cache->released_bytes, class_bytes);
  if (index < thread_cache_classes && cache->bins[index].count < options.thread_cache_blocks &&
      cache->cached_bytes.load(std::memory_order_relaxed) + class_bytes <=
          options.thread_cache_max_bytes) {
    auto& bin = cache->bins[index];
    bin.blocks[bin.count++] = block;
    cache->cached_bytes.store(cache->cached_bytes.load(std::memory_order_relaxed) + class_bytes,
                              std::memory_order_relaxed);
    return;
  }
  release_to_shared(index, block, class_bytes);
}

DevicePoolStats DevicePoolCore::stats() const {
  DevicePoolStats s;
  std::uint64_t acquired_bytes = 0;
  std::uint64_t released_bytes = 0;
  std::size_t thread_cached = 0;
  {
    std::lock_guard lock(registry_mutex);
    s.acquires = retired_acquires;
    s.releases = retired_releases;
    acquired_bytes = retired_acquired_bytes;
    released_bytes = retired_released_bytes;
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
  core_->trim(0);
  const DevicePoolStats now = core_->stats();
  const auto outstanding =
      static_cast<std::int64_t>(now.acquires) - static_cast<std::int64_t>(now.releases);
  if (outstanding > 0) {
    std::fprintf(stderr,
                 "vram::DevicePool destroyed with %lld block(s), %zu bytes, still leased; the "
                 "pool's bookkeeping stays alive until they are released, and each then goes "
                 "straight back to the upstream.\n",
                 static_cast<long long>(outstanding), now.bytes_in_use);
    core_->orphan_blocks_outstanding.store(outstanding, std::memory_order_relaxed);
    core_->self_reference = core_;
    core_->orphaned.store(true, std::memory_order_release);
    core_->trim_epoch.fetch_add(1, std::memory_order_release);
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

void DevicePool::trim(std::size_t keep_bytes) { core_->trim(keep_bytes); }

DevicePoolStats DevicePool::stats() const { return core_->stats(); }

void DevicePool::reset_peak() noexcept {
  core_->peak_reserved_bytes.store(core_->reserved_bytes.load(std::memory_order_relaxed),
                                   std::memory_order_relaxed);
}

const DevicePool::Options& DevicePool::options() const noexcept { return core_->options; }

Upstream& DevicePool::upstream() const noexcept { return *core_->upstream; }

}  // namespace vram
