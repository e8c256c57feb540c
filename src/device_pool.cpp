#include "vram/device_pool.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "segment_tier.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/error.hpp"
#include "vram/detail/asymmetric_fence.hpp"
#include "vram/detail/mpmc_ring.hpp"
#include "vram/size_classes.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::detail {
namespace {

constexpr std::size_t kMaxThreadCacheDepth = 16;
// A class's ring is made whole on its first release (16 bytes a cell): with
// max_cached_blocks_per_class unbounded it would be max_cached_bytes / 256 cells (256 MiB
// of host memory for the smallest class at the default 4 GiB). Beyond this depth blocks
// wait in the segments, as free ranges, instead.
constexpr std::size_t kMaxRingBlocks = 4096;
constexpr std::size_t kSmallGranularity = 256;  // small blocks: class bytes rounded to 256
constexpr std::size_t kAutoSmallSegmentMax = std::size_t{256} << 10;  // small_segment_max_bytes = 0
constexpr std::size_t kMinLargeTierBlock = 2048;  // small_segment_max_bytes below: as 2 KiB
static_assert(SizeClasses::index_for(std::size_t{2} << 20) < 64);  // DevicePoolCore::held_bytes_of

// Update of a counter written only by the holder of its cache's state word (or under
// slow_mutex): a relaxed load + store is exact and needs no locked instruction; stats()
// reads it concurrently.
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

// LargeTierMemory::automatic: virtual memory only where it behaves as cudaMalloc memory
// does for the program. Mapped memory is reachable from the devices cuMemSetAccess names
// (this one), and cudaDeviceEnablePeerAccess does not extend that, so where another device
// could read this one's memory through peer access, segments stay the default.
bool virtual_memory_by_default(int device) noexcept {
  if (!CudaVirtualMemory::supported(device)) return false;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  for (int peer = 0; peer < count; ++peer) {
    int can_access = 0;
    if (peer == device) continue;
    if (cudaDeviceCanAccessPeer(&can_access, peer, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    if (can_access != 0) return false;
  }
  return true;
}

// The device a device upstream allocates on: vram's DeviceMemoryUpstream names it; any
// other device upstream is taken to allocate on the current device.
int device_of(const Upstream& upstream) {
  const auto* device_upstream = dynamic_cast<const DeviceMemoryUpstream*>(&upstream);
  return device_upstream != nullptr ? device_upstream->device() : cuda::Device::current();
}

std::shared_ptr<VirtualMemory> make_virtual_memory(const DevicePool::Options& options,
                                                   const std::shared_ptr<Upstream>& upstream) {
  if (options.large_tier_memory == LargeTierMemory::segments) return nullptr;
  const bool automatic = options.large_tier_memory == LargeTierMemory::automatic;
  // automatic: only over vram's own device upstream. The granules come from cuMemCreate,
  // not from the upstream, and a custom upstream (a budget, a counter) must not be bypassed.
  if (automatic && dynamic_cast<const DeviceMemoryUpstream*>(upstream.get()) == nullptr) {
    return nullptr;
  }
  if (upstream->kind() != MemoryKind::device) return std::make_shared<HostVirtualMemory>(upstream);
  const int device = device_of(*upstream);
  const bool usable =
      automatic ? virtual_memory_by_default(device) : CudaVirtualMemory::supported(device);
  if (!usable) return nullptr;  // segments instead
  return std::make_shared<CudaVirtualMemory>(device);
}

std::size_t reservation_for(const DevicePool::Options& options, const Upstream& upstream) {
  // The large tier keeps a few words per 2 MiB granule of its range (16 TiB: 8 Mi granules,
  // about 200 MiB of host memory); far above any device's memory.
  constexpr std::size_t kMaxReservation = std::size_t{16} << 40;
  if (options.virtual_reservation_bytes > kMaxReservation) {
    throw InvalidArgument("vram::DevicePool: virtual_reservation_bytes " +
                          std::to_string(options.virtual_reservation_bytes) +
                          " is above the 16 TiB of address space a pool can manage. Fix: 0 "
                          "reserves twice the device's memory; a larger range is needed only "
                          "to oversubscribe it.");
  }
  if (options.virtual_reservation_bytes != 0) return options.virtual_reservation_bytes;
  if (upstream.kind() == MemoryKind::device) {
    // The pool's device, not the current one (a pool for device 1 built while device 0 is
    // current); cudaGetDeviceProperties creates no context.
    cudaDeviceProp properties{};
    if (cudaGetDeviceProperties(&properties, device_of(upstream)) == cudaSuccess) {
      return 2 * properties.totalGlobalMem;
    }
    (void)cudaGetLastError();
  }
  return std::size_t{64} << 30;
}

// Options::growth_headroom as the tiers' fixed point (1024ths), checked.
std::size_t growth_headroom_1024(double headroom) {
  if (!(headroom >= 0)) {
    throw InvalidArgument(
        "vram::DevicePool: growth_headroom must be a fraction >= 0 (got " +
        std::to_string(headroom) +
        "). Fix: 1.0/16 keeps reserved near the peak in use, 0.5 lets it reach 1.5x of it.");
  }
  const double limit = static_cast<double>(ReservedGauge::kMaxHeadroom1024);
  return static_cast<std::size_t>(std::min(headroom * 1024.0 + 0.5, limit));
}

std::shared_ptr<StreamFence> default_fence(const Upstream& upstream) {
  if (upstream.kind() != MemoryKind::device) return std::make_shared<ImmediateFence>();
  return std::make_shared<CudaEventFence>(device_of(upstream));
}

}  // namespace

// Tier 1: one thread's small blocks and counters for one pool.
//
// Ownership handshake: two words, no locked instruction on the owner's side (a Dekker
// handshake over an asymmetric fence, detail/asymmetric_fence.hpp, which argues why at
// least one side always sees the other).
//   `state` is written only by the owner thread (its thread; at thread exit retire(), on
//   that thread; later the thread that adopts the cache): kOwner for the length of one
//   pool call, kFree otherwise (release).
//   `steal` is written only by a stealer holding the core's steal_mutex (trim(), close()):
//   kStealing for the length of a steal, kNoSteal after it (release), kClosed for good
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
// Stream tag: every block in the bins may be used by work on stream `tag` at once; with
// kUntagged, by any stream (its work has completed). A stream-ordered free on another
// stream first moves the bins to their tiers (tier_of) under their old tag.
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
  std::vector<Bin> bins;
  std::atomic<std::uint64_t> acquires{0};
  std::atomic<std::uint64_t> releases{0};
  std::atomic<std::uint64_t> acquired_bytes{0};
  std::atomic<std::uint64_t> released_bytes{0};
  std::atomic<std::uint64_t> cached_bytes{0};
};

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

// Structure: small requests (<= small_max) round to a size class; their blocks come from
// `small` (2 MiB segments, best fit), those above small_segment_max_bytes from `large`
// (tier_of), and are cached per thread (ThreadCache) and per class in a bounded lock-free
// ring. Larger requests go to `large` directly (best fit, split, coalesce; a short mutex).
// Accounting (when quiescent):
//   bytes_reserved == sum of segment sizes == bytes_in_use + bytes_cached
//   bytes_in_use   == sum(acquired_bytes) - sum(released_bytes)  (thread caches + slow path)
//
// Lifetime: ThreadCaches are owned by the core and live as long as it does (a cache of an
// exited thread is kept, empty, and adopted by the next thread that registers), so raw
// pointers to them stay valid. The core lives while the DevicePool handle lives, and after
// that while blocks are still leased (self_reference), see close().
struct DevicePoolCore : std::enable_shared_from_this<DevicePoolCore> {
  DevicePoolCore(std::shared_ptr<Upstream> upstream_in, const DevicePool::Options& options_in)
      : uid(next_pool_uid.fetch_add(1, std::memory_order_relaxed)),
        dekker(fence_mode_for_new_pool()),
        upstream(upstream_in ? std::move(upstream_in)
                             : throw InvalidArgument("vram::DevicePool: the upstream is null")),
        options(options_in),
        fence(options.fence ? options.fence : default_fence(*upstream)),
        virtual_memory(make_virtual_memory(options, upstream)),
        small_max(std::clamp<std::size_t>(options.small_block_max_bytes, 256, 2u << 20)),
        small(*upstream, *fence, gauge,
              SegmentTier::Options{
                  .granularity = kSmallGranularity,
                  .packed_segment = 2u << 20,
                  .packed_limit = 0,
                  .max_free_bytes = options.max_cached_bytes,
                  .growth_headroom_1024 = growth_headroom_1024(options.growth_headroom)}),
        large(*upstream, *fence, gauge,
              SegmentTier::Options{
                  .granularity = 512,
                  .packed_segment = options.large_segment_bytes,
                  .packed_limit = options.large_segment_bytes / 2,
                  .max_free_bytes = options.max_cached_bytes,
                  .max_segment_waste = options.max_segment_waste_bytes,
                  .virtual_memory = virtual_memory.get(),
                  .reservation = reservation_for(options, *upstream),
                  .unmap_before_map = options.unmap_before_map,
                  .max_run_bytes = options.virtual_run_bytes,
                  .map_ahead_bytes = options.virtual_map_ahead_bytes,
                  .growth_headroom_1024 = growth_headroom_1024(options.growth_headroom)}) {
    // Blocks are carved at 256-byte multiples of the upstream's allocations: they are
    // 256-byte aligned only if those are (and never more than that, whatever the upstream
    // promises: alignment above 256 is refused, not silently missed).
    if (const std::size_t promised = upstream->alignment(); promised < kMaxAlignment) {
      throw InvalidArgument("vram::DevicePool: the upstream '" + std::string(upstream->name()) +
                            "' aligns its allocations to " + std::to_string(promised) +
                            " bytes; the pool's blocks need 256. Fix: an upstream for a "
                            "DevicePool returns 256-byte aligned memory (as cudaMalloc does) "
                            "and says so in alignment().");
    }
    options.thread_cache_blocks = std::min(options.thread_cache_blocks, kMaxThreadCacheDepth);
    options.small_block_max_bytes = small_max;
    small_classes = SizeClasses::index_for(small_max) + 1;
    // 0: automatic (kAutoSmallSegmentMax over virtual memory; segments: every small class).
    // By block bytes, so classes that share a block size share a tier (validate_releases
    // tells blocks apart by block bytes); at least kMinLargeTierBlock, above which every
    // class is a multiple of the large tier's 512-byte rounding.
    const std::size_t asked = options.small_segment_max_bytes != 0 ? options.small_segment_max_bytes
                              : virtual_memory != nullptr          ? kAutoSmallSegmentMax
                                                                   : small_max;
    const std::size_t segment_max = std::max(kMinLargeTierBlock, asked);
    first_large_class = 0;
    while (first_large_class < small_classes &&
           small_block_bytes(first_large_class) <= segment_max) {
      ++first_large_class;
    }
    thread_cache_classes =
        options.thread_cache_blocks == 0 || options.thread_cache_max_block_bytes == 0
            ? 0
            : SizeClasses::index_for(std::min(options.thread_cache_max_block_bytes, small_max)) + 1;
    for (std::size_t index = 0; index < small_classes; ++index) {
      held_bytes_of[index] = static_cast<std::uint32_t>(small_block_bytes(index));
    }
    plain_calls = !options.validate_releases && !options.track_peak_in_use;
  }

