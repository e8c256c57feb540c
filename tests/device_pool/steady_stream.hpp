// A caller stream made one of the calling thread's steady streams for a DevicePool
// (src/device_pool/stream_ages.hpp): its later frees keep the warm path and record no marker of
// their own, so a test sees the rules of wants and quiesces that such a stream is under.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "device_pool/stream_ages.hpp"
#include "vram/device_pool.hpp"

namespace vram::testing {

// kLoneSteadyFrees frees of 256-byte blocks on `s` alone (young frees: each records a marker on
// `s`, which completes when the emulated device runs `s`'s work).
inline void free_often_on(DevicePool& pool, cudaStream_t s) {
  for (std::uint32_t i = 0; i < detail::StreamAges::kLoneSteadyFrees; ++i) {
    pool.deallocate_async(pool.allocate_async(256, s), 256, s);
  }
}

}  // namespace vram::testing
