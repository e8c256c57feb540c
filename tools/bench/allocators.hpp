// The allocators `vram bench` compares, behind one interface so every scenario runs each
// the same way. Ours: DevicePool, StreamOrderedPool. Peers: cudaMalloc, cudaMallocAsync on
// the default pool (release threshold: retain all), CUB's CachingDeviceAllocator. Without
// a GPU: DevicePool over host memory against malloc/free.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace vram::bench {

class BenchAllocator {
 public:
  virtual ~BenchAllocator() = default;
  virtual std::string name() const = 0;
  virtual bool ours() const = 0;
  virtual void* allocate(std::size_t bytes, cudaStream_t stream) = 0;
  virtual void deallocate(void* block, std::size_t bytes, cudaStream_t stream) = 0;
  // Ends a timed batch: waits for device work the allocator queued on `stream`.
  virtual void finish(cudaStream_t stream) { (void)stream; }
  // Peak bytes the allocator held from the system since reset_peak(), where it can say.
  virtual std::size_t peak_reserved_bytes() { return 0; }
  virtual void reset_peak() {}
  // Returns cached memory to the system (between scenarios).
  virtual void release_cache() {}
  // Device-wide synchronizes the allocator made so far, where it counts them (DevicePool:
  // its quiesces); -1: not known.
  virtual double device_synchronizes() { return -1; }
  // Counters the allocator keeps that only grow (DevicePool: its upstream allocations,
  // stream markers and wants), by name; a scenario records what a cell added to each.
  virtual std::map<std::string, double> counters() { return {}; }
};

std::vector<std::unique_ptr<BenchAllocator>> make_device_allocators(int device);
std::vector<std::unique_ptr<BenchAllocator>> make_host_allocators();
// The batched scenario's: DevicePool in its plain and stream-ordered forms (allocate_async,
// deallocate_async), cudaMallocAsync on a private pool, CUB.
std::vector<std::unique_ptr<BenchAllocator>> make_batched_allocators(int device);

}  // namespace vram::bench