  ~DevicePoolCore() {
    // close() has run and every block is back; return what a racing thread exit parked
    // before the tiers give every segment back (they are destroyed after this body).
    for (auto& cache : caches) take_bins(*cache);
    drain_rings();
    for (auto& ring : rings) delete ring.load(std::memory_order_relaxed);
  }

  static std::size_t small_block_bytes(std::size_t index) noexcept {
    return (SizeClasses::bytes_of(index) + kSmallGranularity - 1) & ~(kSmallGranularity - 1);
  }
  // The tier a small class's blocks are carved from (see small_segment_max_bytes).
  SegmentTier& tier_of(std::size_t index) noexcept {
    return index < first_large_class ? small : large;
  }
  std::size_t block_bytes(std::size_t bytes) const noexcept {
    return bytes <= small_max ? small_block_bytes(SizeClasses::index_for(bytes))
                              : large.round(bytes);
  }

  MpmcRing<void*>* ring_of(std::size_t index) const noexcept {
    return rings[index].load(std::memory_order_acquire);
  }
  // Creates the class's ring on its first release; null when the class keeps no ring or
  // the host is out of memory.
  MpmcRing<void*>* ring_for_release(std::size_t index) noexcept {
    MpmcRing<void*>* ring = rings[index].load(std::memory_order_acquire);
    if (ring != nullptr) [[likely]]
      return ring;
    // A power of two (the ring's own rounding) that never exceeds either bound.
    const std::size_t capacity =
        std::bit_floor(std::min({options.max_cached_blocks_per_class, kMaxRingBlocks,
                                 options.max_cached_bytes / small_block_bytes(index)}));
    if (capacity < 2) return nullptr;
    MpmcRing<void*>* fresh = nullptr;
    try {
      fresh = new MpmcRing<void*>(capacity);
    } catch (...) {  // std::bad_alloc from the ring or its cells: cache nothing
      return nullptr;
    }
    if (!rings[index].compare_exchange_strong(ring, fresh, std::memory_order_acq_rel)) {
      delete fresh;  // another thread won; `ring` now holds its ring
      return ring;
    }
    return fresh;
  }

