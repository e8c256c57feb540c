// src/cuda/capture.hpp: CUDA graph capture, as the pools see it.
//
// Rules:
// - While a stream is captured in global or thread-local mode, an event query, a
//   synchronize, cudaMalloc or cudaFree on another stream or thread invalidates the
//   capture. Every event query and synchronize of the library runs under
//   RelaxedCaptureMode, which allows them (PyTorch's caching allocator does the same).
// - Work enqueued on a capturing stream does not run: it becomes a node of the graph, and
//   runs at each launch of the graph. Memory such work touches is the graph's until the
//   graph is gone (see capture_state()).
#pragma once

#include <cuda_runtime_api.h>

namespace vram::cuda {

// The calling thread in relaxed stream-capture mode for the object's lifetime; the
// previous mode is restored on destruction. Never throws; a runtime that cannot switch
// (shut down) leaves the mode as it was.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() noexcept;
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool restore_ = true;
};

enum class CaptureState {
  none,         // the stream runs its work
  active,       // the stream is being captured into a graph
  invalidated,  // a capture failed and has not ended yet
  unknown,      // the runtime could not say (an error, e.g. the legacy stream would join a
                // capture of a blocking stream): callers treat it as captured
};

struct CaptureInfo {
  CaptureState state = CaptureState::none;
  unsigned long long id = 0;  // unique per capture while state is active, else 0
};

// cudaStreamGetCaptureInfo for `stream` (null and cudaStreamLegacy name the current
// device's legacy stream). Never throws.
CaptureInfo capture_info(cudaStream_t stream) noexcept;

// True unless the stream certainly runs its work (state none).
inline bool may_be_capturing(cudaStream_t stream) noexcept {
  return capture_info(stream).state != CaptureState::none;
}

}  // namespace vram::cuda
