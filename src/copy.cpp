#include "vram/copy.hpp"

#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#include "vram/cuda/error.hpp"
#include "vram/pinned_staging_pool.hpp"

namespace vram {
namespace {

// Timing events recycled per thread: creating and destroying two events per copy costs
// microseconds that a small page-in feels. An event goes back only after the host saw it
// complete, so a recycled event is never still pending.
constexpr std::size_t kMaxCachedEvents = 16;
thread_local std::vector<cuda::Event> tl_event_cache;

cuda::Event take_timing_event() {
  if (!tl_event_cache.empty()) {
    cuda::Event event = std::move(tl_event_cache.back());
    tl_event_cache.pop_back();
    return event;
  }
  return cuda::Event(cuda::Event::Timing::enabled);
}

void recycle_timing_event(cuda::Event& event) noexcept {
  if (event.get() == nullptr || tl_event_cache.size() >= kMaxCachedEvents) return;
  try {
    tl_event_cache.push_back(std::move(event));
  } catch (...) {  // no room: the event is simply destroyed
  }
}

}  // namespace

bool CopyCompleted::covers_range_in(const void* begin, std::size_t size) const noexcept {
  const auto first = reinterpret_cast<std::uintptr_t>(begin);
  const auto copied = reinterpret_cast<std::uintptr_t>(source_);
  return source_ != nullptr && copied >= first && copied - first <= size &&
         bytes_ <= size - (copied - first);
}

PendingCopy copy_to_device_async(void* device_destination, const void* host_source,
                                 std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) {
    throw InvalidArgument("vram::copy_to_device: zero bytes. Fix: skip empty copies.");
  }
  if (device_destination == nullptr || host_source == nullptr) {
    throw InvalidArgument("vram::copy_to_device: null destination or source.");
  }
  cuda::Event start = take_timing_event();
  cuda::Event end = take_timing_event();
  start.record(stream);
  cuda::check(
      cudaMemcpyAsync(device_destination, host_source, bytes, cudaMemcpyHostToDevice, stream),
      "cudaMemcpyAsync(HostToDevice)");
  end.record(stream);
  return PendingCopy(host_source, bytes, std::move(start), std::move(end));
}

PendingCopy copy_to_device_async(void* device_destination, const PooledStaging& source,
                                 cudaStream_t stream) {
  return copy_to_device_async(device_destination, source.data(), source.len(), stream);
}

CopyResult copy_to_device(void* device_destination, const void* host_source, std::size_t bytes,
                          cudaStream_t stream) {
  return copy_to_device_async(device_destination, host_source, bytes, stream).wait_timed();
}

CopyResult copy_to_device(void* device_destination, const PooledStaging& source,
                          cudaStream_t stream) {
  return copy_to_device(device_destination, source.data(), source.len(), stream);
}

PendingCopy::~PendingCopy() {
  if (end_.get() == nullptr) return;  // moved from
  if (!waited_) {
    try {
      end_.wait();  // the source must not be reused or freed while the DMA reads it
    } catch (const std::exception& error) {
      std::fprintf(stderr, "vram::PendingCopy: waiting for an abandoned copy failed: %s\n",
                   error.what());
      return;  // the events may still be pending: not recycled
    }
  }
  recycle_timing_event(start_);
  recycle_timing_event(end_);
}

bool PendingCopy::ready() const { return waited_ || end_.ready(); }

CopyCompleted PendingCopy::wait() && {
  end_.wait();  // host-observed completion: only now may a witness exist
  waited_ = true;
  return CopyCompleted(source_, bytes_);
}

CopyResult PendingCopy::wait_timed() && {
  CopyCompleted completed = std::move(*this).wait();
  return CopyResult{std::move(completed), elapsed_ms()};
}

float PendingCopy::elapsed_ms() const { return cuda::Event::elapsed_ms(start_, end_); }

}  // namespace vram
