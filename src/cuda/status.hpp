// src/cuda/status.hpp: the runtime's last-error slot, handled in one place.
//
// Rule: a CUDA runtime call that fails with a non-sticky error leaves that error in the
// calling thread's last-error slot, where the next unrelated cudaGetLastError() (PyTorch's
// launch checks, a user's) would report it. Every call of this layer that fails and does
// not throw clears the slot through succeeded() or clear_last_error().
#pragma once

#include <cuda_runtime_api.h>

#include <string>

namespace vram::cuda {

inline void clear_last_error() noexcept { (void)cudaGetLastError(); }

// True for cudaSuccess; otherwise clears the last-error slot and returns false.
inline bool succeeded(cudaError_t result) noexcept {
  if (result == cudaSuccess) return true;
  clear_last_error();
  return false;
}

// "cudaErrorMemoryAllocation (out of memory)": the error's name and text.
std::string error_text(cudaError_t result);

}  // namespace vram::cuda
