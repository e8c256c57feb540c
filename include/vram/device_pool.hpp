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
// When a deallocated block may be handed out again
//   deallocate() / a Lease's return: at once, to any caller. Deallocating means "no work uses
//   this block any more"; a block still used by queued GPU work must not be deallocated that
//   way (give its lease to a vram::PendingWork, or use deallocate_async).
//   deallocate_async(block, bytes, S): at once to later allocate_async(..., S) calls (stream
//   order on S makes that safe); to any other stream, or to allocate(), only after the work
//   queued on S at the free has completed: a marker (a recycled CUDA event, see
//   stream_fence.hpp) recorded on S after the free has completed, or a device-wide quiesce
//   (a device synchronize) began after it. A free on a steady stream (the calling thread
//   has freed on it 32 times outside its thread cache having come back to it from another
//   stream, else 48 times) records nothing and keeps the warm path (but for a chunk it sends
//   back, below). A
//   free on a young stream (a stream per request, or any stream not yet steady) records one
//   marker on S first and goes to the shared tiers, filed there under that marker
//   (stats().stream_markers; S's own later requests may use it at once), so S's blocks reach
//   other streams once its work has run, whatever its caller does with S next. A
//   deallocate_async on S that leaves a chunk of a thread's heap wholly free and sends it
//   back to its shared tier (ThreadCacheOptions::large_chunk_bytes; the small tier's heaps
//   too) records one marker on S as well and files the chunk's largest range of S under it
//   (also counted in stats().stream_markers): other streams then reach that memory once
//   the marker completed, with no want on S. When another
//   stream needs the memory (its tier would otherwise grow), the pool wants a marker on a
//   steady S: on the
//   legacy default stream (the null stream, cudaStreamLegacy, every thread's
//   cudaStreamPerThread) it records one at once; on any other stream the next
//   allocate_async or deallocate_async that passes S records one, covering every free on S
//   that reached the tiers before it. Only a call on S proves that S still exists, so the
//   pool records on a caller's stream inside no other call (and under no tier mutex).
//   Markers are checked without blocking on the allocation path, with one exception: a
//   tier that must grow (the slow path: an upstream call) first waits on the host for the
//   recorded marker of each stream whose freed blocks fill a whole segment that could serve
//   the request (or go back, when growing passes the budget below), holding the tier's
//   growth mutex but not its mutex (other threads allocate and free meanwhile; upstream
//   calls, maps and unmaps are made the same way, segment_tier.hpp). The large tier over virtual
//   memory, before it maps more, takes back the requesting stream's own blocks that a want's
//   or a fence's marker was recorded for (safe for it in stream order; a young stream's own
//   frees it uses directly, each under its marker), wants markers on the other streams whose
//   freed blocks could serve the request (on every other stream with freed blocks when
//   mapping would pass the budget below) and, past the budget, waits for those recorded that
//   could serve (never for a marker on the requesting stream). When growing would pass the
//   budget, or raise the peak of reserved bytes, while freed blocks of streams with no
//   marker recorded (no call on them since) could serve the request or go back, the pool
//   quiesces the device once instead (concurrent requests share one; none while a capture
//   scope is open or for a request on a stream being captured; counted in
//   stats().stream_quiesces) and then treats every block freed before it as free for all:
//   streams that free beside each other cannot make it grow without bound. So never call the
//   pool from a cudaLaunchHostFunc/stream callback: it could wait for the stream it runs on.
//   trim(), the out-of-memory retry and destruction record nothing on any stream: they
//   quiesce the device and then treat every stream-freed block as free for all.
//   allocate_async(bytes, S) hands out blocks that are free on S or completed.
//   Stream lifetime: S may be destroyed once its work has completed (cudaStreamSynchronize,
//   then cudaStreamDestroy, as a request handler does when done) with blocks freed on it
//   still waiting in the pool: no extra call is needed, nothing is recorded on S after the
//   last call that passed it, and its blocks reach other streams after a marker its calls
//   recorded (a young stream's frees each record one, except a free of a block that a
//   thread's heap placed: that block waits, as a steady stream's, for a want or a quiesce)
//   or after a quiesce. Every call that passes S needs S alive (not yet destroyed): the
//   pool may record on it or ask the driver about it. The pool tells
//   streams apart by handle: a new stream that the driver gives the handle of a destroyed S
//   takes S's freed blocks as its own at once, which is safe because S's work has completed;
//   so do not destroy S with work still queued that uses blocks freed on it. The cost of
//   destroying a steady stream: its blocks freed with no marker since wait for the next
//   quiesce (growth past the budget or to a new peak, the out-of-memory retry, trim()); a
//   workload whose steady streams free blocks that other streams then need pays a device
//   synchronize for each such growth (bench/RESULTS.md has the counts on the recorded
//   traces). Destroying the pool after S is safe.
//   CUDA graphs: a stream being captured never gets a stream marker (its freed blocks stay
//   its own until the capture ends and another request records one), and the pool's event calls
//   run in relaxed capture mode (as PyTorch's allocator's do), so they do not invalidate a
//   capture in global mode. Memory a captured graph uses is kept apart only under a capture
//   scope (capture_into, below: graph pools); without one, a block freed inside the capture
//   is handed out again, and every launch of the graph writes it.
//
// How the pool keeps this contract (its tiers, the growth budget, the thread caches'
// handshake): src/README.md, "DevicePool: how it works".
//
// Out of memory
//   An upstream OutOfMemory (or, with virtual memory, one from cuMemCreate/cuMemMap/
//   cuMemSetAccess) trims every cache (waiting for stream-ordered frees' work) and retries
//   once; a second failure throws vram::OutOfMemory with the size asked and the bytes
//   cached and in use.
//
// Bad input (the same rules in every vram pool)
//   Zero bytes, or an alignment above 256 or not a power of two: vram::InvalidArgument,
//   nothing allocated (whatever alignment the upstream promises: blocks are 256-byte
//   aligned; an upstream that promises less than 256 is refused at construction, and one
//   that returns null gives vram::OutOfMemory). Above 1 TiB: vram::OutOfMemory. Null
//   deallocation: no-op. A moved-from pool: allocate, acquire and allocate_async throw
//   vram::InvalidArgument; deallocations, trim and reset_peak do nothing (the block stays leased
//   from the pool it was moved to); stats() is all zero.
//   Foreign pointer, double deallocation or wrong size: with validate_deallocations (default in
//   debug builds) the deallocation is rejected with a message on stderr and counted in
//   invalid_deallocations, and nothing is cached; without it (release builds) a deallocation under
//   a large size (above small_block_max_bytes) of a block unknown to the large tier, of one
//   allocated with another size (rounded to 512 bytes), or of one deallocated already (on
//   this or any other thread, before this deallocation began) is still rejected, said on stderr
//   and counted, but a small one is undefined behaviour: it would be cached and handed out
//   again. Without validate_deallocations, two deallocations of one block that race each other on
//   two threads are undefined, and a second deallocation after another request got the same block
//   at the same size is taken for a deallocation of that request's block. A deallocation of zero
//   bytes, or of more than 1 TiB, is rejected, said and counted whatever the options.
//   cudaDeviceReset() invalidates every cached block, and the warm path (no driver call) cannot
//   notice: destroy the pool before a reset (with segments, trim(0) before it also works; a
//   virtual-memory large tier keeps its reserved address range after trim(0)). Destroying the pool
//   with blocks still leased: the cache is freed, a warning names the bytes still leased, and the
//   pool's bookkeeping stays alive until the last of them is deallocated (each then goes straight
//   back to the upstream), so no lease dangles. Destruction may race deallocations on other
//   threads: it closes every thread cache (waiting for calls in progress), after which all calls
//   are serialised by a pool mutex, so the count of leased blocks is exact and every block reaches
//   the upstream exactly once (tests/device_pool_test.cpp DevicePoolLifetime.*, run under ASan and
//   TSan). A deallocation of a graph pool's block keeps the pool's bookkeeping alive until it
//   returns. Allocating from a pool while another thread destroys it is undefined.
//
// Counters are per thread, written with plain stores by their owner and summed by
// stats(), which is exact when no allocation or deallocation runs at the same moment.
// peak_bytes_in_use is kept only with Options::track_peak_in_use (one shared atomic add
// per call; exact, including concurrent calls).
#pragma once

