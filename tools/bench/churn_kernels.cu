#include "bench/churn_kernels.hpp"

namespace vram::bench {
namespace {

constexpr int kThreads = 256;

__global__ void churn_fill(std::uint32_t* data, std::size_t words, std::uint32_t tag) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    data[i] = tag;
  }
}

__global__ void churn_check(const std::uint32_t* data, std::size_t words, std::uint32_t tag,
                            std::uint64_t spin_cycles, unsigned long long* mismatches) {
  if (spin_cycles != 0) {
    const long long start = clock64();
    while (clock64() - start < static_cast<long long>(spin_cycles)) {
    }
  }
  unsigned long long wrong = 0;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    wrong += data[i] != tag ? 1 : 0;
  }
  if (wrong != 0) atomicAdd(mismatches, wrong);
}

unsigned blocks_for(std::size_t words) {
  const std::size_t wanted = (words + kThreads - 1) / kThreads;
  return static_cast<unsigned>(wanted < 1 ? 1 : wanted > 1024 ? 1024 : wanted);
}

}  // namespace

cudaError_t launch_churn_fill(void* data, std::size_t words, std::uint32_t tag,
                              cudaStream_t stream) {
  churn_fill<<<blocks_for(words), kThreads, 0, stream>>>(static_cast<std::uint32_t*>(data), words,
                                                         tag);
  return cudaGetLastError();
}

cudaError_t launch_churn_check(const void* data, std::size_t words, std::uint32_t tag,
                               std::uint64_t spin_cycles, unsigned long long* mismatches,
                               cudaStream_t stream) {
  churn_check<<<blocks_for(words), kThreads, 0, stream>>>(static_cast<const std::uint32_t*>(data),
                                                          words, tag, spin_cycles, mismatches);
  return cudaGetLastError();
}

}  // namespace vram::bench
