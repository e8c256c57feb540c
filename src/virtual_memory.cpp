#include "vram/virtual_memory.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <string>

#include "vram/cuda/device.hpp"
#include "vram/cuda/driver_api.hpp"
#include "vram/cuda/error.hpp"

namespace vram {

// ---- host emulation ------------------------------------------------------------------

HostVirtualMemory::HostVirtualMemory(std::shared_ptr<Upstream> physical, std::size_t granularity)
    : physical_(std::move(physical)), granularity_(granularity) {
  if (!physical_) throw InvalidArgument("vram::HostVirtualMemory: the upstream is null");
}

HostVirtualMemory::~HostVirtualMemory() = default;

char* HostVirtualMemory::reserve(std::size_t bytes) {
  // Over-reserve by one granule so the range can start on a granule boundary.
  void* base = mmap(nullptr, bytes + granularity_, PROT_NONE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    throw OutOfMemory(bytes, 0, 0, "host emulation: mmap could not reserve the address range");
  }
  const auto raw = reinterpret_cast<std::uintptr_t>(base);
  const std::uintptr_t aligned = (raw + granularity_ - 1) & ~(granularity_ - 1);
  if (aligned != raw) munmap(base, aligned - raw);
  const std::size_t tail = granularity_ - (aligned - raw);
  if (tail != 0) munmap(reinterpret_cast<char*>(aligned) + bytes, tail);
  return reinterpret_cast<char*>(aligned);
}

void HostVirtualMemory::unreserve(char* base, std::size_t bytes) noexcept { munmap(base, bytes); }

std::uint64_t HostVirtualMemory::map(char* address, std::size_t bytes) {
  void* token = detail::allocate_non_null(*physical_, bytes);  // charges the emulated device
  if (mprotect(address, bytes, PROT_READ | PROT_WRITE) != 0) {
    physical_->deallocate(token, bytes);
    throw OutOfMemory(bytes, 0, 0, "host emulation: mprotect failed");
  }
  return reinterpret_cast<std::uint64_t>(token);
}

void HostVirtualMemory::unmap(char* address, std::size_t bytes, std::uint64_t handle) noexcept {
  madvise(address, bytes, MADV_DONTNEED);  // the "physical" pages really go
  mprotect(address, bytes, PROT_NONE);
  physical_->deallocate(reinterpret_cast<void*>(handle), bytes);
}

// ---- CUDA ------------------------------------------------------------------------------

namespace {

CUmemAllocationProp allocation_prop(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

}  // namespace

bool CudaVirtualMemory::supported(int device) noexcept {
  const auto& api = cuda::driver_api();
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

CudaVirtualMemory::CudaVirtualMemory(int device) : device_(device) {
  const auto& api = cuda::driver_api();
  cuda::DeviceGuard guard(device_);
  cuda::check(cudaFree(nullptr), "cudaFree(nullptr)");  // the primary context
  const CUmemAllocationProp prop = allocation_prop(device_);
  std::size_t granularity = 0;
  cuda::check_driver(api.require(api.mem_get_allocation_granularity)(
                         &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                     "cuMemGetAllocationGranularity");
  granularity_ = std::max(granularity_, granularity);
}

CudaVirtualMemory::~CudaVirtualMemory() = default;

// cuMemAddressReserve and cuMemAddressFree take sizes in whole granules; the same rounding
// on both sides keeps the free matching the reservation.
char* CudaVirtualMemory::reserve(std::size_t bytes) {
  bytes = (bytes + granularity_ - 1) / granularity_ * granularity_;
  const auto& api = cuda::driver_api();
  CUdeviceptr base = 0;
  cuda::check_driver(api.require(api.mem_address_reserve)(&base, bytes, granularity_, 0, 0),
                     "cuMemAddressReserve");
  return reinterpret_cast<char*>(base);
}

void CudaVirtualMemory::unreserve(char* base, std::size_t bytes) noexcept {
  bytes = (bytes + granularity_ - 1) / granularity_ * granularity_;
  if (auto f = cuda::driver_api().mem_address_free.function) {
    (void)f(reinterpret_cast<CUdeviceptr>(base), bytes);
  }
}

std::uint64_t CudaVirtualMemory::create(std::size_t bytes) {
  const auto& api = cuda::driver_api();
  const CUmemAllocationProp prop = allocation_prop(device_);
  CUmemGenericAllocationHandle handle = 0;
  const CUresult created = api.require(api.mem_create)(&handle, bytes, &prop, 0);
  if (created == CUDA_ERROR_OUT_OF_MEMORY) {
    throw OutOfMemory(
        bytes, 0, 0,
        "cuMemCreate on device " + std::to_string(device_) + " returned CUDA_ERROR_OUT_OF_MEMORY");
  }
  cuda::check_driver(created, "cuMemCreate");
  return handle;
}

void CudaVirtualMemory::map_created(char* address, std::size_t bytes, std::uint64_t handle) {
  const auto& api = cuda::driver_api();
  const auto pointer = reinterpret_cast<CUdeviceptr>(address);
  CUresult result = api.require(api.mem_map)(pointer, bytes, 0, handle, 0);
  if (result == CUDA_SUCCESS) {
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    result = api.require(api.mem_set_access)(pointer, bytes, &access, 1);
    if (result != CUDA_SUCCESS) (void)api.mem_unmap.function(pointer, bytes);
  }
  if (result == CUDA_ERROR_OUT_OF_MEMORY) {  // the pool reclaims and retries, as for cuMemCreate
    throw OutOfMemory(bytes, 0, 0,
                      "cuMemMap/cuMemSetAccess on device " + std::to_string(device_) +
                          " returned CUDA_ERROR_OUT_OF_MEMORY");
  }
  cuda::check_driver(result, "cuMemMap/cuMemSetAccess");
}

std::uint64_t CudaVirtualMemory::map(char* address, std::size_t bytes) {
  const std::uint64_t handle = create(bytes);
  try {
    map_created(address, bytes, handle);
  } catch (...) {
    release(handle);
    throw;
  }
  return handle;
}

std::size_t CudaVirtualMemory::available_bytes() const noexcept {
  try {
    cuda::DeviceGuard guard(device_);
    std::size_t free = 0;
    std::size_t total = 0;
    if (cudaMemGetInfo(&free, &total) == cudaSuccess) return free;
    (void)cudaGetLastError();
  } catch (...) {  // the device cannot be made current: unknown
  }
  return SIZE_MAX;
}

void CudaVirtualMemory::unmap(char* address, std::size_t bytes, std::uint64_t handle) noexcept {
  unmap_only(address, bytes);
  release(handle);
}

void CudaVirtualMemory::unmap_only(char* address, std::size_t bytes) noexcept {
  if (auto f = cuda::driver_api().mem_unmap.function) {
    (void)f(reinterpret_cast<CUdeviceptr>(address), bytes);
  }
}

void CudaVirtualMemory::release(std::uint64_t handle) noexcept {
  if (auto f = cuda::driver_api().mem_release.function) (void)f(handle);
}

}  // namespace vram
