#include "vram/cuda/stream.hpp"

#include "vram/cuda/error.hpp"

namespace vram::cuda {

Stream::Stream(Kind kind, int priority) {
  unsigned int flags = kind == Kind::non_blocking ? cudaStreamNonBlocking : cudaStreamDefault;
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithPriority(&stream, flags, priority), "cudaStreamCreateWithPriority");
  stream_ = detail::UniqueHandle<cudaStream_t, &Stream::destroy>(stream);
}

void Stream::destroy(cudaStream_t stream) noexcept {
  if (cudaStreamDestroy(stream) != cudaSuccess) (void)cudaGetLastError();
}

void Stream::synchronize() const {
  check(cudaStreamSynchronize(stream_.get()), "cudaStreamSynchronize");
}

bool Stream::ready() const {
  cudaError_t status = cudaStreamQuery(stream_.get());
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check(status, "cudaStreamQuery");
  return true;
}

}  // namespace vram::cuda
