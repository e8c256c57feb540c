// PyTorch's CUDACachingAllocator as a `vram replay` peer, through its C++ raw API
// (raw_alloc_with_stream / raw_delete). Built only with -DVRAM_WITH_TORCH=ON where
// find_package(Torch) succeeds; otherwise this file contributes no allocator.
//
// The caching allocator is a process-wide singleton: each replay empties its cache and
// resets its peak first, so one replay's cache does not serve the next. It keeps blocks per
// stream (a block freed on S is reused only by S), so it is stream-ordered.
#include "replay/replay_allocator.hpp"

#if defined(VRAM_WITH_TORCH) && VRAM_WITH_TORCH

#include <c10/cuda/CUDACachingAllocator.h>

#include <mutex>

#include "vram/cuda/error.hpp"

namespace vram::replay {
namespace {

namespace torch_alloc = c10::cuda::CUDACachingAllocator;

// StatType::AGGREGATE, which is 0 in every version (its namespace moved between them).
constexpr std::size_t kAggregate = 0;

class TorchCachingPeer final : public ReplayAllocator {
 public:
  explicit TorchCachingPeer(int device) : device_(static_cast<c10::DeviceIndex>(device)) {
    // Outside Python nothing has initialised the allocator yet; init() is idempotent.
    static std::once_flag once;
    std::call_once(once, [] {
      int count = 0;
      cuda::check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
      torch_alloc::init(count);
    });
    cuda::check(cudaSetDevice(device), "cudaSetDevice");
    cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    torch_alloc::emptyCache();
    torch_alloc::resetPeakStats(device_);
    base_device_allocs_ = torch_alloc::getDeviceStats(device_).num_device_alloc;
  }
  ~TorchCachingPeer() override {
    try {
      (void)cudaDeviceSynchronize();
      torch_alloc::emptyCache();
    } catch (...) {
    }
  }
  void* allocate(std::size_t bytes, ReplayStream stream) override {
    return torch_alloc::raw_alloc_with_stream(bytes, stream.handle);
  }
  void deallocate(void* block, std::size_t, ReplayStream) override {
    torch_alloc::raw_delete(block);
  }
  bool stream_ordered() const override { return true; }
  void synchronize() override { cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
  std::size_t peak_reserved_bytes() override {
    return static_cast<std::size_t>(
        torch_alloc::getDeviceStats(device_).reserved_bytes[kAggregate].peak);
  }
  std::size_t reserved_bytes() override {
    return static_cast<std::size_t>(
        torch_alloc::getDeviceStats(device_).reserved_bytes[kAggregate].current);
  }
  std::optional<std::uint64_t> upstream_allocations() override {
    return static_cast<std::uint64_t>(torch_alloc::getDeviceStats(device_).num_device_alloc -
                                      base_device_allocs_);
  }

 private:
  c10::DeviceIndex device_;
  std::int64_t base_device_allocs_ = 0;
};

}  // namespace

std::vector<AllocatorSpec> torch_peer_specs() {
  std::vector<AllocatorSpec> specs;
  specs.push_back({"PyTorch CUDACachingAllocator", true,
                   "raw_alloc_with_stream/raw_delete; peak reserved = reserved_bytes peak, "
                   "upstream allocations = num_device_alloc",
                   [](const ReplayContext& c) -> std::unique_ptr<ReplayAllocator> {
                     return std::make_unique<TorchCachingPeer>(c.device_id);
                   }});
  return specs;
}

}  // namespace vram::replay

#else

namespace vram::replay {
std::vector<AllocatorSpec> torch_peer_specs() { return {}; }
}  // namespace vram::replay

#endif
