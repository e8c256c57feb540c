// src/cuda/stream_identity.hpp: which stream a handle names now. A destroyed stream's handle
// may name a later stream (the driver reuses it); the id tells them apart.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vram::cuda {

// The driver's id of the stream `stream` names (cudaStreamGetId): unique for the process's
// life, never reused. 0 when it cannot be read (a destroyed handle is undefined behaviour:
// ask only during a call that proves the stream alive).
std::uint64_t stream_id(cudaStream_t stream) noexcept;

}  // namespace vram::cuda
