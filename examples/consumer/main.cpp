// Uses vram from its installed package: a DevicePool over device memory when a GPU is
// visible, over host memory otherwise.
#include <vram/vram.hpp>

#include <cstdio>

int main() {
  using namespace vram::literals;
  const bool gpu = vram::cuda::Device::count() > 0;
  std::shared_ptr<vram::Upstream> upstream;
  if (gpu) {
    upstream = std::make_shared<vram::DeviceMemoryUpstream>(0);
  } else {
    upstream = std::make_shared<vram::HostMemoryUpstream>();
  }
  vram::DevicePool pool(upstream, {.max_cached_bytes = 1_GiB});
  for (int i = 0; i < 1000; ++i) {
    auto lease = pool.acquire(64_KiB);
  }
  const auto stats = pool.stats();
  std::printf("vram consumer (%s): %llu acquires, %llu from the cache, %llu upstream calls\n",
              gpu ? "device" : "host", static_cast<unsigned long long>(stats.acquires),
              static_cast<unsigned long long>(stats.hits),
              static_cast<unsigned long long>(stats.upstream_allocations));
  return stats.upstream_allocations == 1 ? 0 : 1;
}
