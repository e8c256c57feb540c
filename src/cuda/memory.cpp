#include "cuda/memory.hpp"

#include <string>

#include "cuda/capture.hpp"
#include "cuda/status.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/error.hpp"

namespace vram::cuda {

void* allocate_device(std::size_t bytes, int device) {
  DeviceGuard guard(device);
  void* block = nullptr;
  const cudaError_t status = cudaMalloc(&block, bytes);
  if (status == cudaErrorMemoryAllocation) {
    clear_last_error();
    throw OutOfMemory(
        bytes, 0, 0,
        "cudaMalloc on device " + std::to_string(device) + " returned cudaErrorMemoryAllocation");
  }
  check(status, "cudaMalloc");
  return block;
}

void free_device(void* pointer) noexcept {
  if (pointer != nullptr) (void)succeeded(cudaFree(pointer));
}

void initialize_context(int device) {
  DeviceGuard guard(device);
  check(cudaFree(nullptr), "cudaFree(nullptr) (context initialization)");
}

cudaError_t try_allocate_pinned_host(void** out, std::size_t bytes) noexcept {
  const cudaError_t status = cudaHostAlloc(out, bytes, cudaHostAllocPortable);
  (void)succeeded(status);
  return status;
}

void free_pinned_host(void* pointer) noexcept {
  if (pointer != nullptr) (void)succeeded(cudaFreeHost(pointer));
}

cudaError_t try_register_host(void* pointer, std::size_t bytes) noexcept {
  const cudaError_t status = cudaHostRegister(pointer, bytes, cudaHostRegisterPortable);
  (void)succeeded(status);
  return status;
}

void unregister_host(void* pointer) noexcept {
  if (pointer != nullptr) (void)succeeded(cudaHostUnregister(pointer));
}

PointerInfo pointer_info(const void* pointer) noexcept {
  cudaPointerAttributes attributes{};
  if (!succeeded(cudaPointerGetAttributes(&attributes, pointer))) return {};
  switch (attributes.type) {
    case cudaMemoryTypeHost:
      return {PointerKind::pinned_host, -1};
    case cudaMemoryTypeDevice:
      return {PointerKind::device, attributes.device};
    case cudaMemoryTypeManaged:
      return {PointerKind::managed, attributes.device};
    default:
      return {};
  }
}

std::optional<MemoryInfo> memory_info(int device) noexcept {
  try {
    DeviceGuard guard(device);
    MemoryInfo info;
    if (!succeeded(cudaMemGetInfo(&info.free_bytes, &info.total_bytes))) return std::nullopt;
    return info;
  } catch (...) {
    return std::nullopt;
  }
}

bool can_access_peer(int peer, int device) noexcept {
  int can_access = 0;
  return succeeded(cudaDeviceCanAccessPeer(&can_access, peer, device)) && can_access != 0;
}

bool may_be_peer_accessible(int device) noexcept {
  int count = 0;
  if (!succeeded(cudaGetDeviceCount(&count))) return true;
  for (int peer = 0; peer < count; ++peer) {
    if (peer == device) continue;
    int can_access = 0;
    if (!succeeded(cudaDeviceCanAccessPeer(&can_access, peer, device)) || can_access != 0) {
      return true;
    }
  }
  return false;
}

std::optional<std::size_t> total_memory(int device) noexcept {
  cudaDeviceProp properties{};
  if (!succeeded(cudaGetDeviceProperties(&properties, device))) return std::nullopt;
  return properties.totalGlobalMem;
}

void copy_to_device_async(void* device_destination, const void* host_source, std::size_t bytes,
                          cudaStream_t stream, const char* what) {
  check(cudaMemcpyAsync(device_destination, host_source, bytes, cudaMemcpyHostToDevice, stream),
        what);
}

void copy_to_host_async(void* host_destination, const void* device_source, std::size_t bytes,
                        cudaStream_t stream, const char* what) {
  check(cudaMemcpyAsync(host_destination, device_source, bytes, cudaMemcpyDeviceToHost, stream),
        what);
}

void copy_to_device(void* device_destination, const void* host_source, std::size_t bytes,
                    const char* what) {
  check(cudaMemcpy(device_destination, host_source, bytes, cudaMemcpyHostToDevice), what);
}

void copy(void* destination, const void* source, std::size_t bytes, const char* what) {
  check(cudaMemcpy(destination, source, bytes, cudaMemcpyDefault), what);
}

cudaError_t try_copy_device_async(void* destination, int destination_device, const void* source,
                                  int source_device, std::size_t bytes, cudaStream_t stream,
                                  bool peer_enabled) noexcept {
  if (destination_device == source_device || peer_enabled) {
    return cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToDevice, stream);
  }
  return cudaMemcpyPeerAsync(destination, destination_device, source, source_device, bytes, stream);
}

void enable_peer_access(int device, int peer) {
  const DeviceGuard guard(device);
  const cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
  if (status == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // not sticky: clear it
    return;
  }
  check(status, "cudaDeviceEnablePeerAccess");
}

void synchronize_stream(cudaStream_t stream) {
  const RelaxedCaptureMode relaxed;
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

bool try_synchronize_stream(cudaStream_t stream) noexcept {
  const RelaxedCaptureMode relaxed;
  return succeeded(cudaStreamSynchronize(stream));
}

bool synchronize_device(int device) noexcept {
  int previous = -1;
  if (!succeeded(cudaGetDevice(&previous))) previous = -1;
  if (previous != device && !succeeded(cudaSetDevice(device))) return false;
  const bool done = succeeded(cudaDeviceSynchronize());
  if (previous >= 0 && previous != device) (void)succeeded(cudaSetDevice(previous));
  return done;
}

void synchronize_current_device() { check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }

void set_current_device(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }

}  // namespace vram::cuda
