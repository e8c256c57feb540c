// vram/device_pool.hpp: a caching pool of raw device blocks; zero driver calls when warm.
//
//   vram::DevicePool pool(std::make_shared<vram::DeviceMemoryUpstream>(0),
//                         {.max_cached_bytes = 8_GiB});
//   {
//     auto lease = pool.acquire(1 << 20);     // a 1 MiB block (class 1 MiB)
//     launch(kernel, lease.data());
//     ... stream.synchronize();               // or hand the lease to a PendingWork
//   }                                          // block goes back to the free list
//   void* raw = pool.allocate(4096);           // raw form, CCCL cuda::mr::resource style
//   pool.deallocate(raw, 4096);
//
// When a released block may be handed out again
//   At once: release means "no work uses this block any more". The pool never looks at
//   streams or events. A block still read or written by queued GPU work must not be
//   released; give its lease to a vram::PendingWork with an event recorded after that
//   work, which releases it only once the event has fired (see pending_work.hpp).
//
// Structure and hot path
//   Requests round up to a size class (size_classes.hpp: 4 per power of two, < 25% waste).
//   Tier 1, per thread: a few blocks per class (thread_cache_blocks, classes up to
//   thread_cache_max_block_bytes, at most thread_cache_max_bytes in all), touched only by
//   its thread: acquire and release are a pop and push on a thread-local array.
//   Tier 2, shared: per class a bounded lock-free MPMC ring (Vyukov) of free blocks.
//   A miss goes to the upstream. Warm acquire/release make no CUDA call, take no lock and
//   allocate no host memory (first use of a pool on a thread registers that thread once).
//
// Retention bound
//   The shared rings hold at most max_cached_bytes and max_cached_blocks_per_class blocks
//   per class; a release beyond either frees the block to the upstream. Each thread's
//   cache holds in addition at most thread_cache_max_bytes (default 32 MiB).
//   trim(keep) frees every thread's cache (idle, exited or busy) and then the shared rings
//   down to `keep` bytes. An idle thread's cache is taken at once; a thread inside a pool
//   call at that moment frees its cache when that call returns.
//
// Thread caches without a lock on the warm path
//   Each thread cache has a state word. Its thread claims it with one uncontended CAS for
//   the length of a call (nobody else waits on it: it is its thread's cache line); trim()
//   claims it the same way to take the blocks out, so it reaches idle threads, and asks a
//   busy owner to flush on its way out. The cache of an exited thread is emptied into the
//   shared rings and adopted by the next thread that registers. A thread whose
//   thread_local teardown already destroyed vram's per-thread directory uses a slow path
//   (a pool mutex, no thread cache), so nothing it releases is stranded.
//
// Out of memory
//   An upstream OutOfMemory trims the whole shared cache and retries once; a second
//   failure throws vram::OutOfMemory with the size asked and the bytes cached and in use.
//
// Bad input (the same rules in every vram pool)
//   Zero bytes, or an alignment above 256 or not a power of two: vram::InvalidArgument,
//   nothing allocated. Above 1 TiB: vram::OutOfMemory. Null release: no-op.
//   Foreign pointer, double release or wrong size: with validate_releases (default in
//   debug builds) the release is rejected with a message on stderr and counted in
//   invalid_releases, and nothing is cached; without it (release builds) the behaviour is
//   undefined: the block would be cached and handed out again.
//   cudaDeviceReset() invalidates every cached block, and the warm path (no driver call)
//   cannot notice: call trim(0) before a reset, or destroy the pool.
//   Destroying the pool with blocks still leased: the cache is freed, a warning names the
//   bytes still leased, and the pool's bookkeeping stays alive until the last of them is
//   released (each then goes straight back to the upstream), so no lease dangles.
//   Destruction may race releases on other threads: it closes every thread cache (waiting
//   for calls in progress), after which all calls are serialised by a pool mutex, so the
//   count of leased blocks is exact and every block reaches the upstream exactly once
//   (tests/device_pool_test.cpp DevicePoolLifetime.*, run under ASan and TSan).
//   Allocating from a pool while another thread destroys it is undefined.
//
// Counters are per thread, written with plain stores by their owner and summed by
// stats(), which is exact when no acquire or release runs at the same moment.
#pragma once

