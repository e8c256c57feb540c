#include "vram/cuda/driver_api.hpp"

#include <cuda_runtime_api.h>

#include <string>

#include "vram/cuda/error.hpp"

namespace vram::cuda {
namespace {

template <class Function>
void resolve(DriverEntry<Function>& entry, const char* name, unsigned int version) {
  entry.name = name;
  entry.version = version;
  void* pointer = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  cudaError_t result =
      cudaGetDriverEntryPointByVersion(name, &pointer, version, cudaEnableDefault, &status);
  if (result == cudaSuccess && status == cudaDriverEntryPointSuccess) {
    entry.function = reinterpret_cast<Function>(pointer);
  } else {
    (void)cudaGetLastError();
  }
}

DriverApi resolve_all() {
  DriverApi api;
  resolve(api.get_error_name, "cuGetErrorName", 6000);
  resolve(api.get_error_string, "cuGetErrorString", 6000);
  resolve(api.device_get, "cuDeviceGet", 2000);
  resolve(api.ctx_get_current, "cuCtxGetCurrent", 4000);
  resolve(api.ctx_set_current, "cuCtxSetCurrent", 4000);
  resolve(api.device_get_default_mem_pool, "cuDeviceGetDefaultMemPool", 11020);
  resolve(api.mem_pool_create, "cuMemPoolCreate", 11020);
  resolve(api.mem_pool_destroy, "cuMemPoolDestroy", 11020);
  resolve(api.mem_pool_set_attribute, "cuMemPoolSetAttribute", 11020);
  resolve(api.mem_pool_get_attribute, "cuMemPoolGetAttribute", 11020);
  resolve(api.mem_pool_trim_to, "cuMemPoolTrimTo", 11020);
  resolve(api.mem_alloc_from_pool_async, "cuMemAllocFromPoolAsync", 11020);
  resolve(api.mem_free_async, "cuMemFreeAsync", 11020);
  resolve(api.mem_address_reserve, "cuMemAddressReserve", 10020);
  resolve(api.mem_address_free, "cuMemAddressFree", 10020);
  resolve(api.mem_create, "cuMemCreate", 10020);
  resolve(api.mem_release, "cuMemRelease", 10020);
  resolve(api.mem_map, "cuMemMap", 10020);
  resolve(api.mem_unmap, "cuMemUnmap", 10020);
  resolve(api.mem_set_access, "cuMemSetAccess", 10020);
  resolve(api.mem_get_allocation_granularity, "cuMemGetAllocationGranularity", 10020);
  resolve(api.device_get_attribute, "cuDeviceGetAttribute", 2000);
  resolve(api.mem_get_address_range, "cuMemGetAddressRange", 3020);
  return api;
}

}  // namespace

void DriverApi::throw_missing(const char* name, unsigned int version) {
  int driver_version = 0;
  (void)cudaDriverGetVersion(&driver_version);
  (void)cudaGetLastError();
  std::string message =
      std::string("driver entry point ") + name +
      " is not available (it needs a driver supporting CUDA " + std::to_string(version / 1000) +
      "." + std::to_string((version % 1000) / 10) + "; the installed driver reports " +
      (driver_version == 0 ? std::string("no driver") : std::to_string(driver_version)) +
      "). Fix: install a newer NVIDIA driver.";
  throw CudaError(name, static_cast<int>(CUDA_ERROR_NOT_FOUND), true, "CUDA_ERROR_NOT_FOUND",
                  std::move(message));
}

const DriverApi& driver_api() noexcept {
  static const DriverApi api = resolve_all();
  return api;
}

std::string driver_error_name(int result) {
  const char* text = nullptr;
  if (auto f = driver_api().get_error_name.function;
      f != nullptr && f(static_cast<CUresult>(result), &text) == CUDA_SUCCESS && text != nullptr) {
    return text;
  }
  return "CUresult " + std::to_string(result);
}

std::string driver_error_string(int result) {
  const char* text = nullptr;
  if (auto f = driver_api().get_error_string.function;
      f != nullptr && f(static_cast<CUresult>(result), &text) == CUDA_SUCCESS && text != nullptr) {
    return text;
  }
  return "no driver available to describe it";
}

}  // namespace vram::cuda
