// vram/cuda/error.hpp: the exceptions vram throws and the checks that raise them.
//
// Every failing CUDA call becomes a vram::CudaError that names the call, the CUDA error
// (name and text) and, for the common failures, a "Fix:" hint. Allocation failures become
// vram::OutOfMemory, which derives from std::bad_alloc so generic code catches it too.
//
//   try {
//     vram::cuda::check(cudaSetDevice(7), "cudaSetDevice");
//   } catch (const vram::CudaError& e) {
//     std::cerr << e.what();  // "cudaSetDevice failed: cudaErrorInvalidDevice (...). Fix: ..."
//   }
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>

namespace vram {

// A CUDA runtime or driver call failed. `code()` is the numeric result of the failing
// API (runtime cudaError_t or driver CUresult, see `is_driver_error()`).
class CudaError : public std::runtime_error {
 public:
  CudaError(std::string call, int code, bool driver_error, std::string error_name,
            std::string message);

  const std::string& call() const noexcept { return call_; }
  int code() const noexcept { return code_; }
  bool is_driver_error() const noexcept { return driver_error_; }
  const std::string& error_name() const noexcept { return error_name_; }

 private:
  std::string call_;
  int code_;
  bool driver_error_;
  std::string error_name_;
};

// An allocation could not be satisfied. Carries the size asked for and, where a pool
// raised it, the bytes that pool held cached and in use at the time.
class OutOfMemory : public std::bad_alloc {
 public:
  OutOfMemory(std::size_t requested_bytes, std::size_t cached_bytes, std::size_t in_use_bytes,
              std::string detail);

  const char* what() const noexcept override { return message_.c_str(); }
  std::size_t requested_bytes() const noexcept { return requested_bytes_; }
  std::size_t cached_bytes() const noexcept { return cached_bytes_; }
  std::size_t in_use_bytes() const noexcept { return in_use_bytes_; }

 private:
  std::size_t requested_bytes_;
  std::size_t cached_bytes_;
  std::size_t in_use_bytes_;
  std::string message_;
};

// Bad input at the API boundary (zero bytes, unsupported alignment, ...). Nothing was
// allocated or changed when this is thrown.
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Page-locking host memory failed (RLIMIT_MEMLOCK, container memlock caps, ...).
// Never swallowed: vram does not fall back to pageable memory silently.
class PinningError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace cuda {

// The "Fix:" hint for a runtime error, or an empty view when there is none.
std::string_view fix_hint(cudaError_t result) noexcept;
// The "Fix:" hint for a driver CUresult (passed as int so this header needs no cuda.h).
std::string_view driver_fix_hint(int result) noexcept;

// Builds (does not throw) the error for a failing runtime call.
CudaError make_error(cudaError_t result, std::string_view call);

// Throws vram::CudaError when `result` is not cudaSuccess. Clears the runtime's
// last-error slot so a non-sticky error does not leak into the next call.
inline void check(cudaError_t result, const char* call) {
  if (result != cudaSuccess) [[unlikely]] {
    (void)cudaGetLastError();
    throw make_error(result, call);
  }
}

// Throws vram::CudaError for a failing driver call (CUresult passed as int).
void check_driver(int result, const char* call);

// True for the results that mean the driver or runtime is shutting down or gone. Destructors
// that see these skip their cleanup instead of reporting it.
bool is_shutdown_error(cudaError_t result) noexcept;
bool is_driver_shutdown_error(int result) noexcept;

}  // namespace cuda
}  // namespace vram
