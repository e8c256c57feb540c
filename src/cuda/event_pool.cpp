#include "cuda/event_pool.hpp"

#include "cuda/capture.hpp"
#include "cuda/status.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/error.hpp"

namespace vram::cuda {

EventPool::~EventPool() {
  for (cudaEvent_t event : spare_) (void)succeeded(cudaEventDestroy(event));
}

cudaEvent_t EventPool::take() {
  {
    std::lock_guard lock(mutex_);
    if (!spare_.empty()) {
      cudaEvent_t event = spare_.back();
      spare_.pop_back();
      return event;
    }
  }
  DeviceGuard guard(device_);
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  return event;
}

cudaEvent_t EventPool::try_take() noexcept {
  try {
    return take();
  } catch (...) {
    return nullptr;
  }
}

void EventPool::give_back(cudaEvent_t event) noexcept {
  if (event == nullptr) return;
  std::lock_guard lock(mutex_);
  try {
    spare_.push_back(event);
  } catch (...) {
    (void)succeeded(cudaEventDestroy(event));
  }
}

void record(cudaEvent_t event, cudaStream_t stream, const char* what) {
  check(cudaEventRecord(event, stream), what);
}

bool try_record(cudaEvent_t event, cudaStream_t stream) noexcept {
  return succeeded(cudaEventRecord(event, stream));
}

EventState query(cudaEvent_t event) noexcept {
  const RelaxedCaptureMode relaxed;
  const cudaError_t status = cudaEventQuery(event);
  if (status == cudaSuccess) return EventState::complete;
  clear_last_error();
  switch (status) {
    case cudaErrorNotReady:
    case cudaErrorCapturedEvent:
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
    case cudaErrorStreamCaptureImplicit:
    case cudaErrorStreamCaptureWrongThread:
      return EventState::pending;
    default:
      return EventState::complete;
  }
}

void synchronize(cudaEvent_t event) noexcept {
  const RelaxedCaptureMode relaxed;
  (void)succeeded(cudaEventSynchronize(event));
}

void make_wait(cudaStream_t stream, cudaEvent_t event) {
  check(cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent");
}

}  // namespace vram::cuda
