// vram/cuda/stream.hpp: an owning, move-only CUDA stream (non-blocking by default).
//
//   vram::cuda::Stream stream;            // cudaStreamNonBlocking on the current device
//   kernel<<<1, 1, 0, stream.get()>>>();
//   stream.synchronize();
#pragma once

#include <cuda_runtime_api.h>

namespace vram::cuda {

class Stream {
 public:
  enum class Kind { non_blocking, blocking };
  explicit Stream(Kind kind = Kind::non_blocking, int priority = 0);
  ~Stream();
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const noexcept { return stream_; }
  void synchronize() const;
  // True when all work queued so far has completed (cudaStreamQuery), without blocking.
  bool ready() const;

 private:
  void destroy() noexcept;
  cudaStream_t stream_ = nullptr;
};

}  // namespace vram::cuda