  ThreadCache* lock_own_cache() noexcept;
  // The owner's claim of its cache (see ThreadCache): the cache, or null once closed.
  ThreadCache* claim(ThreadCache& cache) noexcept;
  ThreadCache* claim_slow(ThreadCache& cache) noexcept;
  void unlock_own_cache(ThreadCache& cache) noexcept;
  void* flush_and_unlock(ThreadCache& cache, void* result) noexcept;
  ThreadCache* claim_warm() noexcept;
  ThreadCache* find_or_register() noexcept;
  void retire(ThreadCache* cache) noexcept;

  void* allocate(std::size_t bytes, std::size_t alignment, StreamKey key);
  void* allocate_slow(std::size_t bytes, std::size_t alignment, StreamKey key);
  [[noreturn]] void reject_request(std::size_t bytes, std::size_t alignment) const;
  void deallocate(void* block, std::size_t bytes, StreamKey key) noexcept;
  void deallocate_checked(void* block, std::size_t bytes, StreamKey key) noexcept;
  // deallocate() after validation.
  void release(void* block, std::size_t bytes, StreamKey key) noexcept;
  bool release_to_own_cache(void* block, std::size_t bytes, StreamKey key) noexcept;
  void release_slow(void* block, std::size_t bytes, StreamKey key) noexcept;
  // The bins of a thread cache, for its holder. take_cached: a block of class `index`
  // usable on `key` (false: none). has_room: the bin's depth and the cache's byte bound allow one
  // more. put_cached: files a block (the caller checked the room and settled the tag).
  bool take_cached(ThreadCache& cache, std::size_t index, StreamKey key, void*& block) noexcept {
    auto& bin = cache.bins[index];
    if (bin.count == 0 || (cache.tag != kUntagged && cache.tag != key)) return false;
    block = bin.blocks[--bin.count];
    bump(cache.cached_bytes, 0 - std::uint64_t{held_bytes_of[index]});
    return true;
  }
  // `cached`: the cache's cached_bytes, as the caller loaded it; `held`: held_bytes_of[index].
  bool has_room(const ThreadCache& cache, std::size_t index, std::uint64_t cached,
                std::uint64_t held) const noexcept {
    const auto& bin = cache.bins[index];
    return bin.count < bin.limit && cached + held <= options.thread_cache_max_bytes;
  }
  void put_cached(ThreadCache& cache, void* block, std::size_t index, std::uint64_t held) noexcept {
    auto& bin = cache.bins[index];
    bin.blocks[bin.count++] = block;
    bump(cache.cached_bytes, held);
  }
  void* small_get(ThreadCache* cache, std::size_t index, StreamKey key);
  bool small_put(ThreadCache* cache, void* block, std::size_t index, StreamKey key) noexcept;
  void* tier_allocate(SegmentTier& tier, std::size_t requested, std::size_t bytes, StreamKey key,
                      ThreadCache* held);
  // tier_allocate() when no free range fits: grows the tier (trimming and retrying on OOM).
  void* tier_grow(SegmentTier& tier, std::size_t requested, std::size_t bytes, StreamKey key,
                  ThreadCache* held);
  // Moves a cache's blocks (its holder calls this) to their tiers under the cache's tag.
  void take_bins(ThreadCache& cache) noexcept;
  void drain_rings() noexcept;
  // Takes every thread cache (idle, exited, or `held`: the caller's own, already locked)
  // and the rings back to the segment tiers, then gives wholly free segments back.
  void trim(std::size_t keep_bytes, ThreadCache* held, bool wait) noexcept;
  bool close(std::uint64_t& blocks, std::uint64_t& bytes) noexcept;
  bool validate_release(void* block, std::size_t bytes) noexcept;
  void note_in_use(std::int64_t delta) noexcept;
  DevicePoolStats stats() const;

