// PinnedHostUpstream (vram/pinned_host_upstream.hpp): which pinning method serves which size.
#include <gtest/gtest.h>

#include "vram/pinned_host_upstream.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

TEST(PinnedHostUpstream, AutomaticPicksTheMeasuredFasterMethodPerSize) {
  PinnedHostUpstream upstream;
  EXPECT_EQ(upstream.method_for(4_KiB), PinningMethod::host_alloc);
  EXPECT_EQ(upstream.method_for(64_KiB), PinningMethod::touch_register);
  EXPECT_EQ(upstream.method_for(8_GiB), PinningMethod::touch_register);
  PinnedHostUpstream forced({.method = PinningMethod::host_alloc});
  EXPECT_EQ(forced.method_for(8_GiB), PinningMethod::host_alloc);
}

}  // namespace
}  // namespace vram::testing
