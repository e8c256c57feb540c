#include "vram/stream_fence.hpp"

#include <optional>

#include "vram/cuda/device.hpp"
#include "vram/cuda/error.hpp"

namespace vram {
namespace {

// The calling thread in relaxed stream-capture mode while the fence calls CUDA: in global
// or thread-local mode (PyTorch's graphs capture in global mode) an event query or
// synchronize on this or, in global mode, another thread would invalidate the capture.
// PyTorch's caching allocator does the same around its event calls.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() noexcept {
    if (cudaThreadExchangeStreamCaptureMode(&mode_) != cudaSuccess) {
      (void)cudaGetLastError();
      restore_ = false;
    }
  }
  ~RelaxedCaptureMode() {
    if (restore_ && cudaThreadExchangeStreamCaptureMode(&mode_) != cudaSuccess) {
      (void)cudaGetLastError();
    }
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool restore_ = true;
};

}  // namespace

CudaEventFence::~CudaEventFence() {
  for (cudaEvent_t event : events_) {
    if (cudaEventDestroy(event) != cudaSuccess) (void)cudaGetLastError();
  }
}

std::uint64_t CudaEventFence::record(cudaStream_t stream) {
  // A stream being captured into a CUDA graph runs nothing yet: an event recorded on it
  // becomes a node of the graph, and querying it fails (cudaErrorCapturedEvent), which must
  // never read as "completed". The stream is not fenced: its frees stay its own.
  // Any error counts as capturing: cudaErrorStreamCaptureImplicit, for one, says that the
  // legacy default stream would join a capture of a blocking stream. A capture that begins
  // between this check and the record leaves the marker never completed: the ranges stay
  // pending until trim() or an out-of-memory retry synchronizes the device.
  const RelaxedCaptureMode relaxed;
  // The null and legacy handles name the legacy stream of the current device: the fence's
  // device is made current for them (a thread with another device current would otherwise
  // record on that device's stream, and fail).
  std::optional<cuda::DeviceGuard> on_device;
  if (stream == nullptr || stream == cudaStreamLegacy) on_device.emplace(device_);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t asked = cudaStreamIsCapturing(stream, &capture);
  if (asked != cudaSuccess) (void)cudaGetLastError();
  if (asked != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    cuda::check(cudaErrorStreamCaptureUnsupported, "cudaEventRecord on a stream being captured");
  }
  std::lock_guard lock(mutex_);
  std::uint64_t marker = 0;
  if (!free_.empty()) {
    marker = free_.back();
    free_.pop_back();
  } else {
    cuda::DeviceGuard guard(device_);
    cudaEvent_t event = nullptr;
    cuda::check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                "cudaEventCreateWithFlags");
    try {
      events_.push_back(event);
    } catch (...) {
      (void)cudaEventDestroy(event);
      throw;
    }
    marker = events_.size();
  }
  const cudaError_t status = cudaEventRecord(events_[marker - 1], stream);
  if (status != cudaSuccess) {
    free_.push_back(marker);
    cuda::check(status, "cudaEventRecord");
  }
  return marker;
}

bool CudaEventFence::completed(std::uint64_t marker) noexcept {
  cudaEvent_t event = nullptr;
  {
    std::lock_guard lock(mutex_);
    event = events_[marker - 1];
  }
  const RelaxedCaptureMode relaxed;
  const cudaError_t status = cudaEventQuery(event);
  if (status == cudaSuccess) return true;
  (void)cudaGetLastError();
  // cudaErrorNotReady: still running. A capture error (the event belongs to a graph being
  // captured, or the query is not allowed during a capture): unknown, so not completed. Any
  // other error (driver shutting down): nothing will run any more, so the work is as
  // complete as it will ever be.
  switch (status) {
    case cudaErrorNotReady:
    case cudaErrorCapturedEvent:
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
    case cudaErrorStreamCaptureImplicit:
    case cudaErrorStreamCaptureWrongThread:
      return false;
    default:
      return true;
  }
}

void CudaEventFence::wait(std::uint64_t marker) noexcept {
  cudaEvent_t event = nullptr;
  {
    std::lock_guard lock(mutex_);
    event = events_[marker - 1];
  }
  const RelaxedCaptureMode relaxed;
  if (cudaEventSynchronize(event) != cudaSuccess) (void)cudaGetLastError();
}

void CudaEventFence::release(std::uint64_t marker) noexcept {
  std::lock_guard lock(mutex_);
  try {
    free_.push_back(marker);
  } catch (...) {  // the event stays allocated, unused, until the fence dies
  }
}

void CudaEventFence::quiesce() noexcept {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (previous != device_ && cudaSetDevice(device_) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();
  if (previous >= 0 && previous != device_) (void)cudaSetDevice(previous);
}

std::size_t CudaEventFence::events_created() const {
  std::lock_guard lock(mutex_);
  return events_.size();
}

}  // namespace vram