#include <cuda/memory_resource>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "vram/upstream.hpp"

namespace vram {

namespace detail {
struct DevicePoolCore;
}

struct DevicePoolStats {
  std::uint64_t acquires = 0;  // successful allocate()/acquire() calls
  std::uint64_t hits = 0;      // acquires served from a free list
  std::uint64_t misses = 0;    // acquires that went to the upstream
  std::uint64_t releases = 0;  // accepted deallocate()/lease returns
  std::uint64_t upstream_allocations = 0;
  std::uint64_t upstream_frees = 0;
  std::uint64_t oom_retries = 0;       // upstream OutOfMemory answered by trim + retry
  std::uint64_t invalid_releases = 0;  // rejected by validate_releases
  std::size_t bytes_in_use = 0;        // class bytes handed out and not yet released
  std::size_t bytes_cached = 0;        // held in free lists (both tiers)
  std::size_t bytes_cached_in_threads = 0;
  std::size_t bytes_reserved = 0;       // held from the upstream: in use + cached
  std::size_t peak_bytes_reserved = 0;  // high-water mark of bytes_reserved
};

// Configuration of a DevicePool (see the class comment for what each bound means).
struct DevicePoolOptions {
  std::size_t max_cached_bytes = std::size_t{4} << 30;
  std::size_t max_cached_blocks_per_class = 1024;  // ring of a class, made on first use
  std::size_t thread_cache_blocks = 4;             // 0 turns the per-thread tier off; at most 16
  std::size_t thread_cache_max_block_bytes = std::size_t{4} << 20;
  std::size_t thread_cache_max_bytes = std::size_t{32} << 20;  // per thread, all classes
#ifdef NDEBUG
  bool validate_releases = false;
#else
  bool validate_releases = true;
#endif
};

class DevicePool {
 public:
  static constexpr std::size_t kDefaultAlignment = 256;

  using Options = DevicePoolOptions;

  // A block returned to the pool on destruction. Move-only; the pool must outlive it
  // (or see the destruction rule above).
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { reset(); }

    void* data() const noexcept { return block_; }
    std::size_t size() const noexcept { return bytes_; }
    explicit operator bool() const noexcept { return block_ != nullptr; }
    // Returns the block to the pool now.
    void reset() noexcept;
    // Gives up ownership: the caller must deallocate(pointer, size()) on the same pool.
    [[nodiscard]] void* release() noexcept;

   private:
    friend class DevicePool;
    Lease(detail::DevicePoolCore* core, void* block, std::size_t bytes) noexcept
        : core_(core), block_(block), bytes_(bytes) {}
    detail::DevicePoolCore* core_ = nullptr;
    void* block_ = nullptr;
    std::size_t bytes_ = 0;
  };

  // A pool over device memory of `device` (cudaMalloc).
  explicit DevicePool(int device, Options options = {});
  explicit DevicePool(std::shared_ptr<Upstream> upstream, Options options = {});
  ~DevicePool();
  DevicePool(DevicePool&& other) noexcept = default;
  DevicePool& operator=(DevicePool&& other) noexcept;
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment = kDefaultAlignment);
  void deallocate(void* block, std::size_t bytes,
                  std::size_t alignment = kDefaultAlignment) noexcept;
  [[nodiscard]] Lease acquire(std::size_t bytes);

  // Frees cached blocks to the upstream until at most `keep_bytes` stay cached (see above).
  void trim(std::size_t keep_bytes = 0);
  DevicePoolStats stats() const;
  // Starts a new measurement window: peak_bytes_reserved restarts from bytes_reserved.
  void reset_peak() noexcept;
  const Options& options() const noexcept;
  Upstream& upstream() const noexcept;

  bool operator==(const DevicePool& other) const noexcept { return core_ == other.core_; }
  // CCCL: memory from this pool is device memory (with a device upstream).
  friend void get_property(const DevicePool&, ::cuda::mr::device_accessible) noexcept {}

 private:
  std::shared_ptr<detail::DevicePoolCore> core_;
};

}  // namespace vram
