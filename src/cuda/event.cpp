#include "vram/cuda/event.hpp"

#include "vram/cuda/error.hpp"

namespace vram::cuda {

Event::Event(Timing timing) {
  unsigned int flags = timing == Timing::enabled ? cudaEventDefault : cudaEventDisableTiming;
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, flags), "cudaEventCreateWithFlags");
  event_ = detail::UniqueHandle<cudaEvent_t, &Event::destroy>(event);
}

void Event::destroy(cudaEvent_t event) noexcept {
  if (cudaEventDestroy(event) != cudaSuccess) (void)cudaGetLastError();
}

void Event::record(cudaStream_t stream) {
  check(cudaEventRecord(event_.get(), stream), "cudaEventRecord");
}

void Event::make_wait(cudaStream_t stream) const {
  check(cudaStreamWaitEvent(stream, event_.get(), 0), "cudaStreamWaitEvent");
}

bool Event::ready() const {
  cudaError_t status = cudaEventQuery(event_.get());
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check(status, "cudaEventQuery");
  return true;
}

void Event::wait() const { check(cudaEventSynchronize(event_.get()), "cudaEventSynchronize"); }

float Event::elapsed_ms(const Event& start, const Event& stop) {
  float ms = 0.0F;
  check(cudaEventElapsedTime(&ms, start.event_.get(), stop.event_.get()), "cudaEventElapsedTime");
  return ms;
}

}  // namespace vram::cuda
