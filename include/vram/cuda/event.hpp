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

#include "vram/cuda/unique_handle.hpp"

namespace vram::cuda {

class Event {
 public:
  enum class Timing { disabled, enabled };
  explicit Event(Timing timing = Timing::disabled);

  cudaEvent_t get() const noexcept { return event_.get(); }
  void record(cudaStream_t stream);
  // Makes `stream` wait for this event (cudaStreamWaitEvent) without blocking the host.
  void make_wait(cudaStream_t stream) const;
  // True once the work captured by the last record() has completed; never blocks.
  bool ready() const;
  // Blocks the host until that work has completed (cudaEventSynchronize).
  void wait() const;
  static float elapsed_ms(const Event& start, const Event& stop);

 private:
  static void destroy(cudaEvent_t event) noexcept;
  detail::UniqueHandle<cudaEvent_t, &Event::destroy> event_;
};

}  // namespace vram::cuda
