// src/cuda/host_registration.hpp: host memory page-locked in place (cudaHostRegister).
//
// Rules:
// - Every registration of host memory by the library is made by register_host_pages(): the
//   pinned host upstream's mappings and the weight pager's host weights alike.
// - Every pin failure is described in one form, by pin_failure_text():
//     "<call> of <bytes> bytes returned <name> (<text>); RLIMIT_MEMLOCK is <limit>"
// - A registration made here is undone only through unregister_host_pages() (or
//   cuda::unregister_host for a single one), which tolerates a shut-down runtime.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace vram::cuda {

struct HostRange {
  const void* data = nullptr;
  std::size_t bytes = 0;
};

// One cudaHostRegister call's range, as registered.
struct HostRegistration {
  void* pointer = nullptr;
  std::size_t bytes = 0;
};

struct PinFailure {
  cudaError_t status = cudaSuccess;
  std::string reason;  // pin_failure_text()
};

// The RLIMIT_MEMLOCK soft limit as text ("unlimited", "unknown" or bytes).
std::string memlock_limit_text();
std::string pin_failure_text(const char* call, cudaError_t status, std::size_t bytes);

// Registers (cudaHostRegisterPortable) the pages the ranges cover: each range is widened to
// whole pages, overlapping or touching page ranges are merged and registered once, in
// chunks of at most `chunk_bytes` (rounded down to whole pages, at least one page; 0: one
// chunk a merged range). Every chunk registered is appended to `registered`, sorted by
// address. On a failure the call stops and returns it; the chunks it registered before
// stay in `registered` for the caller to undo.
std::optional<PinFailure> register_host_pages(std::span<const HostRange> ranges,
                                              std::size_t chunk_bytes,
                                              std::vector<HostRegistration>& registered);

// Unregisters every registration and empties the list. Never throws.
void unregister_host_pages(std::vector<HostRegistration>& registered) noexcept;

}  // namespace vram::cuda
