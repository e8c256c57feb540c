#include "vram/cuda/event.hpp"

#include <utility>

#include "vram/cuda/error.hpp"

namespace vram::cuda {

Event::Event(Timing timing) {
  unsigned int flags = timing == Timing::enabled ? cudaEventDefault : cudaEventDisableTiming;
  check(cudaEventCreateWithFlags(&event_, flags), "cudaEventCreateWithFlags");
}

Event::~Event() { destroy(); }

Event::Event(Event&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    destroy();
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

void Event::destroy() noexcept {
  if (event_ != nullptr && cudaEventDestroy(event_) != cudaSuccess) (void)cudaGetLastError();
  event_ = nullptr;
}

void Event::record(cudaStream_t stream) {
  check(cudaEventRecord(event_, stream), "cudaEventRecord");
}

void Event::make_wait(cudaStream_t stream) const {
  check(cudaStreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
}

bool Event::ready() const {
  cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check(status, "cudaEventQuery");
  return true;
}

void Event::wait() const { check(cudaEventSynchronize(event_), "cudaEventSynchronize"); }

float Event::elapsed_ms(const Event& start, const Event& stop) {
  float ms = 0.0F;
  check(cudaEventElapsedTime(&ms, start.event_, stop.event_), "cudaEventElapsedTime");
  return ms;
}

}  // namespace vram::cuda
