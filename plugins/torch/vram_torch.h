/* vram_torch.h: the C interface of libvram_torch.so, vram's DevicePool as PyTorch's
 * pluggable CUDA allocator (and CuPy's, through python/vram_cupy.py).
 *
 *   import vram_torch; vram_torch.enable()        # before the first CUDA call
 *
 * Allocation (PyTorch's CUDAPluggableAllocator ABI)
 *   vram_torch_alloc(size, device, stream) takes a block of DevicePool `device` (one pool
 *   per device, created on first use) for work ordered on `stream`; size 0 returns NULL.
 *   Out of memory returns NULL (PyTorch then raises its own error), counts the failure and
 *   prints vram's explanation to stderr once per process (later ones: vram_torch_last_error).
 *   vram_torch_free(ptr, size, device, stream) gets the stream the block was allocated on
 *   (PyTorch records it at allocation) and hands the block back stream-ordered: reusable at
 *   once on that stream, by another stream only after the work queued on it at the free.
 *   A pointer that is not a block this interface handed out on `device` and has not freed
 *   since (freed twice, another allocator's, another device's) is ignored and explained in
 *   vram_torch_last_error; a size other than the allocation's is explained and the block
 *   freed as allocated.
 *
 * Blocks used on other streams (tensor.record_stream(s))
 *   PyTorch forwards record_stream to vram_torch_record_stream once it is registered with
 *   set_record_stream_fn (python/vram_torch.py does). At the free of such a block, an event
 *   is recorded on every recorded stream other than the allocation stream and the block is
 *   held back by the plug-in until all of them have completed (checked without blocking on
 *   the next allocations of that device; waited for only when memory runs out or by
 *   vram_torch_empty_cache). Only then is it handed to the pool, with the allocation stream.
 *   Without the hook registered, record_stream is silently ignored by PyTorch and a block
 *   freed while another stream still uses it could be handed out too early.
 *
 * CUDA graphs (torch.cuda.graph, make_graphed_callables, pool= sharing)
 *   vram_torch_install_graph_hooks() sets PyTorch's beginAllocateToPool, endAllocateToPool
 *   and releasePool hooks of the current pluggable allocator (vram_torch.enable() calls it):
 *   during a capture, requests and frees on the streams PyTorch's filter accepts use a graph
 *   pool that only that graph (and graphs sharing its pool) reuses, returned to the shared
 *   pool when the last graph using it is released (plugins/torch/graph_routes.hpp). It
 *   needs a build with Torch found: 1 when set, 0 when this build has no Torch, -1 when the
 *   current allocator is not the pluggable one (reason: vram_torch_last_error).
 *
 * Every function is thread-safe. Pools live until the process exits (never destroyed, so a
 * tensor freed during interpreter shutdown still finds its pool).
 */
#ifndef VRAM_TORCH_H
#define VRAM_TORCH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct CUstream_st* vram_torch_stream_t; /* == cudaStream_t */

/* Counters of one device, named after torch.cuda.memory_stats() keys (see vram_torch.py).
 * "allocated" counts size-class bytes handed out (what the pool rounds a request to),
 * "requested" the bytes PyTorch asked for; "reserved" is what the pool holds from
 * cudaMalloc (in use + cached + held back). Fields are only ever appended. */
typedef struct vram_torch_stats_t {
  uint64_t allocated_bytes_current;
  uint64_t allocated_bytes_peak;
  uint64_t allocated_bytes_allocated; /* cumulative */
  uint64_t allocated_bytes_freed;     /* cumulative */
  uint64_t requested_bytes_current;
  uint64_t requested_bytes_peak;
  uint64_t allocation_current; /* live blocks */
  uint64_t allocation_peak;
  uint64_t allocation_allocated; /* cumulative successful allocations */
  uint64_t allocation_freed;
  uint64_t reserved_bytes_current; /* DevicePoolStats::bytes_reserved, and segments of
                                      MemPools' own allocators (allocator mode) */
  uint64_t reserved_bytes_peak;    /* DevicePoolStats::peak_bytes_reserved, or the current
                                      figure when higher */
  uint64_t cached_bytes;           /* DevicePoolStats::bytes_cached */
  uint64_t num_device_alloc;       /* DevicePoolStats::upstream_allocations, and segments
                                      of MemPools' own allocators (allocator mode) */
  uint64_t num_device_free;        /* DevicePoolStats::upstream_frees, likewise */
  uint64_t num_alloc_retries;      /* DevicePoolStats::oom_retries + plug-in retries */
  uint64_t num_ooms;               /* allocations answered with NULL */
  uint64_t record_stream_calls;
  uint64_t held_back_blocks;       /* freed, waiting for recorded streams */
  uint64_t held_back_bytes;        /* their bytes as counted at allocation (a MemPool's own
                                      allocator's included) */
  uint64_t graph_pool_bytes;       /* DevicePoolStats::graph_pool_bytes: held by CUDA graphs */
  uint64_t graph_pools;            /* graph pools with a use open or memory held */
  uint64_t unscoped_capture_calls; /* DevicePoolStats::unscoped_capture_calls */
  uint64_t graph_invalid_releases; /* releasePool of an id with no use open */
} vram_torch_stats_t;

