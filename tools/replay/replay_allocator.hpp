// The allocators `vram replay` drives, behind one small interface.
//
// Stream contract (what the replay driver relies on)
//   stream_ordered() == true: the allocator itself never hands a block freed on stream S
//   to another stream before S's work at the free has completed (cudaMallocAsync, CUB,
//   PyTorch's caching allocator, cudaMalloc/cudaFree). The driver calls it in trace order.
//   stream_ordered() == false: the allocator ignores streams (today's DevicePool). On a
//   trace with more than one stream the driver holds every free back until S's work at
//   the free has completed (device: an event recorded on S; host-only: an emulated
//   completion `stream_lag` events later) and only then deallocates, so no other stream
//   can get the block early. On a one-stream trace frees go through at once.
//
// In host-only replay there are no CUDA streams: ReplayStream::handle is null and
// `index` is the only identity of a stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace vram::replay {

struct ReplayStream {
  std::uint32_t index = 0;        // dense stream index of the trace
  cudaStream_t handle = nullptr;  // a stream created for the replay; null in host-only
};

// Where an allocator runs: on `device_id`, or (host-only) over host memory that emulates a
// device of `capacity_bytes`.
struct ReplayContext {
  bool device = false;
  int device_id = 0;
  std::size_t capacity_bytes = SIZE_MAX;
};

class ReplayAllocator {
 public:
  virtual ~ReplayAllocator() = default;
  // Throws (std::bad_alloc, vram::OutOfMemory, vram::CudaError) when it cannot allocate.
  virtual void* allocate(std::size_t bytes, ReplayStream stream) = 0;
  virtual void deallocate(void* block, std::size_t bytes, ReplayStream stream) = 0;
  virtual bool stream_ordered() const = 0;
  // Waits for device work the allocator queued (end of the timed replay).
  virtual void synchronize() {}
  // High-water mark of the bytes it held from the driver (or the emulated device).
  virtual std::size_t peak_reserved_bytes() = 0;
  // The bytes it holds now (the memory picture, `vram replay --svg`).
  virtual std::size_t reserved_bytes() = 0;
  // Allocations it made from the driver; empty when the allocator cannot say.
  virtual std::optional<std::uint64_t> upstream_allocations() = 0;
  // Device-wide synchronizes it made (a DevicePool's quiesces); empty when it cannot say.
  virtual std::optional<std::uint64_t> device_synchronizes() { return std::nullopt; }
};

struct AllocatorSpec {
  std::string name;
  bool needs_gpu = true;  // false: also runs host-only over an emulated device
  std::string note;       // how peak reserved / upstream allocations are measured
  std::function<std::unique_ptr<ReplayAllocator>(const ReplayContext&)> make;
};

// vram DevicePool with default options (device_pool_adapter.cpp): on a device with virtual
// memory management its large tier runs over virtual memory (LargeTierMemory::automatic);
// host-only the replay mirrors that with the host emulation.
AllocatorSpec device_pool_spec();
// vram DevicePool over cudaMalloc segments (LargeTierMemory::segments: memory shareable by
// CUDA IPC).
AllocatorSpec device_pool_segments_spec();
// Segments, splitting every wholly free segment (large_tier.max_segment_waste_bytes = SIZE_MAX).
AllocatorSpec device_pool_split_every_segment_spec();
// cudaMallocAsync on a private pool, CUB CachingDeviceAllocator, plain cudaMalloc (peers.cpp).
std::vector<AllocatorSpec> cuda_peer_specs();
// PyTorch's CUDACachingAllocator, when built with VRAM_WITH_TORCH (torch_peer.cpp).
std::vector<AllocatorSpec> torch_peer_specs();

// Every allocator of a replay run, ours first.
std::vector<AllocatorSpec> all_replay_allocators();

}  // namespace vram::replay
