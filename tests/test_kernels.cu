#include "test_kernels.hpp"

namespace vram::testing {
namespace {

__device__ std::uint64_t global_time_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_then_fill(std::uint32_t* data, std::size_t words, std::uint32_t pattern,
                               std::uint64_t spin_ns) {
  if (spin_ns > 0) {
    const std::uint64_t start = global_time_ns();
    while (global_time_ns() - start < spin_ns) {
    }
  }
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    data[i] = pattern;
  }
}

__global__ void count_mismatches(const std::uint32_t* data, std::size_t words,
                                 std::uint32_t pattern, unsigned long long* mismatches) {
  unsigned long long local = 0;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    local += data[i] != pattern;
  }
  if (local != 0) atomicAdd(mismatches, local);
}

unsigned blocks_for(std::size_t words) {
  const std::size_t blocks = (words + 255) / 256;
  return static_cast<unsigned>(blocks < 1024 ? (blocks == 0 ? 1 : blocks) : 1024);
}

}  // namespace

void launch_spin_then_fill(void* data, std::size_t words, std::uint32_t pattern,
                           std::uint64_t spin_ns, cudaStream_t stream) {
  spin_then_fill<<<blocks_for(words), 256, 0, stream>>>(static_cast<std::uint32_t*>(data), words,
                                                        pattern, spin_ns);
}

void launch_fill(void* data, std::size_t words, std::uint32_t pattern, cudaStream_t stream) {
  launch_spin_then_fill(data, words, pattern, 0, stream);
}

void launch_count_mismatches(const void* data, std::size_t words, std::uint32_t pattern,
                             unsigned long long* mismatches, cudaStream_t stream) {
  count_mismatches<<<blocks_for(words), 256, 0, stream>>>(static_cast<const std::uint32_t*>(data),
                                                          words, pattern, mismatches);
}

}  // namespace vram::testing
