#include "vram/copy.hpp"

#include <cstdint>
#include <cstdio>
#include <exception>

#include "vram/cuda/error.hpp"
#include "vram/pinned_staging_pool.hpp"

namespace vram {

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
  cuda::Event start(cuda::Event::Timing::enabled);
  cuda::Event end(cuda::Event::Timing::enabled);
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
  if (waited_ || end_.get() == nullptr) return;
  try {
    end_.wait();  // the source must not be reused or freed while the DMA reads it
  } catch (const std::exception& error) {
    std::fprintf(stderr, "vram::PendingCopy: waiting for an abandoned copy failed: %s\n",
                 error.what());
  }
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
