#include "gpu_test_policy.hpp"

#include <cstdlib>
#include <cstring>

#include "vram/cuda/device.hpp"

namespace vram::testing {

bool gpu_available() {
  static const bool available = cuda::Device::count() > 0;
  return available;
}

bool gpu_required() {
  const char* value = std::getenv("VRAM_REQUIRE_GPU");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

std::string no_gpu_reason() { return cuda::Device::availability().reason; }

}  // namespace vram::testing
