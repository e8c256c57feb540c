#include <gtest/gtest.h>

#include <cstdio>

#include "gpu_test_policy.hpp"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::printf("[vram] GPU tests: %s\n",
              vram::testing::gpu_available()
                  ? "device visible, running them"
                  : (vram::testing::gpu_required() ? "NO device but VRAM_REQUIRE_GPU=1: they fail"
                                                   : "no device, they skip"));
  return RUN_ALL_TESTS();
}
