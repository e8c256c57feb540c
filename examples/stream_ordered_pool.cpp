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
  vram::StreamOrderedPool pool({.device = 0});  // private pool, release threshold: retain all
  vram::cuda::Stream stream, other_stream;
  void* p = pool.allocate_async(64_MiB, stream.get());
  pool.deallocate_async(p, 64_MiB, stream.get());  // reusable at once by later work on `stream`
  vram::StreamOrderedPool::hand_over(stream.get(), other_stream.get());  // before reuse there
  other_stream.synchronize();
  // [/readme:stream_ordered_pool]
  std::size_t reserved = pool.pool_reserved_bytes(), mine = pool.bytes_in_use();
  pool.trim(0);
  std::printf(
      "stream_ordered_pool example: %zu bytes reserved by the pool, %zu in use by this "
      "object before trim(0)\n",
      reserved, mine);
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "stream_ordered_pool example: %s\n", error.what());
  return 1;
}
