// vram/cuda/stream.hpp: an owning, move-only CUDA stream (non-blocking by default).
//
//   vram::cuda::Stream stream;            // cudaStreamNonBlocking on the current device
//   kernel<<<1, 1, 0, stream.get()>>>();
//   stream.synchronize();
#pragma once

#include <cuda_runtime_api.h>

#include "vram/cuda/unique_handle.hpp"

namespace vram::cuda {

class Stream {
 public:
  enum class Kind { non_blocking, blocking };
  explicit Stream(Kind kind = Kind::non_blocking, int priority = 0);

  cudaStream_t get() const noexcept { return stream_.get(); }
  void synchronize() const;
  // True when all work queued so far has completed (cudaStreamQuery), without blocking.
  bool ready() const;

 private:
  static void destroy(cudaStream_t stream) noexcept;
  detail::UniqueHandle<cudaStream_t, &Stream::destroy> stream_;
};

}  // namespace vram::cuda
