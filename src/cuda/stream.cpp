#include "vram/cuda/stream.hpp"

#include <utility>

#include "vram/cuda/error.hpp"

namespace vram::cuda {

Stream::Stream(Kind kind, int priority) {
  unsigned int flags = kind == Kind::non_blocking ? cudaStreamNonBlocking : cudaStreamDefault;
  check(cudaStreamCreateWithPriority(&stream_, flags, priority), "cudaStreamCreateWithPriority");
}

Stream::~Stream() { destroy(); }

Stream::Stream(Stream&& other) noexcept : stream_(std::exchange(other.stream_, nullptr)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    destroy();
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

void Stream::destroy() noexcept {
  if (stream_ != nullptr && cudaStreamDestroy(stream_) != cudaSuccess) (void)cudaGetLastError();
  stream_ = nullptr;
}

void Stream::synchronize() const { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

bool Stream::ready() const {
  cudaError_t status = cudaStreamQuery(stream_);
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check(status, "cudaStreamQuery");
  return true;
}

}  // namespace vram::cuda
