// DevicePool's construction policy (pool_options.hpp). The CUDA queries it makes go
// through src/cuda/; none of it runs after construction.
#include "pool_options.hpp"

#include <algorithm>
#include <string>

#include "cuda/memory.hpp"
#include "platform/observed_memory.hpp"
#include "tier/segment_tier.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/error.hpp"

namespace vram::detail {
namespace {

// LargeTierMemory::automatic: virtual memory only where it behaves as cudaMalloc memory
// does for the program. Mapped memory is reachable from the devices cuMemSetAccess names
// (this one), and cudaDeviceEnablePeerAccess does not extend that, so where another device
// could read this one's memory through peer access (or the runtime cannot say), segments
// stay the default.
bool virtual_memory_by_default(int device) noexcept {
  return CudaVirtualMemory::supported(device) && !cuda::may_be_peer_accessible(device);
}

// The device a device upstream allocates on: vram's DeviceMemoryUpstream names it; any
// other device upstream is taken to allocate on the current device.
int device_of(const Upstream& upstream) {
  const auto* device_upstream = dynamic_cast<const DeviceMemoryUpstream*>(&underlying(upstream));
  return device_upstream != nullptr ? device_upstream->device() : cuda::Device::current();
}

// CUDA virtual memory on `device`, observed when `observer` is set.
std::shared_ptr<VirtualMemory> cuda_virtual_memory(int device,
                                                   std::shared_ptr<ReserveObserver> observer) {
  if (observer) return std::make_shared<ObservedCudaVirtualMemory>(device, std::move(observer));
  return std::make_shared<CudaVirtualMemory>(device);
}

}  // namespace

std::shared_ptr<Upstream> observed_upstream(std::shared_ptr<Upstream> upstream,
                                            const DevicePoolOptions& options) {
  if (!options.observer || !upstream) return upstream;
  return std::make_shared<ObservedUpstream>(std::move(upstream), options.observer);
}

std::shared_ptr<VirtualMemory> make_virtual_memory(const DevicePoolOptions& options,
                                                   const std::shared_ptr<Upstream>& upstream) {
  if (options.large_tier.memory == LargeTierMemory::segments) return nullptr;
  const bool automatic = options.large_tier.memory == LargeTierMemory::automatic;
  const auto* observed = dynamic_cast<const ObservedUpstream*>(upstream.get());
  const std::shared_ptr<Upstream>& given = observed != nullptr ? observed->inner() : upstream;
  // automatic: only over vram's own device upstream. The granules come from cuMemCreate,
  // not from the upstream, and a custom upstream (a budget, a counter) must not be bypassed.
  if (automatic && dynamic_cast<const DeviceMemoryUpstream*>(given.get()) == nullptr) {
    return nullptr;
  }
  if (given->kind() != MemoryKind::device) {
    // The emulation charges the upstream given, not the observed one: each map is told once.
    auto host = std::make_shared<HostVirtualMemory>(given);
    if (!options.observer) return host;
    return std::make_shared<ObservedVirtualMemory>(std::move(host), options.observer);
  }
  const int device = device_of(*given);
  const bool usable =
      automatic ? virtual_memory_by_default(device) : CudaVirtualMemory::supported(device);
  if (!usable) return nullptr;  // segments instead
  return cuda_virtual_memory(device, options.observer);
}

std::shared_ptr<VirtualMemory> make_tag_virtual_memory(const Upstream& upstream) {
  const auto* device_upstream = dynamic_cast<const DeviceMemoryUpstream*>(&underlying(upstream));
  if (device_upstream == nullptr || !CudaVirtualMemory::supported(device_upstream->device())) {
    return nullptr;
  }
  return cuda_virtual_memory(device_upstream->device(), observer_of(upstream));
}

std::size_t reservation_for(const DevicePoolOptions& options, const Upstream& upstream) {
  if (options.large_tier.virtual_reservation_bytes > kMaxReservationBytes) {
    throw InvalidArgument("vram::DevicePool: large_tier.virtual_reservation_bytes " +
                          std::to_string(options.large_tier.virtual_reservation_bytes) +
                          " is above the 16 TiB of address space a pool can manage. Fix: 0 "
                          "reserves twice the device's memory; a larger range is needed only "
                          "to oversubscribe it.");
  }
  if (options.large_tier.virtual_reservation_bytes != 0)
    return options.large_tier.virtual_reservation_bytes;
  if (upstream.kind() == MemoryKind::device) {
    // The pool's device, not the current one (a pool for device 1 built while device 0 is
    // current).
    if (const auto total = cuda::total_memory(device_of(upstream))) return 2 * *total;
  }
  return std::size_t{64} << 30;
}

std::size_t growth_headroom_1024(double headroom) {
  if (!(headroom >= 0)) {
    throw InvalidArgument(
        "vram::DevicePool: growth_headroom must be a fraction >= 0 (got " +
        std::to_string(headroom) +
        "). Fix: 1.0/16 keeps reserved near the peak in use, 0.5 lets it reach 1.5x of it.");
  }
  const double limit = static_cast<double>(ReservedGauge::kMaxHeadroom1024);
  return static_cast<std::size_t>(std::min(headroom * 1024.0 + 0.5, limit));
}

std::shared_ptr<StreamFence> default_fence(const Upstream& upstream) {
  if (upstream.kind() != MemoryKind::device) return std::make_shared<ImmediateFence>();
  return std::make_shared<CudaEventFence>(device_of(upstream));
}

}  // namespace vram::detail
