// The README's StreamOrderedPool example as a complete program.
// Without a usable CUDA device it says so and exits 0.
#include <vram/vram.hpp>

#include <cstdio>
#include <exception>

int main() try {
  if (const auto devices = vram::cuda::Device::availability(); devices.count == 0) {
    std::printf("stream_ordered_pool example: no CUDA device (%s); nothing to run.\n",
                devices.reason.c_str());
    return 0;
  }
  // [readme:stream_ordered_pool]
  using namespace vram::literals;
  vram::StreamOrderedPool pool({.device = 0});  // default pool, release threshold: retain all
  vram::cuda::Stream stream, other_stream;
  void* p = pool.allocate_async(64_MiB, stream.get());
  // ... kernels on `stream` use p ...
  pool.deallocate_async(p, stream.get());  // reusable at once by later work on `stream`
  vram::StreamOrderedPool::hand_over(stream.get(), other_stream.get());  // before another
                                                                         // stream reuses it
  other_stream.synchronize();
  std::size_t reserved = pool.reserved_bytes(), used = pool.used_bytes();
  pool.trim(0);
  // [/readme:stream_ordered_pool]
  std::printf("stream_ordered_pool example: %zu bytes reserved, %zu in use before trim(0)\n",
              reserved, used);
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "stream_ordered_pool example: %s\n", error.what());
  return 1;
}
