// src/cuda/ipc.hpp: CUDA IPC, device memory shared between processes.
//
// Rules: only memory from cudaMalloc can be exported (a handle names a whole allocation: a
// block is exported as its allocation's handle and its offset in it; the importer sees the
// whole allocation). Memory of CUDA virtual memory management (DevicePool's virtual-memory
// large tier) cannot: export throws vram::InvalidArgument saying how to get cudaMalloc
// segments instead. An imported allocation stays mapped until close_ipc(); the exporter
// must keep the memory allocated while importers use it (CUDA IPC's own rule).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace vram::cuda {

struct IpcExport {
  cudaIpcMemHandle_t handle{};
  std::size_t offset = 0;            // of the pointer in its allocation
  std::size_t allocation_bytes = 0;  // the allocation's size
};

// Throws vram::InvalidArgument (not shareable memory: the message names the fix) or
// vram::CudaError.
IpcExport export_ipc(const void* pointer);
// The base of the exported allocation, mapped into this process on `device` (made current
// for the call); throws vram::CudaError (e.g. a handle of this same process).
void* open_ipc(const cudaIpcMemHandle_t& handle, int device);
void close_ipc(void* base) noexcept;

}  // namespace vram::cuda