#include <cuda/memory_resource>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "vram/memory_map.hpp"
#include "vram/reserve_observer.hpp"
#include "vram/sleep_tag.hpp"
#include "vram/stream_fence.hpp"
#include "vram/upstream.hpp"

namespace vram {

namespace detail {
class DevicePoolCore;
struct TagScopeEntry;
}  // namespace detail

// Renamed fields (releases, invalid_releases): see "Renamed" above DevicePoolOptions.
struct DevicePoolStats {
  std::uint64_t acquires = 0;       // successful allocate()/acquire() calls
  std::uint64_t hits = 0;           // acquires served from a free list
  std::uint64_t misses = 0;         // acquires that went to the upstream
  std::uint64_t deallocations = 0;  // accepted deallocate()/lease returns
  // Driver-side growth and give-back: segments taken from / given to the upstream, and with
  // a virtual-memory large tier its runs mapped / unmapped (cuMemCreate+cuMemMap, not
  // through the upstream).
  std::uint64_t upstream_allocations = 0;
  std::uint64_t upstream_frees = 0;
  std::uint64_t oom_retries = 0;  // upstream OutOfMemory answered by trim + retry
  // Device-wide quiesces (a device synchronize, see "Stream lifetime"): every one the pool
  // made (trim, the out-of-memory retry, destruction, and growth past the budget), and of
  // those, the ones growth past the budget made for blocks of streams not seen since they
  // freed them. stream_marker_wants: how often a request wanted a marker on a caller's stream
  // (recorded by that stream's next stream-ordered call).
  std::uint64_t quiesces = 0;
  std::uint64_t stream_quiesces = 0;
  std::uint64_t stream_marker_wants = 0;
  // Markers the tiers took from deallocate_async calls: on young streams (one each; a stream
  // the calling thread has not freed on often: a stream per request), so that their blocks
  // reach other streams after the stream is destroyed, and on the call's stream when the
  // free sent a wholly free chunk of a thread's heap back to its tier (thread_heap.hpp).
  // A want's markers are not counted.
  std::uint64_t stream_markers = 0;
  // Refused deallocations (with or without validate_deallocations), and refused
  // release_graph_pool calls (a release with no graph use open).
  std::uint64_t invalid_deallocations = 0;
  std::size_t bytes_in_use = 0;  // block bytes handed out (block_bytes()) and not deallocated
  std::size_t bytes_cached = 0;  // reserved and not in use: caches, rings, free ranges
  std::size_t bytes_cached_in_threads = 0;
  // Of bytes_cached_in_threads: free bytes in the chunks of the threads' heaps
  // (thread_cache.large_chunk_bytes).
  std::size_t bytes_cached_in_thread_heaps = 0;
  std::size_t bytes_cached_in_rings = 0;
  std::size_t bytes_reserved = 0;       // segments held, plus granules mapped: in use + cached
  std::size_t peak_bytes_reserved = 0;  // high-water mark of bytes_reserved
  std::size_t peak_bytes_in_use = 0;    // high-water mark of bytes_in_use (track_peak_in_use)
  std::uint64_t segments = 0;  // segments held (a virtual tier counts its reserved range as one)
  // Graph pools (see "CUDA graphs"): bytes they hold, live and free (counted in
  // bytes_in_use: the shared tiers lent them out), and how many pools hold memory or a use.
  std::size_t graph_pool_bytes = 0;
  std::uint64_t graph_pools = 0;
  // Captures without a scope ("CUDA graphs"): allocate_async calls served by a capture's
  // own pool, and deallocate_async calls that gave it a block that was not yet its.
  std::uint64_t unscoped_capture_calls = 0;
  // Sleep tags (vram/sleep_tag.hpp): granules mapped in the tags' own ranges (counted in
  // bytes_reserved; their blocks in bytes_in_use) and how many tags sleep.
  std::size_t sleep_tag_bytes_mapped = 0;
  std::uint64_t sleeping_tags = 0;
};

// What backs DevicePool's large tier (blocks above small_block_max_bytes).
//   automatic       virtual memory when the upstream is vram's DeviceMemoryUpstream (as
//                   with DevicePool(int device)), the device supports CUDA virtual memory
//                   management and no other device can access it by peer access (mapped
//                   memory is reachable only from the devices cuMemSetAccess names, and
//                   cudaDeviceEnablePeerAccess does not extend that); segments otherwise
//                   (any other upstream is used as given: a custom device upstream is
//                   never bypassed).
//   segments        segments from the upstream (cudaMalloc): best-fit split and coalesce
//                   within each segment. The memory can be shared by CUDA IPC
//                   (cudaIpcGetMemHandle), which virtual memory cannot.
//   virtual_memory  always (over a host upstream: the host emulation; on a device without
//                   virtual memory management: segments). The pool's device and every
//                   device that can reach it by peer access (cudaDeviceCanAccessPeer) may
//                   read and write the large blocks.
// Over virtual memory free ranges merge across the whole reservation and a run of granules
// goes back only when all of it is free; over segments a free range never crosses a
// segment's end and a segment goes back only when all of it is free.
enum class LargeTierMemory : std::uint8_t { automatic, segments, virtual_memory };

// Configuration of a DevicePool (see the class comment for what each bound means), in
// groups: the per-thread caches, the small tier, the large tier, then what concerns the
// whole pool. Designated initializers name the group:
//
//   vram::DevicePool pool(0, {.max_cached_bytes = 8_GiB,
//                             .thread_cache = {.blocks = 4},
//                             .large_tier = {.memory = vram::LargeTierMemory::segments}});
//
// Where each field of the earlier flat struct went:
//   thread_cache_blocks            thread_cache.blocks
//   thread_cache_max_block_bytes   thread_cache.max_block_bytes
//   thread_cache_max_bytes         thread_cache.max_bytes
//   thread_cache_large_bytes       thread_cache.large_bytes
//   thread_cache_large_from_start  thread_cache.large_from_start
//   small_block_max_bytes          small_tier.max_block_bytes
//   small_segment_max_bytes        small_tier.segment_max_bytes
//   large_segment_bytes            large_tier.segment_bytes
//   max_segment_waste_bytes        large_tier.max_segment_waste_bytes
//   large_tier_memory              large_tier.memory
//   virtual_reservation_bytes      large_tier.virtual_reservation_bytes
//   unmap_before_map               large_tier.unmap_before_map
//   virtual_run_bytes              large_tier.virtual_run_bytes
//   virtual_map_ahead_bytes        large_tier.virtual_map_ahead_bytes
//   the others (max_cached_bytes, max_cached_blocks_per_class, validate_releases, now
//   validate_deallocations, growth_headroom, track_peak_in_use, fence, detect_unscoped_capture)
//   stay at the top.
// Renamed (a block back in its pool is "deallocated", as deallocate() says; a data member of
// an aggregate has no alias, so the old names are gone):
//   DevicePoolOptions::validate_releases   DevicePoolOptions::validate_deallocations
//   DevicePoolStats::releases              DevicePoolStats::deallocations
//   DevicePoolStats::invalid_releases      DevicePoolStats::invalid_deallocations
struct DevicePoolOptions {
  // Tier 1: per thread, a few blocks of each small class, no lock on the warm path.
  struct ThreadCacheOptions {
    std::size_t blocks = 8;  // per class; 0 turns the per-thread tier off; at most 16
    std::size_t max_block_bytes = std::size_t{1} << 20;  // the largest class kept
    std::size_t max_bytes = std::size_t{8} << 20;        // per thread, all classes
    // Per thread, all classes, once the thread's heaps turn on (it met other threads on a
    // tier, or made its first large request with large_from_start; below): a thread's blocks
    // of sizes that change from request to request then stay in its own bins instead of
    // passing through the rings every thread shares. The bound is then the larger of the two;
    // 0 keeps max_bytes. Heaps never turn on with large_chunk_bytes 0 or large_bytes / 4 at
    // most small_tier.max_block_bytes: the bound stays max_bytes. A thread alone (by default)
    // keeps max_bytes, so single-threaded workloads cache what they cached before.
    std::size_t contended_max_bytes = std::size_t{32} << 20;
    // Per thread, large blocks (above small_tier.max_block_bytes) kept for the same size
    // again (at most 32 blocks); flushed to the large tier before any tier grows, before an
    // out-of-memory retry, on trim() and at thread exit. 0 turns it off.
    // By default a thread starts caching large blocks once it has met other threads on the
    // large tier (its mutex found locked): a thread alone places blocks exactly as without the
    // cache. large_from_start: from its first call.
    std::size_t large_bytes = std::size_t{256} << 20;
    bool large_from_start = false;
    // Per thread, once its large-block cache is on: large requests up to large_bytes / 4 of
    // any size are placed by best fit in chunks of at least this many bytes that the thread
    // takes from the large tier, under a mutex of its own, so threads whose sizes change from
    // request to request do not meet on the large tier's mutex (src/device_pool/
    // thread_heap.hpp). A chunk goes back to the large tier once wholly free (wholly free
    // ones up to large_bytes are kept, and flushed as cached large blocks are). 0 turns it
    // off (then the cache keeps exact sizes only).
    std::size_t large_chunk_bytes = std::size_t{64} << 20;
  };
  // The size classes and the tier of 2 MiB segments they are carved from.
  struct SmallTierOptions {
    std::size_t max_block_bytes = std::size_t{1} << 20;  // 256 B .. 2 MiB: a size class up to it
    // The largest block (block_bytes()) carved out of the small tier's 2 MiB segments; values
    // below 2 KiB count as 2 KiB. Small blocks above it (up to max_block_bytes) are cached
    // per thread and in the rings like every small block, but carved out of the large tier,
    // so free memory of either kind serves both. 0 (automatic): 256 KiB when the large tier
    // runs over virtual memory, else every small block comes from the small tier. Such a
    // block freed on a stream, once it reaches the large tier (past the thread cache), merges
    // with untagged free neighbours and makes them that stream's until its marker completes,
    // as a large block's free always does.
    std::size_t segment_max_bytes = 0;
  };
  // Requests above small_tier.max_block_bytes: best fit, split and coalesce over segments or
  // one reserved range of virtual memory.
  struct LargeTierOptions {
    std::size_t segment_bytes = std::size_t{20} << 20;  // segments for requests under half
    // A wholly free large segment is not split for a request that would leave more than
    // this many bytes of it idle: the tier grows by a segment sized for the request (the
    // idle one goes back only when growing passes the budget: the tiers' peaks +
    // growth_headroom). Lower keeps reserved closer to in use at the price of more upstream
    // calls; SIZE_MAX splits every segment that fits.
    std::size_t max_segment_waste_bytes = std::size_t{1} << 30;
    // What backs the large tier (see LargeTierMemory). Virtual memory: one reserved address
    // range backed by 2 MiB granules (CUDA virtual memory management over device memory;
    // the host emulation, HostVirtualMemory charging the upstream, over any other upstream).
    // The unmapped granules under a new block are mapped as one run (one physical
    // allocation and map); a run goes back only when all of it is free. Free ranges merge
    // across the whole range and reserved bytes are the granules mapped.
    LargeTierMemory memory = LargeTierMemory::automatic;
    // 0: twice the device's memory, or 64 GiB; <= 16 TiB
    std::size_t virtual_reservation_bytes = 0;
    bool unmap_before_map = false;  // keep reserved at in use, at the price of more maps
    // The longest run of granules one map covers (rounded down to granules, at least one);
    // a run is also at most 1/16 of the device memory still free when it is mapped. A map
    // costs about the same from 2 MiB to 256 MiB, so long runs make a pool that starts
    // empty cheap to fill; but a run goes back only whole, so a block left in a freed run
    // keeps up to its run mapped through trim() (near the end of memory runs are short, so
    // what a reclaim needs can still go back).
    std::size_t virtual_run_bytes = std::size_t{1} << 30;
    // When a block needs new granules, its run also maps up to this much of the free range
    // right after it (at most 1/4 of what the large tier holds, within the run's cap, only
    // for a block that raises the peak of the bytes carved out of the tier since it last
    // unmapped granules, and only while the tier holds at most 1/4 of the device memory
    // still free): a workload that grows in many small steps (a decode loop's caches, a
    // model loaded tensor by tensor) makes a few maps instead of one per step. The extra
    // granules serve later blocks; like any granule of a run they go back only with the
    // whole run. 0: map only what each block needs.
    std::size_t virtual_map_ahead_bytes = std::size_t{128} << 20;
  };

