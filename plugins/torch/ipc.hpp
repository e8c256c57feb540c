// ipc.hpp: the importing side of CUDA tensors shared between processes (ipc.cpp has the
// rules).
#pragma once

namespace vram_torch {

// The base of the segment `handle` (VRAM_TORCH_IPC_HANDLE_BYTES of a cudaIpcMemHandle_t)
// names, mapped on `device` once per process and kept mapped for its life. Throws
// vram::CudaError when it cannot be opened, std::bad_alloc.
void* open_shared(const void* handle, int device);

}  // namespace vram_torch
