#include "vram/virtual_memory.hpp"

#include <sys/mman.h>

#include <algorithm>

#include "cuda/memory.hpp"
#include "cuda/virtual_memory_api.hpp"
#include "vram/cuda/device.hpp"
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

bool CudaVirtualMemory::supported(int device) noexcept {
  return cuda::virtual_memory_supported(device);
}

CudaVirtualMemory::CudaVirtualMemory(int device) : device_(device) {
  cuda::DeviceGuard guard(device_);
  cuda::initialize_context(device_);  // the primary context
  granularity_ = std::max(granularity_, cuda::allocation_granularity(device_));
}

CudaVirtualMemory::~CudaVirtualMemory() = default;

// The reservation and its free take sizes in whole granules; the same rounding on both
// sides keeps the free matching the reservation.
char* CudaVirtualMemory::reserve(std::size_t bytes) {
  bytes = (bytes + granularity_ - 1) / granularity_ * granularity_;
  return cuda::reserve_address_range(bytes, granularity_);
}

void CudaVirtualMemory::unreserve(char* base, std::size_t bytes) noexcept {
  bytes = (bytes + granularity_ - 1) / granularity_ * granularity_;
  cuda::free_address_range(base, bytes);
}

std::uint64_t CudaVirtualMemory::create(std::size_t bytes) {
  return cuda::create_physical(bytes, device_);
}

void CudaVirtualMemory::map_created(char* address, std::size_t bytes, std::uint64_t handle) {
  cuda::map_for_device(address, bytes, handle, device_);
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
  const auto info = cuda::memory_info(device_);
  return info ? info->free_bytes : SIZE_MAX;  // unknown when the runtime cannot say
}

void CudaVirtualMemory::unmap(char* address, std::size_t bytes, std::uint64_t handle) noexcept {
  unmap_only(address, bytes);
  release(handle);
}

void CudaVirtualMemory::unmap_only(char* address, std::size_t bytes) noexcept {
  cuda::unmap(address, bytes);
}

void CudaVirtualMemory::release(std::uint64_t handle) noexcept { cuda::release_physical(handle); }

}  // namespace vram
