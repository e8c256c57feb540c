// vram DevicePool in `vram replay`. The one file to change when DevicePool gains
// allocate_async/deallocate_async: call them with stream.handle and return true from
// stream_ordered(); the driver then stops holding cross-stream frees back.
#include <memory>

#include "replay/replay_allocator.hpp"
#include "vram/device_pool.hpp"
#include "vram/upstream.hpp"

namespace vram::replay {
namespace {

class DevicePoolAdapter final : public ReplayAllocator {
 public:
  explicit DevicePoolAdapter(const ReplayContext& context)
      : pool_(context.device ? std::shared_ptr<Upstream>(
                                   std::make_shared<DeviceMemoryUpstream>(context.device_id))
                             : std::shared_ptr<Upstream>(
                                   std::make_shared<HostMemoryUpstream>(context.capacity_bytes))) {}
  void* allocate(std::size_t bytes, ReplayStream) override { return pool_.allocate(bytes); }
  void deallocate(void* block, std::size_t bytes, ReplayStream) override {
    pool_.deallocate(block, bytes);
  }
  bool stream_ordered() const override { return false; }
  std::size_t peak_reserved_bytes() override { return pool_.stats().peak_bytes_reserved; }
  std::optional<std::uint64_t> upstream_allocations() override {
    return pool_.stats().upstream_allocations;
  }

 private:
  DevicePool pool_;
};

}  // namespace

AllocatorSpec device_pool_spec() {
  AllocatorSpec spec;
  spec.name = "vram DevicePool";
  spec.needs_gpu = false;
  spec.note = "defaults; peak reserved and upstream allocations from DevicePool::stats()";
  spec.make = [](const ReplayContext& context) {
    return std::make_unique<DevicePoolAdapter>(context);
  };
  return spec;
}

}  // namespace vram::replay
