// src/cuda/event_pool.hpp: the library's one pool of CUDA events, and the event calls.
//
// Every "has this GPU work completed?" of the library is an event recorded after the work
// and observed through query() (non-blocking) or synchronize() (blocking); see
// vram/completion.hpp for the vocabulary. Events are timing-disabled, made on the pool's
// device, and recycled: once warm, recording a completion creates nothing.
//
// Rules:
// - query() and synchronize() run in relaxed capture mode (capture.hpp), so a pool
//   observing its completions never invalidates another thread's global-mode capture.
// - query() says pending for cudaErrorNotReady and for the capture errors (the event
//   belongs to a graph being captured: its work has not run). Any other error (the driver
//   is shutting down, the context is gone) says complete: nothing will run any more, and a
//   block held for it would be lost otherwise.
// - An event given back must not be queried again by the one who gave it back.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <mutex>
#include <vector>

namespace vram::cuda {

enum class EventState { complete, pending };

class EventPool {
 public:
  explicit EventPool(int device) noexcept : device_(device) {}
  ~EventPool();  // destroys every event it made; tolerates a shut-down runtime
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  int device() const noexcept { return device_; }
  // A recycled event, or a new one made on the pool's device. Throws vram::CudaError.
  cudaEvent_t take();
  // As take(), null when no event can be made (the failure is cleared).
  cudaEvent_t try_take() noexcept;
  // Recycles an event of this pool. Never throws (an event that cannot be kept is
  // destroyed).
  void give_back(cudaEvent_t event) noexcept;

 private:
  int device_;
  mutable std::mutex mutex_;
  std::vector<cudaEvent_t> spare_;
};

// cudaEventRecord; throws vram::CudaError naming `what`.
void record(cudaEvent_t event, cudaStream_t stream, const char* what);
// As record(); false (the failure cleared) when the event could not be recorded.
bool try_record(cudaEvent_t event, cudaStream_t stream) noexcept;
EventState query(cudaEvent_t event) noexcept;
// Blocks until the work before the event has run (errors cleared: see query()'s rule).
void synchronize(cudaEvent_t event) noexcept;
// Makes `stream` wait on the device for `event`; throws vram::CudaError.
void make_wait(cudaStream_t stream, cudaEvent_t event);

}  // namespace vram::cuda
