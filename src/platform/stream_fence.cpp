#include "vram/stream_fence.hpp"

#include <optional>

#include "cuda/capture.hpp"
#include "cuda/event_pool.hpp"
#include "cuda/memory.hpp"
#include "cuda/stream_identity.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/error.hpp"

namespace vram {
namespace {

// A marker is the handle of the event recorded for it: it names the event until
// release() gives the event back to the pool, after which the number may come back.
std::uint64_t marker_of(cudaEvent_t event) noexcept {
  return reinterpret_cast<std::uintptr_t>(event);
}
cudaEvent_t event_of(std::uint64_t marker) noexcept {
  return reinterpret_cast<cudaEvent_t>(static_cast<std::uintptr_t>(marker));
}

}  // namespace

CudaEventFence::CudaEventFence(int device)
    : device_(device), events_(std::make_unique<cuda::EventPool>(device)) {}

CudaEventFence::~CudaEventFence() = default;

std::uint64_t CudaEventFence::record(cudaStream_t stream) {
  // A stream being captured into a CUDA graph runs nothing yet: an event recorded on it
  // becomes a node of the graph, and querying it fails (cudaErrorCapturedEvent), which must
  // never read as "completed". The stream gets no marker: its frees stay its own.
  // A stream whose capture state is unknown counts as captured (cudaErrorStreamCaptureImplicit,
  // for one, says that the legacy default stream would join a capture of a blocking stream).
  // A capture that begins between this check and the record leaves the marker never
  // completed: the ranges stay pending until trim() or an out-of-memory retry synchronizes
  // the device.
  const cuda::RelaxedCaptureMode relaxed;
  // The null and legacy handles name the legacy stream of the current device: the fence's
  // device is made current for them (a thread with another device current would otherwise
  // record on that device's stream, and fail).
  std::optional<cuda::DeviceGuard> on_device;
  if (stream == nullptr || stream == cudaStreamLegacy) on_device.emplace(device_);
  if (cuda::may_be_capturing(stream)) {
    cuda::check(cudaErrorStreamCaptureUnsupported, "cudaEventRecord on a stream being captured");
  }
  cudaEvent_t event = events_->take();
  try {
    cuda::record(event, stream, "cudaEventRecord");
  } catch (...) {
    events_->give_back(event);
    throw;
  }
  return marker_of(event);
}

bool CudaEventFence::completed(std::uint64_t marker) noexcept {
  // Pending while the work runs and while the event belongs to a graph being captured;
  // complete on any other error (see cuda/event_pool.hpp).
  return cuda::query(event_of(marker)) == cuda::EventState::complete;
}

void CudaEventFence::wait(std::uint64_t marker) noexcept { cuda::synchronize(event_of(marker)); }

void CudaEventFence::release(std::uint64_t marker) noexcept {
  events_->give_back(event_of(marker));
}

void CudaEventFence::quiesce() noexcept { (void)try_quiesce(); }

bool CudaEventFence::try_quiesce() noexcept {
  // Relaxed, as the event calls: another thread's capture in global mode neither refuses
  // the synchronize nor is invalidated by it (work being captured is not queued yet).
  const cuda::RelaxedCaptureMode relaxed;
  return cuda::synchronize_device(device_);
}

std::uint64_t CudaEventFence::stream_id(cudaStream_t stream) noexcept {
  return cuda::stream_id(stream);
}

std::uint64_t CudaEventFence::capture_of(cudaStream_t stream) noexcept {
  const cuda::CaptureInfo info = cuda::capture_info(stream);
  return info.state == cuda::CaptureState::active ? info.id : 0;
}

}  // namespace vram
