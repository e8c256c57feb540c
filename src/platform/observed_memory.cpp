#include "observed_memory.hpp"

#include <utility>

#include "vram/cuda/error.hpp"

namespace vram::detail {

namespace {

ReservedSpan span_of(const void* address, std::size_t bytes, bool virtual_memory) noexcept {
  return {reinterpret_cast<std::uintptr_t>(address), bytes, virtual_memory};
}

}  // namespace

ObservedUpstream::ObservedUpstream(std::shared_ptr<Upstream> inner,
                                   std::shared_ptr<ReserveObserver> observer)
    : inner_(std::move(inner)), observer_(std::move(observer)) {
  if (!inner_) throw InvalidArgument("vram::DevicePool: the upstream is null");
}

void* ObservedUpstream::allocate(std::size_t bytes) {
  void* block = inner_->allocate(bytes);
  if (block != nullptr) observer_->reserved(span_of(block, bytes, false));
  return block;
}

void ObservedUpstream::deallocate(void* block, std::size_t bytes) noexcept {
  if (block != nullptr) observer_->giving_back(span_of(block, bytes, false));
  inner_->deallocate(block, bytes);
}

ObservedVirtualMemory::ObservedVirtualMemory(std::shared_ptr<VirtualMemory> inner,
                                             std::shared_ptr<ReserveObserver> observer)
    : inner_(std::move(inner)), observer_(std::move(observer)) {}

std::uint64_t ObservedVirtualMemory::map(char* address, std::size_t bytes) {
  const std::uint64_t handle = inner_->map(address, bytes);
  observer_->reserved(span_of(address, bytes, true));
  return handle;
}

void ObservedVirtualMemory::unmap(char* address, std::size_t bytes, std::uint64_t handle) noexcept {
  observer_->giving_back(span_of(address, bytes, true));
  inner_->unmap(address, bytes, handle);
}

ObservedCudaVirtualMemory::ObservedCudaVirtualMemory(int device,
                                                     std::shared_ptr<ReserveObserver> observer)
    : CudaVirtualMemory(device), observer_(std::move(observer)) {}

std::uint64_t ObservedCudaVirtualMemory::map(char* address, std::size_t bytes) {
  const std::uint64_t handle = CudaVirtualMemory::map(address, bytes);
  observer_->reserved(span_of(address, bytes, true));
  return handle;
}

void ObservedCudaVirtualMemory::unmap(char* address, std::size_t bytes,
                                      std::uint64_t handle) noexcept {
  observer_->giving_back(span_of(address, bytes, true));
  CudaVirtualMemory::unmap(address, bytes, handle);
}

const Upstream& underlying(const Upstream& upstream) noexcept {
  const auto* observed = dynamic_cast<const ObservedUpstream*>(&upstream);
  return observed != nullptr ? *observed->inner() : upstream;
}

Upstream& underlying(Upstream& upstream) noexcept {
  auto* observed = dynamic_cast<ObservedUpstream*>(&upstream);
  return observed != nullptr ? *observed->inner() : upstream;
}

std::shared_ptr<ReserveObserver> observer_of(const Upstream& upstream) noexcept {
  const auto* observed = dynamic_cast<const ObservedUpstream*>(&upstream);
  return observed != nullptr ? observed->observer() : nullptr;
}

}  // namespace vram::detail
