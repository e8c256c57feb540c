// GPU test policy: GPU tests call VRAM_GPU_TEST_OR_SKIP() first. Without a visible device
// they skip (GTEST_SKIP); with VRAM_REQUIRE_GPU=1 in the environment they FAIL instead,
// so a GPU run can never pass by skipping.
#pragma once

#include <gtest/gtest.h>

#include <string>

namespace vram::testing {
bool gpu_available();
bool gpu_required();
std::string no_gpu_reason();
}  // namespace vram::testing

#define VRAM_GPU_TEST_OR_SKIP()                                                      \
  do {                                                                               \
    if (!::vram::testing::gpu_available()) {                                         \
      if (::vram::testing::gpu_required()) {                                         \
        FAIL() << "VRAM_REQUIRE_GPU=1 but no CUDA device is usable: "                \
               << ::vram::testing::no_gpu_reason();                                  \
      }                                                                              \
      GTEST_SKIP() << "no CUDA device (" << ::vram::testing::no_gpu_reason() << ")"; \
    }                                                                                \
  } while (0)