  std::size_t max_cached_bytes = std::size_t{4} << 30;  // free bytes per tier, ring bytes
  std::size_t max_cached_blocks_per_class = 64;         // ring of a class, made on first use
  ThreadCacheOptions thread_cache;
#ifdef NDEBUG
  bool validate_deallocations = false;
#else
  bool validate_deallocations = true;
#endif
  SmallTierOptions small_tier;
  LargeTierOptions large_tier;
  // Reserved may exceed the sum of the tiers' peaks of carved-out bytes by this fraction of
  // it before a growing tier gives wholly free segments back (src/README.md, "Memory held").
  // Higher means fewer upstream calls when request sizes vary from step to step (a
  // non-moving pool needs free room to fit new shapes) at the price of more memory held;
  // 0 keeps reserved at the peak. Values above 1024 count as 1024; negative or NaN:
  // vram::InvalidArgument.
  double growth_headroom = 1.0 / 16;
  bool track_peak_in_use = false;
  // Completion of stream-ordered frees; null: CUDA events over a device upstream, "always
  // complete" over any other (host memory has no queued work). ManualFence emulates
  // streams in host-only replay and tests.
  std::shared_ptr<StreamFence> fence;
  // allocate_async/deallocate_async ask whether their stream is being captured into a CUDA
  // graph, so that a capture without a scope cannot hand the graph's blocks to other work
  // ("CUDA graphs" below). It costs one driver query per stream-ordered call (never for the
  // legacy stream), so it is off by default: warm calls make no driver call, and a capture
  // without a scope is then undefined. The PyTorch plug-in turns it on.
  bool detect_unscoped_capture = false;
  // Told of every unit of memory the pool reserves and, before it goes, of its give-back
  // (vram/reserve_observer.hpp): segments from the upstream, runs of granules the
  // virtual-memory large tier and the sleep tags map. Null: nothing is told (no cost). With
  // an observer, upstream() is still the upstream given, and the pool picks virtual memory
  // as without one.
  std::shared_ptr<ReserveObserver> observer;
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

