#include "cuda/virtual_memory_api.hpp"

#include <cuda.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda/memory.hpp"
#include "cuda/status.hpp"

#include "vram/cuda/driver_api.hpp"
#include "vram/cuda/error.hpp"

namespace vram::cuda {
namespace {

CUmemAllocationProp allocation_prop(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

}  // namespace

bool virtual_memory_supported(int device) noexcept {
  const auto& api = driver_api();
  if (api.device_get_attribute.function == nullptr || api.mem_create.function == nullptr ||
      api.mem_map.function == nullptr || api.mem_set_access.function == nullptr) {
    return false;
  }
  int value = 0;
  if (api.device_get_attribute.function(&value,
                                        CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                        device) != CUDA_SUCCESS) {
    return false;
  }
  return value != 0;
}

std::size_t allocation_granularity(int device) {
  const auto& api = driver_api();
  const CUmemAllocationProp prop = allocation_prop(device);
  std::size_t granularity = 0;
  check_driver(api.require(api.mem_get_allocation_granularity)(
                   &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
               "cuMemGetAllocationGranularity");
  return granularity;
}

char* reserve_address_range(std::size_t bytes, std::size_t alignment) {
  const auto& api = driver_api();
  CUdeviceptr base = 0;
  check_driver(api.require(api.mem_address_reserve)(&base, bytes, alignment, 0, 0),
               "cuMemAddressReserve");
  return reinterpret_cast<char*>(base);
}

void free_address_range(char* base, std::size_t bytes) noexcept {
  if (auto f = driver_api().mem_address_free.function) {
    (void)f(reinterpret_cast<CUdeviceptr>(base), bytes);
  }
}

std::uint64_t create_physical(std::size_t bytes, int device) {
  const auto& api = driver_api();
  const CUmemAllocationProp prop = allocation_prop(device);
  CUmemGenericAllocationHandle handle = 0;
  const CUresult created = api.require(api.mem_create)(&handle, bytes, &prop, 0);
  if (created == CUDA_ERROR_OUT_OF_MEMORY) {
    throw OutOfMemory(
        bytes, 0, 0,
        "cuMemCreate on device " + std::to_string(device) + " returned CUDA_ERROR_OUT_OF_MEMORY");
  }
  check_driver(created, "cuMemCreate");
  return handle;
}

void map_for_device(char* address, std::size_t bytes, std::uint64_t handle, int device) {
  const auto& api = driver_api();
  const auto pointer = reinterpret_cast<CUdeviceptr>(address);
  CUresult result = api.require(api.mem_map)(pointer, bytes, 0, handle, 0);
  if (result == CUDA_SUCCESS) {
    // Read and write for the device and for every device that can reach it by peer access
    // (mapped memory is reachable only from the devices named here).
    std::vector<CUmemAccessDesc> access;
    int count = 0;
    if (!succeeded(cudaGetDeviceCount(&count))) count = 0;
    for (int d = 0; d < std::max(count, device + 1); ++d) {
      if (d != device && !can_access_peer(d, device)) continue;
      CUmemAccessDesc desc{};
      desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      desc.location.id = d;
      desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      access.push_back(desc);
    }
    result = api.require(api.mem_set_access)(pointer, bytes, access.data(), access.size());
    if (result != CUDA_SUCCESS) (void)api.mem_unmap.function(pointer, bytes);
  }
  if (result == CUDA_ERROR_OUT_OF_MEMORY) {  // the pool reclaims and retries, as for cuMemCreate
    throw OutOfMemory(bytes, 0, 0,
                      "cuMemMap/cuMemSetAccess on device " + std::to_string(device) +
                          " returned CUDA_ERROR_OUT_OF_MEMORY");
  }
  check_driver(result, "cuMemMap/cuMemSetAccess");
}

void unmap(char* address, std::size_t bytes) noexcept {
  if (auto f = driver_api().mem_unmap.function) {
    (void)f(reinterpret_cast<CUdeviceptr>(address), bytes);
  }
}

void release_physical(std::uint64_t handle) noexcept {
  if (auto f = driver_api().mem_release.function) (void)f(handle);
}

}  // namespace vram::cuda
