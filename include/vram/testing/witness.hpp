// vram/testing/witness.hpp: TEST-ONLY. Mints CopyCompleted witnesses without a copy, so
// pool logic can be tested over plain host memory. Never include this in production code:
// a witness that no copy earned defeats the reuse-after-completion guarantee.
#pragma once

#ifndef VRAM_TESTING
#error "vram/testing/witness.hpp is test-only: define VRAM_TESTING in a test target to use it"
#endif

#include <cstddef>

#include "vram/copy.hpp"

namespace vram::testing {

struct WitnessMint {
  static CopyCompleted completed_copy_of(const void* source, std::size_t bytes) noexcept {
    return CopyCompleted(source, bytes);
  }
};

}  // namespace vram::testing
