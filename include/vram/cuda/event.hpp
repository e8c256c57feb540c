// vram/cuda/event.hpp: an owning, move-only CUDA event (timing off by default).
//
//   vram::cuda::Event done;                 // cudaEventDisableTiming
//   done.record(stream.get());
//   if (done.ready()) { ... }               // non-blocking query
//   done.wait();                            // host blocks until the work before it ran
//
//   vram::cuda::Event start(vram::cuda::Event::Timing::enabled), stop(...);
//   float ms = vram::cuda::Event::elapsed_ms(start, stop);
#pragma once

#include <cuda_runtime_api.h>

namespace vram::cuda {

class Event {
 public:
  enum class Timing { disabled, enabled };
  explicit Event(Timing timing = Timing::disabled);
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaEvent_t get() const noexcept { return event_; }
  void record(cudaStream_t stream);
  // Makes `stream` wait for this event (cudaStreamWaitEvent) without blocking the host.
  void make_wait(cudaStream_t stream) const;
  // True once the work captured by the last record() has completed; never blocks.
  bool ready() const;
  // Blocks the host until that work has completed (cudaEventSynchronize).
  void wait() const;
  static float elapsed_ms(const Event& start, const Event& stop);

 private:
  void destroy() noexcept;
  cudaEvent_t event_ = nullptr;
};

}  // namespace vram::cuda
