// host_pager_device.cpp: a PagerDevice over host memory (offload.hpp): the arena is a host
// buffer, a page-in is a memcpy done at once, so work "queued" after acquire sees the bytes
// and nothing needs an event. Used by the CPU tests of the offload path (no GPU needed).
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "offload.hpp"

namespace vram_torch {
namespace {

class HostPagerDevice final : public vram::PagerDevice {
 public:
  std::string pin_host(std::span<const HostRange> ranges, std::size_t,
                       vram::WeightPagerLoad& load) override {
    for (const auto& range : ranges) load.pinned_bytes += range.bytes;
    load.register_calls = ranges.size();
    return {};
  }
  void* allocate_arena(std::size_t bytes) override {
    arena_ = std::make_unique<std::byte[]>(bytes);  // value-initialised: zeros
    return arena_.get();
  }
  void upload(void* device, const void* host, std::size_t bytes) override {
    std::memcpy(device, host, bytes);
  }
  void configure(std::size_t, bool, const vram::WeightPagerOptions&) override {}
  void page_in(std::size_t, void* device, const void* host, std::size_t bytes) override {
    std::memcpy(device, host, bytes);
  }
  void wait_ready(std::size_t, cudaStream_t) override {}
  void record_release(std::size_t, cudaStream_t) override {}
  void collect(vram::WeightPagerStats&) override {}
  void synchronize() override {}
  void shutdown(void*, std::size_t) noexcept override { arena_.reset(); }

 private:
  std::unique_ptr<std::byte[]> arena_;
};

}  // namespace

std::unique_ptr<vram::PagerDevice> make_host_pager_device() {
  return std::make_unique<HostPagerDevice>();
}

}  // namespace vram_torch
