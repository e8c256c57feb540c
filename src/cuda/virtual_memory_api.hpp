// src/cuda/virtual_memory_api.hpp: CUDA virtual memory management (cuMemAddressReserve,
// cuMemCreate, cuMemMap, cuMemSetAccess, ...), as CudaVirtualMemory drives it.
//
// Rules:
// - An address range, a physical allocation and a mapping are three things: a range is
//   reserved once; a physical allocation (a handle) is mapped at a granule-aligned address
//   of a range and unmapped whole; the handle is released after its unmap.
// - Sizes are whole granules (allocation_granularity()); reserve and free of one range use
//   the same rounding.
// - Calls that make something throw vram::OutOfMemory when the device is full (the pool
//   trims and retries) and vram::CudaError otherwise; calls that take something back are
//   noexcept and tolerate a shut-down driver.
#pragma once

#include <cstddef>
#include <cstdint>

namespace vram::cuda {

// True when the driver has the entry points and the device supports virtual memory
// management.
bool virtual_memory_supported(int device) noexcept;
// The recommended granularity of a physical allocation on `device`.
std::size_t allocation_granularity(int device);

// Reserves `bytes` of address space aligned to `alignment` (both whole granules).
char* reserve_address_range(std::size_t bytes, std::size_t alignment);
void free_address_range(char* base, std::size_t bytes) noexcept;

// One physical allocation of `bytes` on `device`; returns its handle.
std::uint64_t create_physical(std::size_t bytes, int device);
// Maps `handle` at `address` with read-write access for `device`; on failure nothing stays
// mapped and the handle stays the caller's.
void map_for_device(char* address, std::size_t bytes, std::uint64_t handle, int device);
void unmap(char* address, std::size_t bytes) noexcept;
void release_physical(std::uint64_t handle) noexcept;

}  // namespace vram::cuda