  const std::uint64_t uid;
  // The barriers of the caches' handshake; fixed for the life of the core.
  const AsymmetricFence dekker;
  std::shared_ptr<Upstream> upstream;
  DevicePool::Options options;
  std::shared_ptr<StreamFence> fence;
  std::shared_ptr<VirtualMemory> virtual_memory;  // the large tier's, or null
  std::size_t small_max;
  std::size_t small_classes = 0;
  std::size_t first_large_class = 0;  // small classes from here on are carved from `large`
  // The keep_bytes of the latest trim(), for a thread that flushes its cache after it.
  std::atomic<std::size_t> flush_keep_bytes{SIZE_MAX};
  std::size_t thread_cache_classes = 0;
  static constexpr std::size_t kMaxAlignment =
      DevicePool::kDefaultAlignment;  // see the constructor
  // Neither validate_releases nor track_peak_in_use: the warm paths below may serve a call.
  bool plain_calls = false;
  // small_block_bytes() of every small class (small_max <= 2 MiB: at most 53 classes).
  std::array<std::uint32_t, 64> held_bytes_of{};
  ReservedGauge gauge;
  SegmentTier small;
  SegmentTier large;
  // Small blocks shared between threads: one lazily created ring per class.
  std::array<std::atomic<MpmcRing<void*>*>, SizeClasses::kCount> rings{};

  std::atomic<std::uint64_t> oom_retries{0};
  std::atomic<std::uint64_t> invalid_releases{0};
  // Only with options.track_peak_in_use (a shared counter on every call).
  alignas(kCacheLine) std::atomic<std::int64_t> in_use_now{0};
  std::atomic<std::int64_t> in_use_peak{0};

  // Lock order: slow_mutex, then steal_mutex, then registry_mutex / a tier's mutex. Only
  // a holder of steal_mutex waits for a cache's state word (trim(), which never waits for
  // an owner inside a call that may block), and close() (holding none of them).
  std::mutex steal_mutex;             // one stealer at a time: writes every ThreadCache::steal
  mutable std::mutex registry_mutex;  // guards caches, spare_caches, closing
  std::vector<std::unique_ptr<ThreadCache>> caches;
  std::vector<ThreadCache*> spare_caches;  // of exited threads, empty, adoptable
  bool closing = false;

  // The slow path: calls on threads without a usable cache (see lock_own_cache) and every
  // call once the pool is closed. Counters written under slow_mutex.
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

// Per thread: which ThreadCache belongs to which pool. tl_last is the fast path
// (the pool used last); the directory is consulted on a switch and retires the caches of
// pools still alive when the thread exits. A thread whose directory is already destroyed
// (thread_local teardown order) uses the pool's slow path and parks nothing.
struct LastPool {
  std::uint64_t uid = 0;
  ThreadCache* cache = nullptr;  // not null when uid is not 0
};
thread_local LastPool tl_last;  // one thread-pointer access for both (see CMakeLists.txt: TLS)
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
    ThreadCache* cache = nullptr;
    {
      std::lock_guard lock(registry_mutex);
      if (closing) return nullptr;
      if (!spare_caches.empty()) {
        cache = spare_caches.back();
        spare_caches.pop_back();
      } else {
        caches.push_back(std::make_unique<ThreadCache>(small_classes, thread_cache_classes,
                                                       options.thread_cache_blocks));
        cache = caches.back().get();
      }
    }
    entries.push_back({uid, weak_from_this(), cache});
    tl_last = LastPool{uid, cache};
    return cache;
  } catch (...) {  // host out of memory: this call takes the slow path
    return nullptr;
  }
}

inline ThreadCache* DevicePoolCore::lock_own_cache() noexcept {
  ThreadCache* cache = tl_last.uid == uid ? tl_last.cache : find_or_register();
  if (cache == nullptr) return nullptr;
  return claim(*cache);
}

inline ThreadCache* DevicePoolCore::claim(ThreadCache& cache) noexcept {
  cache.state.store(ThreadCache::kOwner, kDekkerStore);
  dekker.light();
  if (cache.steal.load(kDekkerLoad) == ThreadCache::kNoSteal) [[likely]] {
    return &cache;
  }
  return claim_slow(cache);
}

[[gnu::noinline]] ThreadCache* DevicePoolCore::claim_slow(ThreadCache& cache) noexcept {
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
    dekker.light();
    if (cache.steal.load(kDekkerLoad) == ThreadCache::kNoSteal) return &cache;
  }
}

inline void DevicePoolCore::unlock_own_cache(ThreadCache& cache) noexcept {
  // The request is honoured before the release of the state word: once kFree is stored,
  // close() may take the cache and destroy the pool, so nothing after it may touch them.
  if (cache.flush_requested.load(std::memory_order_seq_cst)) [[unlikely]] {
    (void)flush_and_unlock(cache, nullptr);
    return;
  }
  cache.state.store(ThreadCache::kFree, std::memory_order_release);
}

// Returns `result`, so that a warm path ends in a tail call (it needs no stack frame).
[[gnu::noinline, gnu::cold]] void* DevicePoolCore::flush_and_unlock(ThreadCache& cache,
                                                                    void* result) noexcept {
  cache.flush_requested.store(false, std::memory_order_relaxed);
  take_bins(cache);
  small.trim(0, false);
  // Its blocks of the classes carved from the large tier went back there, maybe after the
  // trimmer's own large.trim(): that tier is trimmed again to what the trim asked.
  if (first_large_class < small_classes) {
    large.trim(flush_keep_bytes.load(std::memory_order_relaxed), false);
  }
  cache.state.store(ThreadCache::kFree, std::memory_order_release);
  return result;
}

// The warm paths' claim: only the cache of the pool this thread used last, only when no
// stealer is about. Null: nothing is held (the state word is back to kFree) and the caller
// takes its slow path, which registers, waits for a stealer or finds the pool closed.
// Calls nothing, so the warm paths need no stack frame.
inline ThreadCache* DevicePoolCore::claim_warm() noexcept {
  if (tl_last.uid != uid) [[unlikely]]
    return nullptr;
  ThreadCache* cache = tl_last.cache;
  cache->state.store(ThreadCache::kOwner, kDekkerStore);
  dekker.light();
  if (cache->steal.load(kDekkerLoad) == ThreadCache::kNoSteal) [[likely]]
    return cache;
  cache->state.store(ThreadCache::kFree, std::memory_order_release);
  return nullptr;
}