/* PyTorch's CUDAPluggableAllocator entry points. */
void* vram_torch_alloc(size_t size, int device, vram_torch_stream_t stream);
void vram_torch_free(void* ptr, size_t size, int device, vram_torch_stream_t stream);
/* set_record_stream_fn: `ptr` is the base pointer of a live block of this library (any
 * other pointer is ignored). */
void vram_torch_record_stream(void* ptr, vram_torch_stream_t stream);
/* set_reset_fn (torch.cuda.empty_cache()): vram_torch_empty_cache(-1). */
void vram_torch_empty_cache_all(void);

int vram_torch_install_graph_hooks(void);
/* Installs vram as PyTorch's own CUDA allocator (a CUDAAllocator over the same pools; every
 * torch.cuda memory call works: statistics, history and snapshots, MemPool, CUDA graph
 * trees, IPC). Call before CUDA is initialised. 1 when installed, 0 when this build has no
 * Torch (only the pluggable route above), -1 when it cannot be installed (reason:
 * vram_torch_last_error). */
int vram_torch_install_native(void);
/* The version of Torch this library was built against ("2.11.0"; "" without Torch): the
 * native allocator implements that version's interface and must run under it. */
const char* vram_torch_torch_version(void);
/* CUDA IPC (torch.multiprocessing sharing CUDA tensors; python/vram_torch.py registers the
 * reducers). Export: the CUDA IPC handle of the cudaMalloc segment `ptr` lies in and the
 * offset of `ptr` in it; 0: done; -1: refused (blocks over CUDA virtual memory: run with
 * VRAM_TORCH_VIRTUAL_MEMORY=0) or failed, reason in vram_torch_last_error. Open: the
 * segment's base mapped into this process on `device`, once per handle (kept mapped for the
 * process's life); NULL on failure. The exporter keeps the tensor alive while others use it. */
#define VRAM_TORCH_IPC_HANDLE_BYTES 64
int vram_torch_ipc_export(const void* ptr, void* handle_out, size_t* offset_out);
void* vram_torch_ipc_open(const void* handle, int device);
/* sizeof(vram_torch_stats_t), for a caller's layout check. */
size_t vram_torch_stats_size(void);
/* Fills `out` (`out_size` bytes, at most sizeof) for `device`. 0: done; 1: no pool on that
 * device yet (all zeros); -1: bad argument. */
int vram_torch_stats(int device, vram_torch_stats_t* out, size_t out_size);
/* Waits for held-back blocks, then frees every cached block of `device` (-1: all devices)
 * to cudaFree (DevicePool::trim(0)). 0: done; -1: bad device. */
int vram_torch_empty_cache(int device);
/* Restarts the peaks (allocated, requested, allocation, reserved) from the current values. */
int vram_torch_reset_peak(int device);
/* Options of the pools created from now on: max cached bytes per device (0: keep the
 * default: unbounded, as PyTorch; or VRAM_TORCH_MAX_CACHED_BYTES from the environment). 0: done; 1:
 * a pool already exists (it keeps its options).
 * The environment, read when a device's pool is created: VRAM_TORCH_MAX_CACHED_BYTES (as
 * above; suffixes K, M, G), VRAM_TORCH_VIRTUAL_MEMORY (default 1: large blocks over CUDA
 * virtual memory mapped in 2 MiB granules where the device supports it, memory PyTorch
 * cannot share by CUDA IPC; 0: cudaMalloc segments), VRAM_TORCH_GROWTH_HEADROOM (segments:
 * the fraction reserved may pass the peak in use before segments go back; default 1/16). */
int vram_torch_configure(size_t max_cached_bytes);
/* 1: out of memory throws c10::OutOfMemoryError (allocator mode; needs a build with Torch
   found, which the return value reports: 1 when supported, 0 when not). */
int vram_torch_set_oom_throws(int throws);
/* The bytes vram reserves for a request of `size` on `device` (0 before its first use, for
 * size 0 and for a size larger than any block, 1 TiB). */
size_t vram_torch_block_bytes(int device, size_t size);
/* Copies the latest out-of-memory or error explanation (NUL-terminated, truncated to
 * `size`); returns its full length, 0 when there was none. */
size_t vram_torch_last_error(char* buffer, size_t size);

