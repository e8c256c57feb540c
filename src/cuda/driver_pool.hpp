// src/cuda/driver_pool.hpp: the driver's stream-ordered memory pools (cuMemPool*,
// cuMemAllocFromPoolAsync, cuMemFreeAsync), as StreamOrderedPool drives them.
//
// Rules:
// - Calls that create, query or configure a pool throw vram::CudaError naming the driver
//   call (or the `label` given); a driver that lacks the entry point throws the missing-entry
//   error of vram/cuda/driver_api.hpp.
// - The allocation and free calls return the driver's CUresult unchanged, so the caller
//   decides what CUDA_ERROR_INVALID_CONTEXT (no current context on this thread: bind one and
//   retry) and CUDA_ERROR_OUT_OF_MEMORY mean for it.
// - Calls named try_ and the destroy/bind calls never throw; a driver without the entry
//   point reads as CUDA_ERROR_DEINITIALIZED (nothing can be done any more).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace vram::cuda {

// The calling thread's current context (cuCtxGetCurrent).
CUcontext current_context();
// Makes `context` current on the calling thread (cuCtxSetCurrent); false when it cannot.
bool bind_context(CUcontext context) noexcept;

// A private pool of pinned device memory on `device` (cuMemPoolCreate); with
// `ipc_shareable` its blocks export POSIX file-descriptor handles.
CUmemoryPool create_memory_pool(int device, bool ipc_shareable);
// The device's default pool (cuDeviceGetDefaultMemPool), shared with every cudaMallocAsync
// user of the process.
CUmemoryPool default_memory_pool(int device);
void destroy_memory_pool(CUmemoryPool pool) noexcept;

// cuMemPoolGetAttribute / cuMemPoolSetAttribute of a 64-bit attribute; errors name `label`.
std::uint64_t pool_attribute(CUmemoryPool pool, CUmemPool_attribute attribute, const char* label);
void set_pool_attribute(CUmemoryPool pool, CUmemPool_attribute attribute, std::uint64_t value,
                        const char* label);
CUresult try_set_pool_attribute(CUmemoryPool pool, CUmemPool_attribute attribute,
                                std::uint64_t value) noexcept;
// cuMemPoolTrimTo: gives back what the pool holds free beyond `keep_bytes`.
void trim_pool(CUmemoryPool pool, std::size_t keep_bytes);

// cuMemAllocFromPoolAsync of `bytes` on `stream`.
CUresult allocate_from_pool_async(CUdeviceptr& block, std::size_t bytes, CUmemoryPool pool,
                                  cudaStream_t stream);
// cuMemFreeAsync of `block` on `stream`.
CUresult free_async(CUdeviceptr block, cudaStream_t stream) noexcept;

}  // namespace vram::cuda
