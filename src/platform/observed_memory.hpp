// src/platform/observed_memory.hpp: an upstream and virtual memory that tell a
// ReserveObserver (vram/reserve_observer.hpp) of each unit of memory they hand out and,
// before it goes, of its return. What DevicePool builds when Options::observer is set.
//
// Rules:
// - reserved() after the wrapped call succeeded; giving_back() before the wrapped
//   deallocation or unmap, so an observer sees the memory still valid.
// - Everything else (alignment, kind, name, available bytes, reserve/unreserve of address
//   space) forwards unchanged: address space alone is no memory and is not told.
// - ObservedCudaVirtualMemory is a CudaVirtualMemory, so code that asks for one (the sleep
//   tags' device) still finds it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "vram/reserve_observer.hpp"
#include "vram/upstream.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::detail {

class ObservedUpstream final : public Upstream {
 public:
  ObservedUpstream(std::shared_ptr<Upstream> inner, std::shared_ptr<ReserveObserver> observer);
  void* allocate(std::size_t bytes) override;
  void deallocate(void* block, std::size_t bytes) noexcept override;
  MemoryKind kind() const noexcept override { return inner_->kind(); }
  std::string_view name() const noexcept override { return inner_->name(); }
  std::size_t alignment() const noexcept override { return inner_->alignment(); }
  std::size_t available_bytes() const noexcept override { return inner_->available_bytes(); }

  const std::shared_ptr<Upstream>& inner() const noexcept { return inner_; }
  const std::shared_ptr<ReserveObserver>& observer() const noexcept { return observer_; }

 private:
  std::shared_ptr<Upstream> inner_;
  std::shared_ptr<ReserveObserver> observer_;
};

// Any VirtualMemory (the host emulation over a host upstream).
class ObservedVirtualMemory final : public VirtualMemory {
 public:
  ObservedVirtualMemory(std::shared_ptr<VirtualMemory> inner,
                        std::shared_ptr<ReserveObserver> observer);
  std::size_t granularity() const noexcept override { return inner_->granularity(); }
  char* reserve(std::size_t bytes) override { return inner_->reserve(bytes); }
  void unreserve(char* base, std::size_t bytes) noexcept override {
    inner_->unreserve(base, bytes);
  }
  std::uint64_t map(char* address, std::size_t bytes) override;
  void unmap(char* address, std::size_t bytes, std::uint64_t handle) noexcept override;
  std::size_t available_bytes() const noexcept override { return inner_->available_bytes(); }

 private:
  std::shared_ptr<VirtualMemory> inner_;
  std::shared_ptr<ReserveObserver> observer_;
};

// CUDA virtual memory management on `device`, observed.
class ObservedCudaVirtualMemory final : public CudaVirtualMemory {
 public:
  ObservedCudaVirtualMemory(int device, std::shared_ptr<ReserveObserver> observer);
  std::uint64_t map(char* address, std::size_t bytes) override;
  void unmap(char* address, std::size_t bytes, std::uint64_t handle) noexcept override;

 private:
  std::shared_ptr<ReserveObserver> observer_;
};

// The upstream an ObservedUpstream wraps (any other upstream: itself).
const Upstream& underlying(const Upstream& upstream) noexcept;
Upstream& underlying(Upstream& upstream) noexcept;
// Its observer, null for any other upstream.
std::shared_ptr<ReserveObserver> observer_of(const Upstream& upstream) noexcept;

}  // namespace vram::detail