/* ---- Sleep and wake (docs/sleep-wake.md; include/vram/sleep_tag.hpp): tensors allocated
 * inside a region of a named tag live in the tag's own virtual memory on their device; the
 * tag can sleep (contents copied to pinned host memory unless it is discardable, physical
 * memory released, addresses kept) and wake (memory mapped again at the same addresses,
 * contents copied back). Every function returns 0 when done and -1 on any bad argument or
 * failure (a null or empty name, no such tag, sleep twice, wake without sleep, out of
 * memory), the reason in vram_torch_last_error; nothing is changed then.
 * region_enter: this thread's allocations on `device` go to tag `tag` (made on first use,
 * `discardable` nonzero: no copy at sleep, uninitialised after wake) until the matching
 * region_exit (regions nest; exit closes the thread's innermost one).
 * sleep / wake: `device` -1 for every device whose pool has the tag; `stream` NULL: the
 * device is synchronized first, else the copies follow the work queued on `stream` (work on
 * other streams that uses the tag must be ordered before it by the caller). Both return
 * after their copies completed.
 * sleep_discard: sleep that drops the contents even of a tag that keeps them (nothing is
 * copied; the memory mapped at the next wake is uninitialised): vLLM's sleep level 2. */
int vram_torch_region_enter(const char* tag, int discardable, int device);
int vram_torch_region_exit(void);
int vram_torch_sleep(const char* tag, int device, vram_torch_stream_t stream);
int vram_torch_sleep_discard(const char* tag, int device, vram_torch_stream_t stream);
int vram_torch_wake(const char* tag, int device, vram_torch_stream_t stream);
typedef struct vram_torch_tag_stats_t {
  uint64_t asleep; /* 1 while the tag sleeps */
  uint64_t discardable;
  uint64_t live_blocks;
  uint64_t live_bytes;
  uint64_t mapped_bytes;    /* physical bytes mapped now (0 while asleep) */
  uint64_t backup_bytes;    /* pinned host bytes held for its backup */
  uint64_t backed_up_bytes; /* bytes copied at the last sleep */
  uint64_t copies;          /* copies (coalesced ranges) of the last sleep */
  uint64_t sleeps;
  uint64_t wakes;
} vram_torch_tag_stats_t;
/* Fills `out` (`out_size` bytes, at most sizeof) for tag `tag` of `device`. 0: done; 1: no
 * such tag there; -1: bad argument. */
int vram_torch_tag_stats(const char* tag, int device, vram_torch_tag_stats_t* out, size_t out_size);

/* ---- Offload: a WeightPager over a PyTorch module's host weights (plugins/torch/offload.cpp,
 * python/vram_offload.py). A "piece" is one pager layer: a host range holding one or more
 * tensors. The pager keeps what fits the budget resident and streams the rest through a
 * ring of (prefetch_depth + 1) slots on its own copy stream (vram/weight_pager.hpp).
 *
 *   create    validates everything first; refuses (NULL, reason in `error`) a budget below
 *             vram_torch_pager_min_budget (the pieces that must stay resident plus the ring
 *             at the requested depth): nothing is allocated or pinned then.
 *   acquire   the piece's device pointer, ordered before work queued on `stream` afterwards
 *             (stream-ordered: never a host synchronisation with pinned weights); NULL on
 *             error (vram_torch_pager_error). Valid until the matching release.
 *   release   the piece may be overwritten once the work queued on `stream` so far completed.
 *   destroy   waits for the copies and the recorded releases, frees the arena, unpins.
 * A pager is used by one thread at a time per call (calls are serialised by the pager).
 *
 * Failures: each function answers its failure value (NULL, -1, or 0 where it returns a size)
 * and never traps: a NULL array with a count > 0, a count larger than any array (such as a
 * negative number cast to size_t), a size or a sum of sizes past the address space are
 * refused. The reason is kept as the pager's latest error (vram_torch_pager_error(pager));
 * for a call without a pager (min_budget, preview, create, a NULL pager) as the latest call
 * error of the process, vram_torch_pager_error(NULL, ...).
 */
typedef struct vram_torch_pager vram_torch_pager;

typedef struct vram_torch_pager_options_t {
  size_t budget_bytes;   /* device bytes for the arena (resident pieces + ring) */
  size_t prefetch_depth; /* schedule positions prefetched ahead; the ring has depth + 1 */
  int device;
  int host;                     /* 0 automatic (pin, else stage), 1 pinned, 2 pageable (staged) */
  int host_double;              /* 1: host memory stands in for the device (tests without a GPU) */
  unsigned fill_threads;        /* pageable: 0 = hardware threads (at most 16) */
  size_t staging_chunk_bytes;   /* pageable: 0 = default (32 MiB) */
  size_t staging_buffers;       /* pageable: 0 = default (3) */
  unsigned stall_sample_period; /* time every Nth page-in; 0 = never */
} vram_torch_pager_options_t;

