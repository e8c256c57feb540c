// src/cuda/stream_identity.hpp: a stream's identity, which the runtime never gives to another
// stream of the process (cudaStreamGetId), unlike its handle: a stream created after
// another's destruction may get the destroyed one's handle.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vram::cuda {

// 0 when the runtime cannot say (no driver, an error). Only for a live stream: a destroyed
// stream's handle is not a stream.
std::uint64_t stream_identity(cudaStream_t stream) noexcept;

}  // namespace vram::cuda
