#include "vram/upstream.hpp"

#include <cstdlib>
#include <string>

#include "cuda/memory.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/error.hpp"

namespace vram {

void* detail::allocate_non_null(Upstream& upstream, std::size_t bytes) {
  void* block = upstream.allocate(bytes);
  if (block == nullptr) {
    throw OutOfMemory(bytes, 0, 0,
                      "the upstream '" + std::string(upstream.name()) +
                          "' returned null without throwing. Fix: an Upstream reports failure "
                          "by throwing (vram::OutOfMemory), never by returning null");
  }
  return block;
}

DeviceMemoryUpstream::DeviceMemoryUpstream() : device_(cuda::Device::current()) {}

DeviceMemoryUpstream::DeviceMemoryUpstream(int device) : device_(device) {
  cuda::Device::require_present(device, "vram::DeviceMemoryUpstream");
}

void* DeviceMemoryUpstream::allocate(std::size_t bytes) {
  return cuda::allocate_device(bytes, device_);
}

void DeviceMemoryUpstream::deallocate(void* block, std::size_t /*bytes*/) noexcept {
  cuda::free_device(block);
}

void* HostMemoryUpstream::allocate(std::size_t bytes) {
  const std::size_t rounded = (bytes + 255) & ~std::size_t{255};
  if (rounded < bytes) throw OutOfMemory(bytes, 0, 0, "host upstream: size overflows");
  std::size_t live = live_bytes_.load(std::memory_order_relaxed);
  do {
    if (rounded > capacity_bytes_ || live > capacity_bytes_ - rounded) {
      throw OutOfMemory(bytes, 0, 0,
                        "host upstream capacity of " + std::to_string(capacity_bytes_) +
                            " bytes reached (" + std::to_string(live) + " live)");
    }
  } while (!live_bytes_.compare_exchange_weak(live, live + rounded, std::memory_order_relaxed));
  void* block = std::aligned_alloc(256, rounded);
  if (block == nullptr) {
    live_bytes_.fetch_sub(rounded, std::memory_order_relaxed);
    throw OutOfMemory(bytes, 0, 0, "aligned_alloc returned null");
  }
  return block;
}

void HostMemoryUpstream::deallocate(void* block, std::size_t bytes) noexcept {
  if (block == nullptr) return;
  live_bytes_.fetch_sub((bytes + 255) & ~std::size_t{255}, std::memory_order_relaxed);
  std::free(block);
}

}  // namespace vram