  // A pool over device memory of `device` (DeviceMemoryUpstream: cudaMalloc segments; the
  // large tier over virtual memory where large_tier_memory allows it).
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

  // Stream-ordered forms (see "When a deallocated block may be handed out again"). Blocks
  // from either allocate form may be deallocated with either deallocate form.
  // cudaStreamPerThread is the calling thread's own stream: a block freed on it is taken
  // by another thread's cudaStreamPerThread only after a stream marker (recorded on the legacy
  // default stream). The null stream is the legacy default stream, one for all threads.
  [[nodiscard]] void* allocate_async(std::size_t bytes, cudaStream_t stream);
  void deallocate_async(void* block, std::size_t bytes, cudaStream_t stream) noexcept;

  // CUDA graphs. A graph launches its captured work long after the capture, so every block
  // that work touches must stay the graph's. A capture scope sends allocations to a graph
  // pool (graph_pools.hpp's rules):
  //   auto id = vram::DevicePool::new_graph_pool();
  //   {
  //     auto scope = pool.capture_into(id, stream);   // before cudaStreamBeginCapture
  //     cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
  //     ... pool.allocate_async(n, stream), kernels, pool.deallocate_async(..., stream) ...
  //     cudaStreamEndCapture(stream, &graph);
  //   }                                                // the scope ends; the graph keeps id
  //   ... launch the graph any number of times ...
  //   pool.release_graph_pool(id);                     // when the graph is destroyed
  // While the scope is open, allocations on `stream` (and on any stream forked into the same
  // capture) and the calling thread's allocations without a stream (allocate, acquire)
  // come from graph pool `id`, and every block freed on those streams or by the calling
  // thread goes to that pool (a block of the pool is also its own whatever stream frees
  // it, during or after the capture). Only later allocations into the same pool reuse
  // them: captures into one pool follow each other (a second scope into a pool while one
  // is open is refused) and replay in capture order, so several graphs may share one
  // (PyTorch's pool=). capture_into() opens a use of the pool for the graph, ended by
  // release_graph_pool(). Once no use is open and none of its blocks is live, the pool's
  // memory rejoins the shared tiers at the next release_graph_pool(), trim(), scope end,
  // out-of-memory retry or destruction that finds no scope open (on any thread), after a
  // device synchronize (the graph's last launch may still run); until then
  // graph_pool_bytes counts it (block bytes). Growing during a capture runs in relaxed
  // capture mode, so a global-mode capture stays valid; a request the upstream cannot serve
  // during a capture (or while any scope is open) throws vram::OutOfMemory without the
  // trim and retry (they would synchronize the device).
  // capture_into(id) without a stream opens an unrouted scope: nothing is routed by
  // itself; scope.allocate() and scope.deallocate() place blocks in the pool (for hosts
  // that pick the requests of a capture themselves, as PyTorch's allocator hooks do with a
  // stream filter).
  // A capture without a scope, with Options::detect_unscoped_capture: a block that
  // allocate_async or deallocate_async sees on a stream being captured is kept in a graph
  // pool of that capture, reused only by later requests of the same capture, and never
  // given back before the pool is destroyed (the pool cannot know when the graph is);
  // unscoped_capture_calls counts such calls. Calls without a stream cannot be checked: a
  // block freed by allocate/deallocate while a capture uses it is undefined, as is any
  // block used by captured work that was neither allocated nor freed during the capture.
  // Without detect_unscoped_capture (the default) such a capture is undefined: a block it
  // frees is handed out again and every launch of the graph writes it.
  // Destroying the pool frees the graph pools' free blocks; live ones stay leased (see Bad
  // input).
  // Ids: any value without bit 62 alone set (unscoped captures' pools); new_graph_pool()
  // returns unique ones (top bit set, never 0). capture_into throws vram::InvalidArgument
  // for the legacy default stream, when `stream`, the calling thread or the pool already
  // has an open scope, and on a moved-from pool; CaptureScope::allocate throws it on an
  // ended or moved-from scope and once the pool was destroyed. release_graph_pool ends only
  // a graph's use: called more often than capture_into was (while a scope is open, its
  // own use stays), it is refused, said on stderr, counted in invalid_deallocations and changes
  // nothing.
  // Destroying the pool while a scope is open: the scope stays safe to end (and to deallocate
  // through); the graph pools' memory goes back when it ends.
  using GraphPoolId = std::uint64_t;
  class CaptureScope {
   public:
    CaptureScope() = default;
    CaptureScope(CaptureScope&& other) noexcept;
    CaptureScope& operator=(CaptureScope&& other) noexcept;
    CaptureScope(const CaptureScope&) = delete;
    CaptureScope& operator=(const CaptureScope&) = delete;
    ~CaptureScope() { end(); }
    // Stops routing (the pool's use stays open until release_graph_pool). Idempotent.
    void end() noexcept;
    // A block of the scope's pool (reused, or new from the shared tiers).
    [[nodiscard]] void* allocate(std::size_t bytes);
    // `block` becomes a free block of the scope's pool (a graph pool's block goes back to
    // its own pool); after end(), an ordinary deallocation (DevicePool::deallocate's), also
    // after the pool was destroyed while blocks are leased (an ended scope does not keep
    // the pool's bookkeeping alive). A moved-from or default scope, or an ended one whose
    // pool is gone with every block deallocated, deallocates nothing and says so on stderr.
    void deallocate(void* block, std::size_t bytes) noexcept;

