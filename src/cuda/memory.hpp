// src/cuda/memory.hpp: device and host memory calls of the runtime.
//
// Rules: calls that allocate throw (vram::OutOfMemory for a full device, vram::CudaError
// otherwise) or, where named try_, return the runtime's result with the last-error slot
// cleared; calls that free are noexcept and tolerate a shut-down runtime.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <optional>

namespace vram::cuda {

// cudaMalloc on `device` (made current for the call).
void* allocate_device(std::size_t bytes, int device);
// cudaFree; no current-device switch is needed (the runtime finds the owning context).
void free_device(void* pointer) noexcept;
// Creates the device's primary context (cudaFree(nullptr) on it); throws vram::CudaError.
void initialize_context(int device);

// cudaHostAlloc(cudaHostAllocPortable).
cudaError_t try_allocate_pinned_host(void** out, std::size_t bytes) noexcept;
void free_pinned_host(void* pointer) noexcept;
// cudaHostRegister(cudaHostRegisterPortable) of [pointer, pointer + bytes).
cudaError_t try_register_host(void* pointer, std::size_t bytes) noexcept;
void unregister_host(void* pointer) noexcept;

enum class PointerKind {
  pageable_host,  // unknown to CUDA
  pinned_host,    // page-locked (cudaHostAlloc or cudaHostRegister)
  device,
  managed,
};
struct PointerInfo {
  PointerKind kind = PointerKind::pageable_host;
  int device = -1;  // the owning device for device and managed memory, else -1
};
PointerInfo pointer_info(const void* pointer) noexcept;

struct MemoryInfo {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};
// cudaMemGetInfo on `device`; empty when the runtime cannot say.
std::optional<MemoryInfo> memory_info(int device) noexcept;

// cudaDeviceCanAccessPeer(peer -> device); false when it cannot be asked.
bool can_access_peer(int peer, int device) noexcept;
// False only when the runtime says that no other visible device can access `device`'s
// memory by peer access; true when one can, or when the devices cannot be counted or asked.
bool may_be_peer_accessible(int device) noexcept;
// The device's memory (cudaGetDeviceProperties: creates no context); empty when the runtime
// cannot say.
std::optional<std::size_t> total_memory(int device) noexcept;

// cudaMemcpyAsync host to device on `stream`; throws vram::CudaError naming `what`.
void copy_to_device_async(void* device_destination, const void* host_source, std::size_t bytes,
                          cudaStream_t stream, const char* what);
// cudaMemcpyAsync device to host on `stream`; throws vram::CudaError naming `what`.
void copy_to_host_async(void* host_destination, const void* device_source, std::size_t bytes,
                        cudaStream_t stream, const char* what);
// cudaMemcpy host to device (blocking); throws vram::CudaError naming `what`.
void copy_to_device(void* device_destination, const void* host_source, std::size_t bytes,
                    const char* what);

// cudaMemcpy of `bytes` between any two pointers the runtime knows (cudaMemcpyDefault,
// blocking); throws vram::CudaError naming `what`.
void copy(void* destination, const void* source, std::size_t bytes, const char* what);
// cudaMemcpyAsync of device memory on `stream`, or cudaMemcpyPeerAsync when the devices
// differ and `peer_enabled` is false (memory mapped for one device only); the error code.
cudaError_t try_copy_device_async(void* destination, int destination_device, const void* source,
                                  int source_device, std::size_t bytes, cudaStream_t stream,
                                  bool peer_enabled) noexcept;
// cudaDeviceEnablePeerAccess(peer) made from `device`; enabled before is no error. Throws
// vram::CudaError.
void enable_peer_access(int device, int peer);

// cudaStreamSynchronize in relaxed capture mode; throws vram::CudaError.
void synchronize_stream(cudaStream_t stream);
// As synchronize_stream(); false (the failure cleared) when it failed.
bool try_synchronize_stream(cudaStream_t stream) noexcept;
// cudaDeviceSynchronize on `device` (made current for the call, then restored); errors,
// e.g. at driver shutdown, are cleared. False when it failed (nothing is known complete).
bool synchronize_device(int device) noexcept;
// cudaDeviceSynchronize on the current device; throws vram::CudaError.
void synchronize_current_device();
// cudaSetDevice for the calling thread; throws vram::CudaError.
void set_current_device(int device);

}  // namespace vram::cuda
