// The kernels of the `stream-churn` bench scenario (tools/bench/churn_kernels.cu): a block
// filled with its owner's tag, then its words that differ from the tag counted, both on the
// request's stream, so that a block handed to another stream before the owner's work
// completed shows as a mismatch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace vram::bench {

// Writes `tag` into the `words` 32-bit words at `data`. Returns cudaGetLastError() (this
// file stays free of vram headers: nvcc builds it as C++17).
cudaError_t launch_churn_fill(void* data, std::size_t words, std::uint32_t tag,
                              cudaStream_t stream);
// Spins `spin_cycles` GPU clock cycles (keeps the check queued past the free), then adds the
// count of the `words` words at `data` that differ from `tag` to *mismatches.
cudaError_t launch_churn_check(const void* data, std::size_t words, std::uint32_t tag,
                               std::uint64_t spin_cycles, unsigned long long* mismatches,
                               cudaStream_t stream);

}  // namespace vram::bench