   private:
    friend class DevicePool;
    CaptureScope(std::shared_ptr<detail::DevicePoolCore> core, GraphPoolId pool) noexcept;
    std::shared_ptr<detail::DevicePoolCore> core_;  // while open
    std::weak_ptr<detail::DevicePoolCore> ended_;   // after end(): deallocations go on
    GraphPoolId pool_ = 0;
  };
  static GraphPoolId new_graph_pool() noexcept;
  [[nodiscard]] CaptureScope capture_into(GraphPoolId graph_pool, cudaStream_t stream);
  [[nodiscard]] CaptureScope capture_into(GraphPoolId graph_pool);
  void release_graph_pool(GraphPoolId graph_pool) noexcept;
  // The free block at `block` of graph pool `graph_pool`, live again: restores a checkpoint
  // of the pool's live blocks (PyTorch's CUDA graph trees) at the same addresses. Returns
  // its bytes, or 0 (nothing changed) when it is no free block of that pool.
  std::size_t claim_graph_block(GraphPoolId graph_pool, void* block) noexcept;
  // The free blocks graph pool `graph_pool` keeps for its own next allocations, by address
  // (memory the pool holds that nothing uses: snapshots list it as the pool's). Empty for a
  // pool that holds none, no longer exists, or after the pool was destroyed. Throws
  // std::bad_alloc.
  struct GraphPoolBlock {
    void* block = nullptr;
    std::size_t bytes = 0;
  };
  std::vector<GraphPoolBlock> graph_pool_free_blocks(GraphPoolId graph_pool) const;

