// The copiers of sleep and wake (sleep_copier.hpp): memcpy over the host emulation, queued
// copies and an end event over a device.
#include "sleep_copier.hpp"

#include <atomic>
#include <cstring>

#include "cuda/memory.hpp"
#include "vram/cuda/device.hpp"

namespace vram::detail {
namespace {

std::atomic<std::uint64_t> next_batch{1};

class HostSleepCopier final : public SleepCopier {
 public:
  cudaStream_t stream() const noexcept override { return nullptr; }

 private:
  void queue_to_host(void* host, const void* device, std::size_t bytes) override {
    std::memcpy(host, device, bytes);
  }
  void queue_to_device(void* device, const void* host, std::size_t bytes) override {
    std::memcpy(device, host, bytes);
  }
  void mark_end() override {}
  void wait_for_copies() override {}  // each memcpy returned complete
};

// The device is current for the copier's life (its event is made on it; a sleep's later
// copiers are destroyed before its first, whose guard set the device).
class CudaSleepCopier final : public SleepCopier {
 public:
  CudaSleepCopier(int device, cudaStream_t stream, std::optional<cuda::Stream>& own_stream)
      : guard_(device) {
    if (stream == nullptr) {
      cuda::synchronize_current_device();
      if (!own_stream) own_stream.emplace();
      stream = own_stream->get();
    }
    stream_ = stream;
  }
  cudaStream_t stream() const noexcept override { return stream_; }

 private:
  void queue_to_host(void* host, const void* device, std::size_t bytes) override {
    cuda::copy_to_host_async(host, device, bytes, stream_, "cudaMemcpyAsync (sleep: to host)");
  }
  void queue_to_device(void* device, const void* host, std::size_t bytes) override {
    cuda::copy_to_device_async(device, host, bytes, stream_, "cudaMemcpyAsync (wake: to device)");
  }
  void mark_end() override { end_.record(stream_); }
  void wait_for_copies() override { end_.wait(); }
  cuda::DeviceGuard guard_;
  cudaStream_t stream_ = nullptr;
  cuda::Event end_;
};

}  // namespace

SleepCopier::SleepCopier() : batch_(next_batch.fetch_add(1, std::memory_order_relaxed)) {}

std::unique_ptr<SleepCopier> SleepCopier::for_host() { return std::make_unique<HostSleepCopier>(); }

std::unique_ptr<SleepCopier> SleepCopier::for_device(int device, cudaStream_t stream,
                                                     std::optional<cuda::Stream>& own_stream) {
  return std::make_unique<CudaSleepCopier>(device, stream, own_stream);
}

}  // namespace vram::detail
