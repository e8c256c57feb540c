// Streams made aged for the calling thread (src/device_pool/young_streams.hpp): their frees
// take the path of a stream that stays, with no marker recorded at the free. For tests of
// what the pool does with such frees (wants, thread caches, quiesces).
#pragma once

#include <cuda_runtime_api.h>

#include <initializer_list>

#include "device_pool/young_streams.hpp"

namespace vram::testing {

inline void age_streams(std::initializer_list<cudaStream_t> streams) {
  for (cudaStream_t s : streams) detail::thread_young_streams().age(detail::stream_key(s));
}

}  // namespace vram::testing
