// The per-layer compute of the `pager` bench scenario (tools/bench/pager_kernels.cu): a
// GEMM-shaped kernel whose arithmetic intensity is a parameter, so one layer stack can be
// made copy-bound or compute-bound.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace vram::bench {

// Reads every fp16 weight of [weights, weights + bytes) once (16-byte loads) and does
// 2 * intensity FMAs per weight, as a GEMM with `intensity` activation columns held in
// registers would; writes one float per thread to `out` (blocks * kPagerComputeThreads).
// intensity 0: a pure read of the weights (memory-bound: the stack is copy-bound).
// `bytes` must be a multiple of 16; `weights` 16-byte aligned.
// `blocks` blocks of kPagerComputeThreads threads (4 per SM fill an H200); returns the
// launch's cudaGetLastError() (this file stays free of vram headers: nvcc builds it as C++17).
constexpr int kPagerComputeThreads = 256;
cudaError_t launch_pager_compute(const void* weights, std::size_t bytes, unsigned intensity,
                                 float* out, int blocks, cudaStream_t stream);

}  // namespace vram::bench
