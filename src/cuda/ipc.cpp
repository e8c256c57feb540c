#include "cuda/ipc.hpp"

#include <cuda.h>

#include <cstdint>
#include <string>

#include "cuda/capture.hpp"
#include "cuda/memory.hpp"
#include "cuda/status.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/driver_api.hpp"
#include "vram/cuda/error.hpp"

namespace vram::cuda {

IpcExport export_ipc(const void* pointer) {
  // Driver calls need the owning device's context current on this thread (a thread that
  // made no runtime call yet has none).
  const PointerInfo info = pointer_info(pointer);
  if (info.kind != PointerKind::device) {
    throw InvalidArgument(
        "vram: CUDA IPC export: the pointer is not device memory. Fix: "
        "export a live block of a device pool.");
  }
  const DeviceGuard on_device(info.device);
  {
    // The runtime binds the device's primary context to the thread at its first call that
    // needs one (cudaGetDevice does not): the driver call below needs it current.
    const RelaxedCaptureMode relaxed;
    check(cudaFree(nullptr), "cudaFree(nullptr) (binds the device's context to this thread)");
  }
  const auto& api = driver_api();
  CUdeviceptr base = 0;
  std::size_t bytes = 0;
  const CUresult range =
      api.require(api.mem_get_address_range)(&base, &bytes, reinterpret_cast<CUdeviceptr>(pointer));
  if (range != CUDA_SUCCESS) {
    throw InvalidArgument(
        "vram: CUDA IPC export of " + std::to_string(reinterpret_cast<std::uintptr_t>(pointer)) +
        ": not device memory of this process (cuMemGetAddressRange: " + driver_error_name(range) +
        "). Fix: export a live block of a device pool.");
  }
  IpcExport out;
  out.offset = static_cast<std::size_t>(reinterpret_cast<CUdeviceptr>(pointer) - base);
  out.allocation_bytes = bytes;
  const cudaError_t result = cudaIpcGetMemHandle(&out.handle, reinterpret_cast<void*>(base));
  if (result != cudaSuccess) {
    (void)cudaGetLastError();
    throw InvalidArgument(
        std::string("vram: CUDA IPC cannot share this block (cudaIpcGetMemHandle: ") +
        cudaGetErrorName(result) +
        "): it lies in CUDA virtual memory (the pool's virtual-memory large tier), which "
        "CUDA IPC handles cannot name. Fix: give the pool cudaMalloc segments "
        "(DevicePool::Options::large_tier.memory = LargeTierMemory::segments; for PyTorch, "
        "VRAM_TORCH_VIRTUAL_MEMORY=0 before the first CUDA allocation).");
  }
  return out;
}

void* open_ipc(const cudaIpcMemHandle_t& handle, int device) {
  const DeviceGuard on_device(device);
  void* base = nullptr;
  check(cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess),
        "cudaIpcOpenMemHandle");
  return base;
}

void close_ipc(void* base) noexcept {
  if (base != nullptr) (void)succeeded(cudaIpcCloseMemHandle(base));
}

}  // namespace vram::cuda
