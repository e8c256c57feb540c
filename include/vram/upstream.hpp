// vram/upstream.hpp: where pools get raw memory from.
//
// An Upstream hands out and takes back raw blocks; pools call it only on a miss or when
// they give memory back, never on their warm path. The same pool logic runs over host
// memory (CI, no GPU) and over device memory (production), which is how the pool
// contract tests run everywhere.
//
//   auto device = std::make_shared<vram::DeviceMemoryUpstream>(0);   // cudaMalloc on GPU 0
//   auto host = std::make_shared<vram::HostMemoryUpstream>(1_GiB);   // emulated capacity
//   vram::DevicePool pool(device);
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace vram {

enum class MemoryKind { device, host, pinned_host };

class Upstream {
 public:
  Upstream() = default;
  Upstream(const Upstream&) = delete;
  Upstream& operator=(const Upstream&) = delete;
  virtual ~Upstream() = default;
  // At least `bytes` (> 0) bytes aligned to alignment(). Throws vram::OutOfMemory when the
  // memory is exhausted and vram::CudaError for any other failure.
  virtual void* allocate(std::size_t bytes) = 0;
  // Takes back a block from allocate() with the same byte count. Never throws; tolerates a
  // CUDA runtime that is shutting down.
  virtual void deallocate(void* block, std::size_t bytes) noexcept = 0;
  virtual MemoryKind kind() const noexcept = 0;
  virtual std::string_view name() const noexcept = 0;
  virtual std::size_t alignment() const noexcept { return 256; }
  // Bytes allocate() could still supply, as far as the upstream knows (SIZE_MAX: unknown).
  // A hint for sizing growth, never a promise: another user may take them first.
  virtual std::size_t available_bytes() const noexcept { return SIZE_MAX; }
};

namespace detail {
// upstream.allocate(bytes), with a null result (an upstream breaking its contract) as
// vram::OutOfMemory: the pools never carve blocks out of address 0.
void* allocate_non_null(Upstream& upstream, std::size_t bytes);
}  // namespace detail

// cudaMalloc / cudaFree on one device (the current device at construction by default).
class DeviceMemoryUpstream final : public Upstream {
 public:
  DeviceMemoryUpstream();
  explicit DeviceMemoryUpstream(int device);
  void* allocate(std::size_t bytes) override;
  void deallocate(void* block, std::size_t bytes) noexcept override;
  MemoryKind kind() const noexcept override { return MemoryKind::device; }
  std::string_view name() const noexcept override { return "cudaMalloc"; }
  int device() const noexcept { return device_; }

 private:
  int device_;
};

// Plain host memory (256-byte aligned). `capacity_bytes` emulates a device of that size:
// an allocation that would exceed it throws vram::OutOfMemory, like a full GPU.
class HostMemoryUpstream final : public Upstream {
 public:
  explicit HostMemoryUpstream(std::size_t capacity_bytes = SIZE_MAX)
      : capacity_bytes_(capacity_bytes) {}
  void* allocate(std::size_t bytes) override;
  void deallocate(void* block, std::size_t bytes) noexcept override;
  MemoryKind kind() const noexcept override { return MemoryKind::host; }
  std::string_view name() const noexcept override { return "host"; }
  std::size_t live_bytes() const noexcept { return live_bytes_.load(std::memory_order_relaxed); }
  std::size_t available_bytes() const noexcept override {
    const std::size_t live = live_bytes();
    return live < capacity_bytes_ ? capacity_bytes_ - live : 0;
  }

 private:
  std::size_t capacity_bytes_;
  std::atomic<std::size_t> live_bytes_{0};
};

}  // namespace vram