  // Sleep and wake (vram/sleep_tag.hpp: where a tag's memory comes from, the ordering of
  // sleep and wake, the misuse rules). A pool whose large tier runs over virtual memory only.
  // While any tag exists every call of the pool leaves its warm path (as while a graph pool
  // exists): a deallocation asks which tag's range holds the block.
  //   create_tag: a new tag named `name` (unique in the pool); throws vram::InvalidArgument.
  //   tag_scope: until the scope ends, the opening thread's requests to this pool (allocate,
  //     acquire, allocate_async) come from `tag`. Under a capture scope too: such a block is
  //     also the graph pool's, by the graph pools' rules (freed, it goes back to that pool,
  //     reused only by the same tag's requests into it), sleeps and wakes with the tag, and
  //     rejoins the tag when the pool gives it up (after the wake, if the tag sleeps then).
  //     Scopes nest per thread and pool: the innermost one still open wins, whatever order
  //     they end in (an ended scope never routes again; a scope of another pool changes
  //     nothing here). A scope may be moved and ended on any thread: that ends the opener's
  //     routing and never touches the routing of the thread that ends it. The scope keeps
  //     the pool's bookkeeping alive until it ends: it stays safe to end after the pool was
  //     destroyed.
  //   allocate_tagged: one block from `tag`, whatever scope is open.
  //   sleep / wake: see vram/sleep_tag.hpp; the span forms take several tags in order
  //     (on an error the tags before the failing one stay as they were put, it and the
  //     later ones are unchanged).
  class TagScope {
   public:
    TagScope() = default;
    TagScope(TagScope&& other) noexcept;
    TagScope& operator=(TagScope&& other) noexcept;
    TagScope(const TagScope&) = delete;
    TagScope& operator=(const TagScope&) = delete;
    ~TagScope() { end(); }
    // Ends this scope's routing on the thread that opened it (called on any thread);
    // idempotent; a moved-from or default scope does nothing.
    void end() noexcept;

