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
  cudaGraph_t graph = nullptr;
  // [readme:cuda_graphs]
  const auto graph_pool = vram::DevicePool::new_graph_pool();  // per graph, or shared
  auto scope = pool.capture_into(graph_pool, stream.get());    // before the capture begins
  vram::cuda::check(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal), "begin");
  void* scratch = pool.allocate_async(4_MiB, stream.get());  // the graph's block from now on
  fill<<<256, 256, 0, stream.get()>>>(static_cast<float*>(scratch), 1 << 20, 2.0f);
  pool.deallocate_async(scratch, 4_MiB, stream.get());  // reused only inside graph_pool
  vram::cuda::check(cudaStreamEndCapture(stream.get(), &graph), "end");
  scope.end();  // launch `graph` any number of times; once it is destroyed, release the pool
  // [/readme:cuda_graphs]
  cudaGraphExec_t exec = nullptr;
  vram::cuda::check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  for (int launch = 0; launch < 3; ++launch) {
    vram::cuda::check(cudaGraphLaunch(exec, stream.get()), "cudaGraphLaunch");
  }
  stream.synchronize();
  vram::cuda::check(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
  vram::cuda::check(cudaGraphDestroy(graph), "cudaGraphDestroy");
  pool.release_graph_pool(graph_pool);
  // [readme:sleep_wake]
  auto weights = pool.create_tag("weights");
  auto kv = pool.create_tag("kv", {.discardable = true});  // comes back uninitialised
  void* w = pool.allocate_tagged(64_MiB, weights);  // or every request under pool.tag_scope(tag)
  void* cache = pool.allocate_tagged(64_MiB, kv);
  pool.sleep({weights, kv}, stream.get());  // w to pinned host memory; the GPU memory is freed
  pool.wake({weights, kv}, stream.get());   // same addresses: pointers and graphs stay valid
  // [/readme:sleep_wake]
  pool.deallocate(w, 64_MiB);
  pool.deallocate(cache, 64_MiB);
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
