#include "vram/cuda/error.hpp"

#include <cuda.h>

#include <string>

#include "cuda/status.hpp"
#include "vram/cuda/driver_api.hpp"

namespace vram {

CudaError::CudaError(std::string call, int code, bool driver_error, std::string error_name,
                     std::string message)
    : std::runtime_error(message),
      call_(std::move(call)),
      code_(code),
      driver_error_(driver_error),
      error_name_(std::move(error_name)) {}

OutOfMemory::OutOfMemory(std::size_t requested_bytes, std::size_t cached_bytes,
                         std::size_t in_use_bytes, std::string detail)
    : requested_bytes_(requested_bytes),
      cached_bytes_(cached_bytes),
      in_use_bytes_(in_use_bytes),
      message_("vram: out of memory: " + std::to_string(requested_bytes) + " bytes requested (" +
               std::to_string(cached_bytes) + " bytes cached, " + std::to_string(in_use_bytes) +
               " bytes in use by this pool)" + (detail.empty() ? "" : ": " + detail)) {}

namespace cuda {

std::string_view fix_hint(cudaError_t result) noexcept {
  switch (result) {
    case cudaErrorNoDevice:
      return "Fix: no CUDA device is visible; check `nvidia-smi -L` and CUDA_VISIBLE_DEVICES.";
    case cudaErrorInsufficientDriver:
      return "Fix: install an NVIDIA driver that supports the CUDA runtime vram was built "
             "with (CUDA 13.0: driver 580 or newer); without a GPU, use the host-memory pools "
             "(DevicePool over HostMemoryUpstream, `vram bench --quick`).";
    case cudaErrorMemoryAllocation:
      return "Fix: the device is out of memory; free or trim pools (trim()), lower "
             "max_cached_bytes, or request less.";
    case cudaErrorNotSupported:
      return "Fix: this device or driver does not support the operation; check `vram info` "
             "(memory pools need CUDA 11.2+ and a driver that reports memoryPoolsSupported).";
    case cudaErrorInvalidDevice:
      return "Fix: the device ordinal is out of range; use 0 .. vram::cuda::Device::count()-1.";
    case cudaErrorInvalidValue:
      return "Fix: an argument is invalid (null pointer, zero size or a size beyond the "
             "device); check the values passed.";
    case cudaErrorCudartUnloading:
    case cudaErrorContextIsDestroyed:
      return "Fix: the CUDA runtime is shutting down or the context was destroyed; destroy "
             "pools before cudaDeviceReset() and never use them from static destructors.";
    case cudaErrorHostMemoryAlreadyRegistered:
      return "Fix: the host range is already registered; register each range once.";
    default:
      return {};
  }
}

std::string_view driver_fix_hint(int result) noexcept {
  switch (static_cast<CUresult>(result)) {
    case CUDA_ERROR_NO_DEVICE:
      return fix_hint(cudaErrorNoDevice);
    case CUDA_ERROR_OUT_OF_MEMORY:
      return fix_hint(cudaErrorMemoryAllocation);
    case CUDA_ERROR_NOT_SUPPORTED:
      return fix_hint(cudaErrorNotSupported);
    case CUDA_ERROR_INVALID_DEVICE:
      return fix_hint(cudaErrorInvalidDevice);
    case CUDA_ERROR_INVALID_VALUE:
      return fix_hint(cudaErrorInvalidValue);
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_CONTEXT_IS_DESTROYED:
    case CUDA_ERROR_INVALID_CONTEXT:
      return "Fix: no live CUDA context for this call (driver shut down, cudaDeviceReset() "
             "ran, or the context was destroyed); create pools after the device is set up "
             "and destroy them before it is reset.";
    default:
      return {};
  }
}

namespace {

// "<call> failed: <name> (<text>). <Fix: ...>" for runtime and driver errors alike.
CudaError describe(std::string_view call, int code, bool driver_error, std::string name,
                   std::string_view text, std::string_view fix) {
  std::string message = std::string(call) + " failed: " + name + " (" + std::string(text) + ")";
  if (!fix.empty()) {
    message += ". ";
    message += fix;
  }
  return CudaError(std::string(call), code, driver_error, std::move(name), std::move(message));
}

}  // namespace

CudaError make_error(cudaError_t result, std::string_view call) {
  return describe(call, static_cast<int>(result), false, cudaGetErrorName(result),
                  cudaGetErrorString(result), fix_hint(result));
}

void check_driver(int result, const char* call) {
  if (result == CUDA_SUCCESS) [[likely]]
    return;
  throw describe(call, result, true, driver_error_name(result), driver_error_string(result),
                 driver_fix_hint(result));
}

std::string error_text(cudaError_t result) {
  return std::string(cudaGetErrorName(result)) + " (" + cudaGetErrorString(result) + ")";
}

bool is_shutdown_error(cudaError_t result) noexcept {
  return result == cudaErrorCudartUnloading || result == cudaErrorContextIsDestroyed ||
         result == cudaErrorInitializationError || result == cudaErrorNoDevice ||
         result == cudaErrorInsufficientDriver;
}

bool is_driver_shutdown_error(int result) noexcept {
  return result == CUDA_ERROR_DEINITIALIZED || result == CUDA_ERROR_CONTEXT_IS_DESTROYED ||
         result == CUDA_ERROR_NOT_INITIALIZED || result == CUDA_ERROR_INVALID_CONTEXT;
}

}  // namespace cuda
}  // namespace vram
