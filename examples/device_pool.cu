// The README's DevicePool example as a complete program. A .cu file: it launches a kernel,
// so it is compiled by nvcc with the vram headers (C++20, carried by vram::vram).
// Without a usable CUDA device it says so and exits 0.
#include <vram/vram.hpp>

#include <cstdio>
#include <exception>

__global__ void fill(float* data, std::size_t count, float value) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    data[i] = value;
  }
}

int main() try {
  if (const auto devices = vram::cuda::Device::availability(); devices.count == 0) {
    std::printf("device_pool example: no CUDA device (%s); nothing to run.\n",
                devices.reason.c_str());
    return 0;
  }
  // [readme:device_pool]
  using namespace vram::literals;
  vram::DevicePool pool(/*device=*/0, {.max_cached_bytes = 8_GiB});
  vram::cuda::Stream stream;
  vram::PendingWorkQueue<vram::cuda::Event> in_flight;  // blocks still used by queued work
  for (int step = 0; step < 100; ++step) {
    auto lease = pool.acquire(1_MiB);  // size class 1 MiB; cudaMalloc only on a miss
    fill<<<256, 256, 0, stream.get()>>>(static_cast<float*>(lease.data()),
                                        lease.size() / sizeof(float), 1.0f);
    vram::cuda::Event done;
    done.record(stream.get());
    in_flight.submit(std::move(done), std::move(lease));  // back to the pool once `done` fired
    in_flight.collect();  // returns the blocks of every finished step, never blocks
  }
  in_flight.drain();  // waits for the rest
  // [/readme:device_pool]
  vram::cuda::check(cudaGetLastError(), "fill<<<>>>");
  const auto stats = pool.stats();
  std::printf("device_pool example: %llu acquires, %llu from the cache, %llu cudaMalloc calls\n",
              static_cast<unsigned long long>(stats.acquires),
              static_cast<unsigned long long>(stats.hits),
              static_cast<unsigned long long>(stats.upstream_allocations));
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "device_pool example: %s\n", error.what());
  return 1;
}
