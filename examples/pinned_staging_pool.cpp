// The README's PinnedStagingPool example as a complete program: a "layer" in pageable
// host memory goes to the device through a pinned staging buffer, which returns to the
// pool only with the proof that the copy reading it has completed.
// Without a usable CUDA device it says so and exits 0.
#include <vram/vram.hpp>

#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

int main() try {
  if (const auto devices = vram::cuda::Device::availability(); devices.count == 0) {
    std::printf("pinned_staging_pool example: no CUDA device (%s); nothing to run.\n",
                devices.reason.c_str());
    return 0;
  }
  using namespace vram::literals;
  const std::size_t layer_bytes = 64_MiB;
  std::vector<std::byte> weights(layer_bytes, std::byte{1});  // e.g. read from disk
  vram::DevicePool device_pool(/*device=*/0);
  auto layer = device_pool.acquire(layer_bytes);
  void* device_ptr = layer.data();
  vram::cuda::Stream stream;
  // [readme:pinned_staging_pool]
  vram::PinnedStagingPool staging_pool({.max_buffers = 8, .max_bytes = 512_MiB});
  auto staging = staging_pool.acquire(layer_bytes);  // best fit, or one real pin
  std::memcpy(staging.data(), weights.data(), layer_bytes);
  vram::PendingCopy copy = vram::copy_to_device_async(device_ptr, staging, stream.get());
  staging.retire(std::move(copy).wait());  // witness only after completion
  // [/readme:pinned_staging_pool]
  const auto stats = staging_pool.stats();
  std::printf("pinned_staging_pool example: %zu bytes copied, %llu pin call(s)\n", layer_bytes,
              static_cast<unsigned long long>(stats.pin_calls));
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "pinned_staging_pool example: %s\n", error.what());
  return 1;
}