   private:
    friend class DevicePool;
    std::shared_ptr<detail::DevicePoolCore> core_;  // while open
    detail::TagScopeEntry* entry_ = nullptr;        // while open: the opener's stack entry
  };
  SleepTag create_tag(std::string_view name, SleepTagOptions options = {});
  std::optional<SleepTag> find_tag(std::string_view name) const noexcept;
  std::vector<SleepTag> tags() const;
  [[nodiscard]] TagScope tag_scope(SleepTag tag);
  [[nodiscard]] void* allocate_tagged(std::size_t bytes, SleepTag tag,
                                      cudaStream_t stream = nullptr);
  //   contents: SleepContents::discard drops the tags' contents even where they keep a
  //     backup (the next wake maps uninitialised memory).
  void sleep(SleepTag tag, cudaStream_t stream = nullptr,
             SleepContents contents = SleepContents::keep);
  void wake(SleepTag tag, cudaStream_t stream = nullptr);
  void sleep(const std::vector<SleepTag>& tags, cudaStream_t stream = nullptr,
             SleepContents contents = SleepContents::keep);
  void wake(const std::vector<SleepTag>& tags, cudaStream_t stream = nullptr);
  SleepTagStats tag_stats(SleepTag tag) const;

  // Bytes a request of `bytes` occupies in the pool (its size class up to
  // small_block_max_bytes, else rounded to 512): what bytes_in_use counts.
  std::size_t block_bytes(std::size_t bytes) const noexcept;
  // True when the large tier runs over virtual memory (Options::large_tier_memory).
  bool uses_virtual_memory() const noexcept;

