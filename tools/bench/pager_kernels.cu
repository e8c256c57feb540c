#include <cuda_fp16.h>

#include <cstdint>

#include "bench/pager_kernels.hpp"

namespace vram::bench {
namespace {

__global__ void pager_compute(const uint4* __restrict__ weights, std::size_t vectors,
                              unsigned intensity, float* __restrict__ out) {
  const std::size_t thread = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  // Four independent accumulator chains (enough ILP with 4 blocks of 256 per SM).
  const float a0 = 1.0f + 1e-3f * static_cast<float>(threadIdx.x & 7);
  const float a1 = a0 + 0.25f;
  float acc0 = 0, acc1 = 0, acc2 = 0, acc3 = 0;
  for (std::size_t i = thread; i < vectors; i += stride) {
    const uint4 v = weights[i];
    const __half2* halves = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 w = __half22float2(halves[k]);
      acc0 += w.x;  // every weight counts, even at intensity 0
      acc1 += w.y;
      for (unsigned j = 0; j < intensity; ++j) {
        acc0 = fmaf(w.x, acc0, a0);
        acc1 = fmaf(w.y, acc1, a1);
        acc2 = fmaf(w.x, acc2, a1);
        acc3 = fmaf(w.y, acc3, a0);
      }
    }
  }
  out[thread] = acc0 + acc1 + acc2 + acc3;
}

}  // namespace

cudaError_t launch_pager_compute(const void* weights, std::size_t bytes, unsigned intensity,
                                 float* out, int blocks, cudaStream_t stream) {
  pager_compute<<<blocks, kPagerComputeThreads, 0, stream>>>(static_cast<const uint4*>(weights),
                                                             bytes / 16, intensity, out);
  return cudaGetLastError();
}

}  // namespace vram::bench