typedef struct vram_torch_pager_plan_t {
  uint64_t arena_bytes;
  uint64_t resident_bytes;
  uint64_t slot_bytes;
  uint64_t slot_count;
  uint64_t prefetch_depth;
  uint64_t streamed_bytes_per_step; /* bytes copied per pass over the schedule */
  uint64_t resident_pieces;
  uint64_t pinned; /* 1: streamed pieces are read from page-locked memory */
  uint64_t pinned_bytes;
  uint64_t register_calls;
  uint64_t already_pinned_bytes;
  double pin_seconds;
  double upload_seconds;
} vram_torch_pager_plan_t;

typedef struct vram_torch_pager_stats_t {
  uint64_t acquires;
  uint64_t hits;
  uint64_t page_ins;
  uint64_t prefetches;
  uint64_t bytes_paged_in;
  uint64_t timed_page_ins;
  uint64_t timed_bytes;
  uint64_t stall_samples;
  uint64_t stalled;
  uint64_t staging_pin_calls;
  double timed_copy_ms;
  double effective_gbps;
  double stall_ms_sampled;
  double host_wait_ms;
} vram_torch_pager_stats_t;

/* The least budget that holds the pieces forced resident plus a ring of depth + 1 slots
 * (every piece resident when that is less, as for a depth whose ring passes the address
 * space, e.g. SIZE_MAX). 0 on failure (never a valid budget): no pieces, `bytes` NULL with
 * count > 0, a piece of 0 bytes, a piece or the pieces' total past the address space once
 * aligned to 256 bytes; the reason in vram_torch_pager_error(NULL, ...). */
size_t vram_torch_pager_min_budget(size_t count, const size_t* bytes, size_t prefetch_depth);
/* The plan create would make for these pieces (no allocation, no pin, no CUDA call): the
 * plan's sizes in `out` (the load fields 0), each piece's residency in `resident` (count
 * entries, may be NULL). 0, or -1 when an argument is refused (as min_budget's, `schedule`
 * NULL with schedule_length > 0 or naming a piece out of range, `out` NULL) or the budget is
 * below vram_torch_pager_min_budget; the reason in vram_torch_pager_error(NULL, ...). */
int vram_torch_pager_preview(size_t count, const size_t* bytes, const size_t* schedule,
                             size_t schedule_length, size_t budget_bytes, size_t prefetch_depth,
                             vram_torch_pager_plan_t* out, size_t out_size, uint8_t* resident);
vram_torch_pager* vram_torch_pager_create(size_t count, const void* const* hosts,
                                          const size_t* bytes, const size_t* schedule,
                                          size_t schedule_length,
                                          const vram_torch_pager_options_t* options, char* error,
                                          size_t error_size);
void vram_torch_pager_destroy(vram_torch_pager* pager);
void* vram_torch_pager_acquire(vram_torch_pager* pager, size_t piece, vram_torch_stream_t stream);
int vram_torch_pager_release(vram_torch_pager* pager, size_t piece, vram_torch_stream_t stream);
/* A module's pieces in one call: out[i] receives pieces[i]'s device memory; 0, or -1 after
 * releasing what this call acquired (vram_torch_pager_error says why). release_many releases
 * each piece named once; -1 when one failed (after trying the others). */
int vram_torch_pager_acquire_many(vram_torch_pager* pager, size_t count, const size_t* pieces,
                                  vram_torch_stream_t stream, void** out);
int vram_torch_pager_release_many(vram_torch_pager* pager, size_t count, const size_t* pieces,
                                  vram_torch_stream_t stream);
/* The pager's latest error (NUL-terminated, truncated to `size`); returns its full length.
 * A NULL pager: the latest error of a call without a pager (any thread; see "Failures"). */
size_t vram_torch_pager_error(vram_torch_pager* pager, char* buffer, size_t size);
/* The plan; `resident` (may be NULL) gets one 0/1 per piece (at most `count`). 0: done. */
int vram_torch_pager_plan(vram_torch_pager* pager, vram_torch_pager_plan_t* out, size_t out_size,
                          uint8_t* resident, size_t count);
/* Automatic mode: why the weights are staged instead of pinned ("" when pinned). */
size_t vram_torch_pager_fallback_reason(vram_torch_pager* pager, char* buffer, size_t size);
int vram_torch_pager_stats(vram_torch_pager* pager, vram_torch_pager_stats_t* out, size_t out_size);
int vram_torch_pager_reset_counters(vram_torch_pager* pager);
/* Blocks until every page-in queued so far completed. */
int vram_torch_pager_synchronize(vram_torch_pager* pager);

#ifdef __cplusplus
}
#endif

#endif /* VRAM_TORCH_H */
