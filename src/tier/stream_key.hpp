// src/tier/stream_key.hpp: the key a segment tier tags a stream's free ranges with.
//
// A stream's key is its handle, except for cudaStreamPerThread, which names another stream
// on every thread: its key is the calling thread's own, kPerThreadKey plus a number never
// given to another thread (a block freed on a thread's stream is never taken for a later
// thread's stream, even after the thread exits), and a fence for it is recorded on the
// legacy default stream, which waits for all work queued before on every blocking stream,
// per-thread default streams among them. The null stream is the legacy default stream (one
// stream for all threads), as in code built without --default-stream per-thread. Code
// built with it must pass cudaStreamPerThread for its own stream: a 0 it passes means its
// per-thread stream to it but the one shared key here, and the pool cannot tell.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace vram::detail {

using StreamKey = std::uintptr_t;
// The tag of a range usable by every stream (no stream's queued work may still use it).
inline constexpr StreamKey kUntagged = ~StreamKey{0};
inline constexpr StreamKey kPerThreadKey = StreamKey{1} << (sizeof(StreamKey) * 8 - 1);

StreamKey per_thread_stream_key() noexcept;

inline StreamKey stream_key(cudaStream_t stream) noexcept {
  if (stream == cudaStreamPerThread) [[unlikely]]
    return per_thread_stream_key();
  return reinterpret_cast<StreamKey>(stream);
}
// The stream a marker for `key`'s frees is recorded on.
inline cudaStream_t fence_stream_of(StreamKey key) noexcept {
  return (key & kPerThreadKey) != 0 ? cudaStreamLegacy : reinterpret_cast<cudaStream_t>(key);
}
// A marker for `key`'s frees may be recorded at any time: it goes on the legacy default
// stream (the null stream, cudaStreamLegacy, any thread's cudaStreamPerThread), which exists
// as long as the context. Any other stream is the caller's and may have been destroyed since
// its frees: it is recorded on only inside a call that passes it (stream_wants.hpp).
inline bool always_recordable(StreamKey key) noexcept {
  const cudaStream_t stream = fence_stream_of(key);
  return stream == nullptr || stream == cudaStreamLegacy;
}

}  // namespace vram::detail
