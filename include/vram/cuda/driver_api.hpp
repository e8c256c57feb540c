// vram/cuda/driver_api.hpp: the CUDA driver functions vram uses, resolved once.
//
// vram links only the static CUDA runtime. Driver functions (the cuMemPool* family and a
// few context calls) are looked up at first use through cudaGetDriverEntryPointByVersion,
// so a binary starts on a machine without libcuda and reports a clear error only when a
// driver feature is actually used.
//
//   const auto& api = vram::cuda::driver_api();     // resolves every entry once
//   auto alloc = api.require(api.mem_alloc_from_pool_async);  // throws if missing
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

namespace vram::cuda {

// One resolved driver function: the pointer (null when the driver lacks it), its name,
// and the CUDA version whose ABI we asked for.
template <class Function>
struct DriverEntry {
  Function function = nullptr;
  const char* name = "";
  unsigned int version = 0;
};

struct DriverApi {
  DriverEntry<PFN_cuGetErrorName_v6000> get_error_name;
  DriverEntry<PFN_cuGetErrorString_v6000> get_error_string;
  DriverEntry<PFN_cuDeviceGet_v2000> device_get;
  DriverEntry<PFN_cuCtxGetCurrent_v4000> ctx_get_current;
  DriverEntry<PFN_cuCtxSetCurrent_v4000> ctx_set_current;
  DriverEntry<PFN_cuDeviceGetDefaultMemPool_v11020> device_get_default_mem_pool;
  DriverEntry<PFN_cuMemPoolCreate_v11020> mem_pool_create;
  DriverEntry<PFN_cuMemPoolDestroy_v11020> mem_pool_destroy;
  DriverEntry<PFN_cuMemPoolSetAttribute_v11020> mem_pool_set_attribute;
  DriverEntry<PFN_cuMemPoolGetAttribute_v11020> mem_pool_get_attribute;
  DriverEntry<PFN_cuMemPoolTrimTo_v11020> mem_pool_trim_to;
  DriverEntry<PFN_cuMemAllocFromPoolAsync_v11020> mem_alloc_from_pool_async;
  DriverEntry<PFN_cuMemFreeAsync_v11020> mem_free_async;
  // Virtual memory management (DevicePool's virtual-memory large tier).
  DriverEntry<PFN_cuMemAddressReserve_v10020> mem_address_reserve;
  DriverEntry<PFN_cuMemAddressFree_v10020> mem_address_free;
  DriverEntry<PFN_cuMemCreate_v10020> mem_create;
  DriverEntry<PFN_cuMemRelease_v10020> mem_release;
  DriverEntry<PFN_cuMemMap_v10020> mem_map;
  DriverEntry<PFN_cuMemUnmap_v10020> mem_unmap;
  DriverEntry<PFN_cuMemSetAccess_v10020> mem_set_access;
  DriverEntry<PFN_cuMemGetAllocationGranularity_v10020> mem_get_allocation_granularity;
  DriverEntry<PFN_cuDeviceGetAttribute_v2000> device_get_attribute;
  // CUDA IPC: the allocation a pointer lies in (src/cuda/ipc.cpp).
  DriverEntry<PFN_cuMemGetAddressRange_v3020> mem_get_address_range;

  // The function, or throws vram::CudaError naming it and the driver version it needs.
  template <class Function>
  Function require(const DriverEntry<Function>& entry) const {
    if (entry.function == nullptr) throw_missing(entry.name, entry.version);
    return entry.function;
  }

  [[noreturn]] static void throw_missing(const char* name, unsigned int version);
};

// Resolves all entries on the first call (thread-safe), then returns the same table.
// Never throws: entries the driver lacks (or all, without a driver) stay null.
const DriverApi& driver_api() noexcept;

// Name and text of a driver result, or "CUresult <n>" when no driver can say.
std::string driver_error_name(int result);
std::string driver_error_string(int result);

}  // namespace vram::cuda
