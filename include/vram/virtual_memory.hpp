// vram/virtual_memory.hpp: reserve an address range once, back it with physical granules
// where blocks live, take the granules back where nothing lives.
//
// DevicePool's large tier can run over one such range instead of separate segments
// (Options::large_tier.memory): free ranges then merge across what would have been segment
// boundaries, and the memory held is the granules mapped, not the segments allocated.
//
//   CudaVirtualMemory  cuMemAddressReserve + cuMemCreate / cuMemMap / cuMemSetAccess per
//                      span of granules, cuMemUnmap + cuMemRelease (driver entry points
//                      resolved at run time, src/cuda/virtual_memory_api.hpp; no libcuda
//                      link).
//   HostVirtualMemory  the emulation: mmap(PROT_NONE) reserves, mprotect maps; each mapped
//                      granule is charged to an Upstream (capacity, fault injection and
//                      accounting as for a real device), so the memory figures can be
//                      checked without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "vram/upstream.hpp"

namespace vram {

class VirtualMemory {
 public:
  VirtualMemory() = default;
  VirtualMemory(const VirtualMemory&) = delete;
  VirtualMemory& operator=(const VirtualMemory&) = delete;
  virtual ~VirtualMemory() = default;
  // Mapping unit (2 MiB).
  virtual std::size_t granularity() const noexcept = 0;
  // The address range (bytes: a multiple of granularity()). Throws on failure.
  virtual char* reserve(std::size_t bytes) = 0;
  virtual void unreserve(char* base, std::size_t bytes) noexcept = 0;
  // Backs `bytes` (whole granules) at `address` (granule-aligned) with one physical
  // allocation usable from the device; returns the handle unmap() takes, which releases
  // exactly that span (a mapping is taken back whole). Throws vram::OutOfMemory when no
  // physical memory is left.
  virtual std::uint64_t map(char* address, std::size_t bytes) = 0;
  virtual void unmap(char* address, std::size_t bytes, std::uint64_t handle) noexcept = 0;
  // Physical bytes map() could still obtain, as far as is known (SIZE_MAX: unknown): the
  // tier maps shorter runs as it nears the end of physical memory (a run goes back only
  // whole, so a long run that a live block pins would hold memory a later map needs).
  virtual std::size_t available_bytes() const noexcept { return SIZE_MAX; }
};

// The host emulation over an Upstream that supplies (and counts) the "physical" granules.
class HostVirtualMemory final : public VirtualMemory {
 public:
  explicit HostVirtualMemory(std::shared_ptr<Upstream> physical,
                             std::size_t granularity = std::size_t{2} << 20);
  ~HostVirtualMemory() override;
  std::size_t granularity() const noexcept override { return granularity_; }
  char* reserve(std::size_t bytes) override;
  void unreserve(char* base, std::size_t bytes) noexcept override;
  std::uint64_t map(char* address, std::size_t bytes) override;
  void unmap(char* address, std::size_t bytes, std::uint64_t handle) noexcept override;
  std::size_t available_bytes() const noexcept override { return physical_->available_bytes(); }

 private:
  std::shared_ptr<Upstream> physical_;
  std::size_t granularity_;
};

// CUDA virtual memory management on `device`. Not final: a DevicePool with an observer
// maps through a subclass that tells it of each map and unmap.
class CudaVirtualMemory : public VirtualMemory {
 public:
  explicit CudaVirtualMemory(int device);
  ~CudaVirtualMemory() override;
  std::size_t granularity() const noexcept override { return granularity_; }
  char* reserve(std::size_t bytes) override;
  void unreserve(char* base, std::size_t bytes) noexcept override;
  std::uint64_t map(char* address, std::size_t bytes) override;
  void unmap(char* address, std::size_t bytes, std::uint64_t handle) noexcept override;
  std::size_t available_bytes() const noexcept override;  // cudaMemGetInfo's free bytes
  int device() const noexcept { return device_; }
  // map() and unmap() in halves, for a caller that keeps a physical allocation across maps
  // (the driver benchmark times a remap): create() makes one of `bytes` (whole granules);
  // map_created() maps it at `address` with read-write access for the device (on failure
  // nothing stays mapped and the allocation stays the caller's); unmap_only() takes the
  // mapping back and keeps the allocation; release() frees it. Errors as map()'s.
  std::uint64_t create(std::size_t bytes);
  void map_created(char* address, std::size_t bytes, std::uint64_t handle);
  void unmap_only(char* address, std::size_t bytes) noexcept;
  void release(std::uint64_t handle) noexcept;
  // True when the driver and device support it.
  static bool supported(int device) noexcept;

 private:
  int device_;
  std::size_t granularity_ = std::size_t{2} << 20;
};

}  // namespace vram
