// vram DevicePool in `vram replay`.
// On a device it is driven through its stream-ordered API (allocate_async/deallocate_async
// with the replay's CUDA streams): a block freed on S is reused at once on S and by another
// stream only after S's work at the free has completed (the pool's CUDA event fence), so
// the driver calls it in trace order. Host-only the same API runs with a stand-in handle
// per trace stream; the pool's host fence completes at once, so the driver's emulated
// completion (`stream_lag`) holds cross-stream frees back instead (stream_ordered() ==
// false there), and its upstream hands out addresses only (address_only_upstream.hpp): the
// figures are the same in every run and process.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "replay/address_only_upstream.hpp"
#include "replay/replay_allocator.hpp"
#include "vram/device_pool.hpp"
#include "vram/upstream.hpp"

namespace vram::replay {
namespace {

// Host-only, the default large tier (LargeTierMemory::automatic: virtual memory over a
// device upstream that supports it, as on the H200) becomes the host emulation of virtual
// memory, so the memory figures are the device's; over a host upstream automatic would
// mean segments.
DevicePool::Options mirror_device(DevicePool::Options options, const ReplayContext& context) {
  if (!context.device && options.large_tier.memory == LargeTierMemory::automatic) {
    options.large_tier.memory = LargeTierMemory::virtual_memory;
  }
  return options;
}

class DevicePoolAdapter final : public ReplayAllocator {
 public:
  DevicePoolAdapter(const ReplayContext& context, const DevicePool::Options& options)
      : pool_(context.device ? std::shared_ptr<Upstream>(
                                   std::make_shared<DeviceMemoryUpstream>(context.device_id))
                             : std::shared_ptr<Upstream>(
                                   std::make_shared<AddressOnlyUpstream>(context.capacity_bytes)),
              mirror_device(options, context)),
        device_(context.device) {}
  void* allocate(std::size_t bytes, ReplayStream stream) override {
    return pool_.allocate_async(bytes, handle(stream));
  }
  void deallocate(void* block, std::size_t bytes, ReplayStream stream) override {
    pool_.deallocate_async(block, bytes, handle(stream));
  }
  bool stream_ordered() const override { return device_; }
  // Host-only there are no CUDA streams: a stand-in handle per trace stream, so the pool
  // runs the same stream-ordered code as on a device (its host fence completes at once
  // and the handle is only compared, never used). The handles avoid the special ones (the
  // null stream, cudaStreamLegacy, cudaStreamPerThread), which the pool treats otherwise:
  // each trace stream is a caller's stream, as on a device.
  cudaStream_t handle(ReplayStream stream) const noexcept {
    return device_ ? stream.handle
                   : reinterpret_cast<cudaStream_t>((static_cast<std::uintptr_t>(stream.index) + 1)
                                                    << 8);
  }
  std::size_t peak_reserved_bytes() override { return pool_.stats().peak_bytes_reserved; }
  std::size_t reserved_bytes() override { return pool_.stats().bytes_reserved; }
  std::optional<std::uint64_t> upstream_allocations() override {
    return pool_.stats().upstream_allocations;
  }
  std::optional<std::uint64_t> device_synchronizes() override { return pool_.stats().quiesces; }

 private:
  DevicePool pool_;
  bool device_;
};

// A DevicePool configuration as a replay allocator (runs host-only too).
AllocatorSpec pool_spec(std::string name, std::string note, DevicePool::Options options) {
  AllocatorSpec spec;
  spec.name = std::move(name);
  spec.needs_gpu = false;
  spec.note = std::move(note);
  spec.make = [options](const ReplayContext& context) {
    return std::make_unique<DevicePoolAdapter>(context, options);
  };
  return spec;
}

}  // namespace

AllocatorSpec device_pool_spec() {
  return pool_spec("vram DevicePool",
                   "defaults (large tier over virtual memory where the device supports it: "
                   "upstream allocations are maps of runs of 2 MiB granules), stream-ordered "
                   "API on a device; peak reserved and upstream allocations from "
                   "DevicePool::stats()",
                   DevicePool::Options{});
}

AllocatorSpec device_pool_segments_spec() {
  DevicePool::Options options;
  options.large_tier.memory = LargeTierMemory::segments;
  return pool_spec("vram DevicePool (segments)",
                   "large_tier.memory = segments: cudaMalloc segments (memory shareable by CUDA "
                   "IPC), best fit within each",
                   options);
}

AllocatorSpec device_pool_split_every_segment_spec() {
  DevicePool::Options options;
  options.large_tier.memory = LargeTierMemory::segments;
  options.large_tier.max_segment_waste_bytes = SIZE_MAX;
  return pool_spec(
      "vram DevicePool (split every segment)",
      "segments with large_tier.max_segment_waste_bytes = SIZE_MAX: a wholly free segment is "
      "split for any request that fits (fewer upstream calls, more reserved)",
      options);
}

}  // namespace vram::replay
