// Kernels the GPU tests launch (tests/test_kernels.cu, the one .cu file).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace vram::testing {

// Spins on the device for about `spin_ns` nanoseconds, then fills `words` 32-bit words.
void launch_spin_then_fill(void* data, std::size_t words, std::uint32_t pattern,
                           std::uint64_t spin_ns, cudaStream_t stream);
void launch_fill(void* data, std::size_t words, std::uint32_t pattern, cudaStream_t stream);
// Adds the number of words that differ from `pattern` to *mismatches (device memory).
void launch_count_mismatches(const void* data, std::size_t words, std::uint32_t pattern,
                             unsigned long long* mismatches, cudaStream_t stream);

}  // namespace vram::testing