void DevicePoolCore::retire(ThreadCache* cache) noexcept {
  // The exiting thread still owns its cache: it claims it like any call.
  if (claim(*cache) == nullptr) return;  // closed: close() took its blocks already
  take_bins(*cache);                     // its counters stay in the cache
  cache->flush_requested.store(false, std::memory_order_relaxed);
  cache->state.store(ThreadCache::kFree, std::memory_order_release);
  std::lock_guard lock(registry_mutex);
  try {
    spare_caches.push_back(cache);
  } catch (...) {  // not adoptable; it stays empty and counted
  }
}

void DevicePoolCore::take_bins(ThreadCache& cache) noexcept {
  for (std::size_t index = 0; index < cache.bins.size(); ++index) {
    auto& bin = cache.bins[index];
    SegmentTier& tier = tier_of(index);
    const std::size_t bytes = held_bytes_of[index];
    for (std::uint32_t i = 0; i < bin.count; ++i) (void)tier.free(bin.blocks[i], cache.tag, bytes);
    bin.count = 0;
  }
  cache.tag = kUntagged;
  cache.cached_bytes.store(0, std::memory_order_relaxed);
}

void DevicePoolCore::drain_rings() noexcept {
  for (std::size_t index = 0; index < small_classes; ++index) {
    MpmcRing<void*>* ring = ring_of(index);
    void* block = nullptr;
    while (ring != nullptr && ring->try_pop(block)) {
      (void)tier_of(index).free(block, kUntagged, held_bytes_of[index]);
    }
  }
}

void DevicePoolCore::trim(std::size_t keep_bytes, ThreadCache* held, bool wait) noexcept {
  flush_keep_bytes.store(keep_bytes, std::memory_order_relaxed);
  std::vector<ThreadCache*> snapshot;
  try {
    std::lock_guard lock(registry_mutex);
    snapshot.reserve(caches.size());
    for (auto& cache : caches) snapshot.push_back(cache.get());
  } catch (...) {  // no host memory for the list: only the shared tiers are trimmed
  }
  {
    // Flag every cache, then one heavy barrier for all of them (see ThreadCache): after it,
    // an owner that has not yet claimed its cache sees the flag and stays out.
    std::lock_guard steal_lock(steal_mutex);
    std::size_t kept = 0;
    for (ThreadCache* cache : snapshot) {
      if (cache == held) {
        take_bins(*cache);  // the caller's own, claimed by the caller
      } else if (cache->steal.load(std::memory_order_relaxed) != ThreadCache::kClosed) {
        snapshot[kept++] = cache;  // (a closed one: close() takes its blocks)
      }
    }
    snapshot.resize(kept);
    for (ThreadCache* cache : snapshot) cache->steal.store(ThreadCache::kStealing, kDekkerStore);
    if (!snapshot.empty()) dekker.heavy();
    for (ThreadCache* cache : snapshot) {
      // Waits for an owner inside a short call; an owner inside a call that may block (an
      // upstream call, its own trim) is asked to flush before it returns instead. The
      // seq_cst store/load pairs here and in SlowSection guarantee one side sees the other.
      Backoff backoff;
      for (;;) {
        if (cache->state.load(kDekkerLoad) == ThreadCache::kFree) {
          take_bins(*cache);
          cache->flush_requested.store(false, std::memory_order_relaxed);
          break;
        }
        if (cache->in_slow_call.load(std::memory_order_seq_cst)) {
          cache->flush_requested.store(true, std::memory_order_seq_cst);
          if (cache->in_slow_call.load(std::memory_order_seq_cst)) break;  // it will see it
          continue;
        }
        backoff.pause();
      }
      cache->steal.store(ThreadCache::kNoSteal, std::memory_order_release);
    }
  }
  drain_rings();
  // Wait for every stream's work instead of recording a marker on each stream that freed
  // blocks: that stream may have been destroyed since (a marker on it would be undefined
  // behaviour), and trim gives memory back with cudaFree, which synchronizes anyway. Only
  // frees made before the synchronize began are known complete after it: a free racing it
  // on another thread keeps its stream (mark_frees).
  const std::uint64_t small_mark = small.mark_frees();
  const std::uint64_t large_mark = large.mark_frees();
  fence->quiesce();
  small.forget_streams(small_mark);
  large.forget_streams(large_mark);
  small.trim(0, wait);
  large.trim(keep_bytes, wait);
}

