#include "cuda/capture.hpp"

#include "cuda/status.hpp"

namespace vram::cuda {

RelaxedCaptureMode::RelaxedCaptureMode() noexcept {
  if (!succeeded(cudaThreadExchangeStreamCaptureMode(&mode_))) restore_ = false;
}

RelaxedCaptureMode::~RelaxedCaptureMode() {
  if (restore_) (void)succeeded(cudaThreadExchangeStreamCaptureMode(&mode_));
}

CaptureInfo capture_info(cudaStream_t stream) noexcept {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  if (!succeeded(cudaStreamGetCaptureInfo(stream, &status, &id))) {
    return {CaptureState::unknown, 0};
  }
  switch (status) {
    case cudaStreamCaptureStatusNone:
      return {CaptureState::none, 0};
    case cudaStreamCaptureStatusActive:
      return {CaptureState::active, id};
    case cudaStreamCaptureStatusInvalidated:
      return {CaptureState::invalidated, 0};
  }
  return {CaptureState::unknown, 0};
}

}  // namespace vram::cuda
