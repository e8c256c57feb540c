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
  uint64_t reserved_bytes_current; /* DevicePoolStats::bytes_reserved */
  uint64_t reserved_bytes_peak;    /* DevicePoolStats::peak_bytes_reserved */
  uint64_t cached_bytes;           /* DevicePoolStats::bytes_cached */
  uint64_t num_device_alloc;       /* DevicePoolStats::upstream_allocations */
  uint64_t num_device_free;        /* DevicePoolStats::upstream_frees */
  uint64_t num_alloc_retries;      /* DevicePoolStats::oom_retries + plug-in retries */
  uint64_t num_ooms;               /* allocations answered with NULL */
  uint64_t record_stream_calls;
  uint64_t held_back_blocks; /* freed, waiting for recorded streams */
  uint64_t held_back_bytes;  /* their size-class bytes */
  uint64_t graph_pool_bytes; /* DevicePoolStats::graph_pool_bytes: held by CUDA graphs */
  uint64_t graph_pools;      /* graph pools with a use open or memory held */
  uint64_t unscoped_capture_calls; /* DevicePoolStats::unscoped_capture_calls */
  uint64_t graph_invalid_releases; /* releasePool of an id with no use open */
} vram_torch_stats_t;

/* PyTorch's CUDAPluggableAllocator entry points. */
void* vram_torch_alloc(size_t size, int device, vram_torch_stream_t stream);
void vram_torch_free(void* ptr, size_t size, int device, vram_torch_stream_t stream);
/* set_record_stream_fn: `ptr` is the base pointer of a live block of this library. */
void vram_torch_record_stream(void* ptr, vram_torch_stream_t stream);
/* set_reset_fn (torch.cuda.empty_cache()): vram_torch_empty_cache(-1). */
void vram_torch_empty_cache_all(void);

int vram_torch_install_graph_hooks(void);
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
/* The bytes vram reserves for a request of `size` on `device` (0 before its first use). */
size_t vram_torch_block_bytes(int device, size_t size);
/* Copies the latest out-of-memory or error explanation (NUL-terminated, truncated to
 * `size`); returns its full length, 0 when there was none. */
size_t vram_torch_last_error(char* buffer, size_t size);

#ifdef __cplusplus
}
#endif

#endif /* VRAM_TORCH_H */