bool DevicePoolCore::close(std::uint64_t& blocks, std::uint64_t& bytes) noexcept {
  {
    std::lock_guard lock(registry_mutex);
    closing = true;  // no cache registers from now on: `caches` is frozen
  }
  // Close every cache for good (after any trim in progress: it holds steal_mutex from its
  // first flag to its last clear), then wait for the calls in progress on them. The wait
  // holds no mutex: an owner inside a blocking call may still trim (it skips closed caches).
  {
    std::lock_guard steal_lock(steal_mutex);
    for (auto& cache : caches) cache->steal.store(ThreadCache::kClosed, kDekkerStore);
  }
  dekker.heavy();
  for (auto& cache : caches) {
    Backoff backoff;
    while (cache->state.load(kDekkerLoad) != ThreadCache::kFree) backoff.pause();
    take_bins(*cache);
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
  trim(0, nullptr, false);
  blocks = acquires - releases;
  bytes = acquired - released;
  if (blocks == 0) return false;
  orphaned = true;
  orphan_blocks_outstanding = blocks;
  self_reference = shared_from_this();
  return true;
}

// Inline: every large request takes this path (the growing part is out of line).
inline void* DevicePoolCore::tier_allocate(SegmentTier& tier, std::size_t requested,
                                           std::size_t bytes, StreamKey key, ThreadCache* held) {
  if (void* block = tier.allocate(bytes, key, /*may_grow=*/false)) [[likely]] {
    return block;
  }
  return tier_grow(tier, requested, bytes, key, held);
}

void* DevicePoolCore::tier_grow(SegmentTier& tier, std::size_t requested, std::size_t bytes,
                                StreamKey key, ThreadCache* held) {
  SlowSection slow(held);
  // Growing past the budget the tiers share (segment_tier.hpp): when this tier's wholly
  // free segments cannot cover the excess, the other tier's give back the rest (the tier
  // itself gives back its own as it grows).
  // A virtual-memory large tier that does not unmap before mapping gives nothing back to
  // stay within the budget (it only waits for other streams' frees past it), so its growth
  // does not make the other tier give segments back either.
  const std::size_t excess =
      !tier.enforces_growth_budget()
          ? 0
          : gauge.excess_after_growth(tier.growth_bytes(bytes), tier.peak_growth_for(bytes),
                                      tier.growth_headroom_1024());
  if (const std::size_t own = excess > 0 ? tier.empty_bytes() : 0; own < excess) {
    (&tier == &small ? large : small).release_empty_for(excess - own);
  }
  try {
    return tier.allocate(bytes, key, true);
  } catch (const OutOfMemory&) {
    oom_retries.fetch_add(1, std::memory_order_relaxed);
  }
  // Everything cached, in every thread, back to the upstream (waiting for the work of
  // stream-ordered frees), then once more.
  trim(0, held, /*wait=*/true);
  try {
    return tier.allocate(bytes, key, true);
  } catch (const OutOfMemory& second) {
    const DevicePoolStats now = stats();
    const std::string source = &tier == &large && virtual_memory != nullptr
                                   ? std::string("virtual memory (cuMemCreate/cuMemMap)")
                                   : "upstream " + std::string(upstream->name());
    throw OutOfMemory(
        requested, now.bytes_cached, now.bytes_in_use,
        source + " failed after trimming the cache and retrying (" + second.what() + ")");
  }
}

void* DevicePoolCore::small_get(ThreadCache* cache, std::size_t index, StreamKey key) {
  void* block = nullptr;
  if (cache != nullptr && take_cached(*cache, index, key, block)) [[likely]] {
    return block;
  }
  if (MpmcRing<void*>* ring = ring_of(index); ring != nullptr && ring->try_pop(block)) {
    return block;
  }
  return tier_allocate(tier_of(index), SizeClasses::bytes_of(index), small_block_bytes(index), key,
                       cache);
}

// Returns false when the block is not this pool's (only detectable in the tiers).
bool DevicePoolCore::small_put(ThreadCache* cache, void* block, std::size_t index,
                               StreamKey key) noexcept {
  const std::uint64_t held = held_bytes_of[index];
  const std::uint64_t cached =
      cache != nullptr ? cache->cached_bytes.load(std::memory_order_relaxed) : 0;
  if (cache != nullptr && has_room(*cache, index, cached, held)) [[likely]] {
    if (cached == 0) {
      cache->tag = key;  // an empty cache takes the tag of what it holds next
    } else if (key != cache->tag && key != kUntagged) {
      if (cache->tag != kUntagged) {
        SlowSection slow(cache);
        take_bins(*cache);  // the old stream's blocks keep their tag in the tier
      }
      cache->tag = key;  // completed (untagged) blocks are safe on `key` too
    }
    put_cached(*cache, block, index, held);
    return true;
  }
  if (key == kUntagged) {
    if (MpmcRing<void*>* ring = ring_for_release(index); ring != nullptr && ring->try_push(block)) {
      return true;
    }
  }
  SlowSection slow(cache);
  return tier_of(index).free(block, key, held);
}

void DevicePoolCore::note_in_use(std::int64_t delta) noexcept {
  const std::int64_t now = in_use_now.fetch_add(delta, std::memory_order_relaxed) + delta;
  std::int64_t peak = in_use_peak.load(std::memory_order_relaxed);
  while (now > peak && !in_use_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

[[gnu::noinline, gnu::cold]] void DevicePoolCore::reject_request(std::size_t bytes,
                                                                 std::size_t alignment) const {
  if (bytes == 0) {
    throw InvalidArgument(
        "vram::DevicePool::allocate: zero bytes requested. Fix: keep zero-sized buffers as "
        "null sentinels and ask for at least one byte.");
  }
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > kMaxAlignment) {
    throw InvalidArgument("vram::DevicePool::allocate: alignment " + std::to_string(alignment) +
                          " is not a power of two up to " + std::to_string(kMaxAlignment) +
                          ". Fix: blocks are 256-byte aligned; ask for 256 or less.");
  }
  const DevicePoolStats now = stats();
  throw OutOfMemory(bytes, now.bytes_cached, now.bytes_in_use,
                    "larger than the largest block (1 TiB)");
}

void* DevicePoolCore::allocate(std::size_t bytes, std::size_t alignment, StreamKey key) {
  // Warm path: a block of this class in this thread's cache. `bytes - 1 < small_max` also
  // sends zero bytes to the slow path, which rejects it with the other bad requests.
  if (bytes - 1 < small_max && plain_calls && alignment - 1 < kMaxAlignment &&
      (alignment & (alignment - 1)) == 0) [[likely]] {
    const std::size_t index = SizeClasses::index_for(bytes);
    if (ThreadCache* cache = claim_warm(); cache != nullptr) [[likely]] {
      if (void* block = nullptr; take_cached(*cache, index, key, block)) [[likely]] {
        const std::uint64_t held_bytes = held_bytes_of[index];
        bump(cache->acquires, 1);
        bump(cache->acquired_bytes, held_bytes);
        if (cache->flush_requested.load(std::memory_order_seq_cst)) [[unlikely]] {
          return flush_and_unlock(*cache, block);  // see unlock_own_cache
        }
        cache->state.store(ThreadCache::kFree, std::memory_order_release);
        return block;
      }
      // Untouched: the slow path claims the cache again and honours a flush request.
      cache->state.store(ThreadCache::kFree, std::memory_order_release);
    }
  }
  return allocate_slow(bytes, alignment, key);
}

void* DevicePoolCore::allocate_slow(std::size_t bytes, std::size_t alignment, StreamKey key) {
  if (bytes - 1 >= SizeClasses::kMaxBytes || alignment - 1 >= kMaxAlignment ||
      (alignment & (alignment - 1)) != 0) [[unlikely]] {
    reject_request(bytes, alignment);
  }
  const bool is_small = bytes <= small_max;
  const std::size_t index = is_small ? SizeClasses::index_for(bytes) : 0;
  const std::size_t held_bytes = is_small ? held_bytes_of[index] : large.round(bytes);
  void* block = nullptr;
  if (ThreadCache* cache = lock_own_cache(); cache != nullptr) [[likely]] {
    try {
      block = is_small ? small_get(cache, index, key)
                       : tier_allocate(large, bytes, held_bytes, key, cache);
    } catch (...) {
      unlock_own_cache(*cache);
      throw;
    }
    bump(cache->acquires, 1);
    bump(cache->acquired_bytes, held_bytes);
    unlock_own_cache(*cache);
  } else {
    std::lock_guard lock(slow_mutex);
    if (orphaned) [[unlikely]] {
      throw InvalidArgument(
          "vram::DevicePool::allocate: the pool was destroyed. Fix: keep the DevicePool alive "
          "while it is used.");
    }
    block = is_small ? small_get(nullptr, index, key)
                     : tier_allocate(large, bytes, held_bytes, key, nullptr);
    bump(slow_acquires, 1);
    bump(slow_acquired_bytes, held_bytes);
  }
  if (options.track_peak_in_use) note_in_use(static_cast<std::int64_t>(held_bytes));
  if (options.validate_releases) {
    try {
      std::lock_guard lock(live_mutex);
      live_blocks[block] = held_bytes;
    } catch (...) {  // could not record it: undo the acquire so nothing is lost
      release(block, bytes, key);
      throw;
    }
  }
  return block;
}

bool DevicePoolCore::validate_release(void* block, std::size_t bytes) noexcept {
  std::lock_guard lock(live_mutex);
  auto it = live_blocks.find(block);
  const char* problem = nullptr;
  if (it == live_blocks.end()) {
    problem = "it was never handed out by this pool or was already released (double release)";
  } else if (it->second != bytes) {
    problem = "the byte count does not match the one it was allocated with";
  } else {
    live_blocks.erase(it);
    return true;
  }
  invalid_releases.fetch_add(1, std::memory_order_relaxed);
  std::fprintf(stderr,
               "vram::DevicePool: release of %p (%zu block bytes) rejected: %s. The block was "
               "not cached.\n",
               block, bytes, problem);
  return false;
}

// The warm release: room in this thread's cache and nothing to retag. False: nothing done
// (nothing held either).
inline bool DevicePoolCore::release_to_own_cache(void* block, std::size_t bytes,
                                                 StreamKey key) noexcept {
  const std::size_t index = SizeClasses::index_for(bytes);
  ThreadCache* cache = claim_warm();
  if (cache == nullptr) [[unlikely]]
    return false;
  const std::uint64_t held = held_bytes_of[index];
  const std::uint64_t cached = cache->cached_bytes.load(std::memory_order_relaxed);
  if (has_room(*cache, index, cached, held) &&
      (key == cache->tag || key == kUntagged || cached == 0)) [[likely]] {
    if (cached == 0) cache->tag = key;  // an empty cache takes the tag of what it holds
    put_cached(*cache, block, index, held);
    bump(cache->releases, 1);
    bump(cache->released_bytes, held);
    unlock_own_cache(*cache);
    return true;
  }
  // Untouched: the slow path claims the cache again and honours a flush request.
  cache->state.store(ThreadCache::kFree, std::memory_order_release);
  return false;
}

void DevicePoolCore::deallocate(void* block, std::size_t bytes, StreamKey key) noexcept {
  if (bytes - 1 < small_max && plain_calls && block != nullptr) [[likely]] {
    if (release_to_own_cache(block, bytes, key)) return;
    return release_slow(block, bytes, key);
  }
  deallocate_checked(block, bytes, key);
}

[[gnu::noinline]] void DevicePoolCore::deallocate_checked(void* block, std::size_t bytes,
                                                          StreamKey key) noexcept {
  if (block == nullptr) return;
  if (bytes == 0 || bytes > SizeClasses::kMaxBytes) {
    invalid_releases.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (options.validate_releases && !validate_release(block, block_bytes(bytes))) return;
  release(block, bytes, key);
}

void DevicePoolCore::release(void* block, std::size_t bytes, StreamKey key) noexcept {
  if (bytes <= small_max && !options.track_peak_in_use && release_to_own_cache(block, bytes, key)) {
    return;
  }
  release_slow(block, bytes, key);
}

void DevicePoolCore::release_slow(void* block, std::size_t bytes, StreamKey key) noexcept {
  const bool is_small = bytes <= small_max;
  const std::size_t index = is_small ? SizeClasses::index_for(bytes) : 0;
  const std::size_t held_bytes = is_small ? held_bytes_of[index] : large.round(bytes);
  const bool track = options.track_peak_in_use;
  if (ThreadCache* cache = lock_own_cache(); cache != nullptr) [[likely]] {
    bool known = true;
    if (is_small) {
      known = small_put(cache, block, index, key);
    } else {
      SlowSection slow(cache);
      known = large.free(block, key, bytes);
    }
    if (known) [[likely]] {
      bump(cache->releases, 1);
      bump(cache->released_bytes, held_bytes);
    }
    unlock_own_cache(*cache);
    if (!known) {
      invalid_releases.fetch_add(1, std::memory_order_relaxed);
    } else if (track) {
      note_in_use(-static_cast<std::int64_t>(held_bytes));
    }
    return;
  }
  // Slow path. When orphaned, the last release drops the self-reference after the lock is
  // released (declared first, destroyed last): that may destroy *this.
  std::shared_ptr<DevicePoolCore> last;
  std::lock_guard lock(slow_mutex);
  bool known = true;
  if (!orphaned) {
    known = is_small ? small_put(nullptr, block, index, key) : large.free(block, key, bytes);
  } else {
    known = is_small ? tier_of(index).free(block, key, held_bytes) : large.free(block, key, bytes);
    small.trim(0, false);  // give wholly free segments straight back
    large.trim(0, false);
  }
  if (!known) {
    invalid_releases.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  bump(slow_releases, 1);
  bump(slow_released_bytes, held_bytes);
  if (track) note_in_use(-static_cast<std::int64_t>(held_bytes));
  if (orphaned && --orphan_blocks_outstanding == 0) last = std::move(self_reference);
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
  std::size_t ring_bytes = 0;
  for (std::size_t index = 0; index < small_classes; ++index) {
    if (const MpmcRing<void*>* ring = ring_of(index)) {
      ring_bytes += ring->size() * small_block_bytes(index);
    }
  }
  const SegmentTier::Counters a = small.counters();
  const SegmentTier::Counters b = large.counters();
  s.upstream_allocations = a.upstream_allocations + b.upstream_allocations;
  s.upstream_frees = a.upstream_frees + b.upstream_frees;
  s.misses = s.upstream_allocations + a.failed_upstream_allocations + b.failed_upstream_allocations;
  s.hits = s.acquires > s.upstream_allocations ? s.acquires - s.upstream_allocations : 0;
  s.oom_retries = oom_retries.load(std::memory_order_relaxed);
  s.invalid_releases = invalid_releases.load(std::memory_order_relaxed);
  s.bytes_in_use = acquired_bytes > released_bytes ? acquired_bytes - released_bytes : 0;
  s.bytes_reserved = gauge.reserved.load(std::memory_order_relaxed);
  s.peak_bytes_reserved = gauge.peak.load(std::memory_order_relaxed);
  s.bytes_cached = s.bytes_reserved > s.bytes_in_use ? s.bytes_reserved - s.bytes_in_use : 0;
  s.bytes_cached_in_threads = thread_cached;
  s.bytes_cached_in_rings = ring_bytes;
  s.segments = a.segments + b.segments;
  s.peak_bytes_in_use = static_cast<std::size_t>(
      std::max<std::int64_t>(0, in_use_peak.load(std::memory_order_relaxed)));
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
  if (block_ != nullptr) core_->deallocate(block_, bytes_, detail::kUntagged);
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

// A moved-from pool has no core: calls that hand out memory throw, the others do nothing
// (see the header's "Bad input"). The check is one test of a pointer the call loads anyway.
detail::DevicePoolCore& DevicePool::live_core(const char* call) const {
  if (!core_) [[unlikely]] {
    throw InvalidArgument(std::string("vram::DevicePool::") + call +
                          ": the pool was moved from. Fix: use the DevicePool it was moved to.");
  }
  return *core_;
}

void* DevicePool::allocate(std::size_t bytes, std::size_t alignment) {
  return live_core("allocate").allocate(bytes, alignment, detail::kUntagged);
}

void DevicePool::deallocate(void* block, std::size_t bytes, std::size_t /*alignment*/) noexcept {
  if (core_) [[likely]]
    core_->deallocate(block, bytes, detail::kUntagged);
}

DevicePool::Lease DevicePool::acquire(std::size_t bytes) {
  void* block = live_core("acquire").allocate(bytes, kDefaultAlignment, detail::kUntagged);
  return Lease(core_.get(), block, bytes);
}

void* DevicePool::allocate_async(std::size_t bytes, cudaStream_t stream) {
  return live_core("allocate_async").allocate(bytes, kDefaultAlignment, detail::stream_key(stream));
}

void DevicePool::deallocate_async(void* block, std::size_t bytes, cudaStream_t stream) noexcept {
  if (core_) [[likely]]
    core_->deallocate(block, bytes, detail::stream_key(stream));
}

bool DevicePool::uses_virtual_memory() const noexcept {
  return core_ && core_->virtual_memory != nullptr;
}

std::size_t DevicePool::block_bytes(std::size_t bytes) const noexcept {
  return core_ ? core_->block_bytes(bytes) : 0;
}

void DevicePool::trim(std::size_t keep_bytes) {
  if (!core_) return;
  core_->trim(keep_bytes, nullptr, true);
  // The growth budget restarts from what is in use now: a caller that trims wants the
  // memory held to follow today's use, not the all-time peak.
  core_->small.restart_peak();
  core_->large.restart_peak();
}

DevicePoolStats DevicePool::stats() const { return core_ ? core_->stats() : DevicePoolStats{}; }

void DevicePool::reset_peak() noexcept {
  if (!core_) return;
  core_->gauge.peak.store(core_->gauge.reserved.load(std::memory_order_relaxed),
                          std::memory_order_relaxed);
  core_->in_use_peak.store(core_->in_use_now.load(std::memory_order_relaxed),
                           std::memory_order_relaxed);
}

namespace {
// What a moved-from pool's options() and upstream() refer to: defaults, and an upstream
// that hands out nothing.
class MovedFromUpstream final : public Upstream {
 public:
  void* allocate(std::size_t) override {
    throw InvalidArgument(
        "vram::DevicePool::upstream: the pool was moved from. Fix: use the DevicePool it was "
        "moved to.");
  }
  void deallocate(void*, std::size_t) noexcept override {}
  MemoryKind kind() const noexcept override { return MemoryKind::device; }
  std::string_view name() const noexcept override { return "none (moved-from DevicePool)"; }
};
}  // namespace

const DevicePool::Options& DevicePool::options() const noexcept {
  static const Options defaults{};
  return core_ ? core_->options : defaults;
}

Upstream& DevicePool::upstream() const noexcept {
  static MovedFromUpstream none;
  return core_ ? *core_->upstream : none;
}

}  // namespace vram
