// vram_free_memory_probe DEVICE: prints the free bytes of DEVICE as cudaMemGetInfo reports
// them to a process of its own (what another process could allocate), then exits. Exit 2
// when the runtime cannot say. Built beside vram_tests, which runs it as a second process.
#include <cstdio>
#include <cstdlib>

#include "cuda/memory.hpp"

int main(int argc, char** argv) {
  const int device = argc > 1 ? std::atoi(argv[1]) : 0;
  const auto info = vram::cuda::memory_info(device);
  if (!info) {
    std::fprintf(stderr, "vram_free_memory_probe: cudaMemGetInfo on device %d failed\n", device);
    return 2;
  }
  std::printf("%zu\n", info->free_bytes);
  return 0;
}