  // Gives cached memory back to the upstream (see above). Waits for the work of
  // stream-ordered frees so that their memory can be given back too.
  void trim(std::size_t keep_bytes = 0);
  DevicePoolStats stats() const;
  // The pool's segments and their ranges, each tier read under its lock (a consistent view
  // of one tier; blocks may move between the reads of the two). Throws std::bad_alloc.
  std::vector<DevicePoolSegment> memory_map() const;
  // Starts a new measurement window: peak_bytes_reserved restarts from bytes_reserved and
  // peak_bytes_in_use from bytes_in_use.
  void reset_peak() noexcept;
  const Options& options() const noexcept;
  Upstream& upstream() const noexcept;

  bool operator==(const DevicePool& other) const noexcept { return core_ == other.core_; }
  // CCCL: memory from this pool is device memory (with a device upstream).
  friend void get_property(const DevicePool&, ::cuda::mr::device_accessible) noexcept {}

 private:
  detail::DevicePoolCore& live_core(const char* call) const;  // throws when moved from
  CaptureScope open_scope(GraphPoolId graph_pool, cudaStream_t stream, bool routed);
  std::shared_ptr<detail::DevicePoolCore> core_;
};

}  // namespace vram

// The cuda::mr contracts of DevicePool (the toolkit's CCCL).
static_assert(::cuda::mr::resource<vram::DevicePool>);
static_assert(::cuda::mr::resource_with<vram::DevicePool, ::cuda::mr::device_accessible>);
