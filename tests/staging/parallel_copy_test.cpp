// ParallelCopy (src/staging/parallel_copy.hpp): the pageable path's host copy over a few
// threads, memcpy or non-temporal stores.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "staging/parallel_copy.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

void copies_every_byte(bool streaming);

TEST(ParallelCopy, CopiesEveryByteForManySizesBackToBack) {
  for (const bool streaming : {true, false}) {
    SCOPED_TRACE(streaming ? "non-temporal stores" : "memcpy");
    copies_every_byte(streaming);
  }
}

// The non-temporal copy: every alignment of source and destination, sizes around its
// 16-byte alignment head and 64-byte blocks, and not a byte outside the destination.
TEST(ParallelCopy, StreamingCopyMatchesMemcpyAtEveryAlignmentAndTouchesNothingElse) {
  std::vector<std::byte> source(4096 + 64);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = std::byte(i * 37 % 253 + 1);
  std::vector<std::byte> destination(source.size() + 64);
  for (std::size_t to = 0; to < 17; ++to) {
    for (std::size_t from = 0; from < 17; from += 3) {
      for (std::size_t bytes :
           {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{63},
            std::size_t{64}, std::size_t{79}, std::size_t{80}, std::size_t{127}, std::size_t{128},
            std::size_t{1000}, std::size_t{4096}}) {
        std::fill(destination.begin(), destination.end(), std::byte{0});
        detail::streaming_copy(destination.data() + to, source.data() + from, bytes);
        ASSERT_EQ(std::memcmp(destination.data() + to, source.data() + from, bytes), 0)
            << "to +" << to << ", from +" << from << ", " << bytes << " bytes";
        for (std::size_t i = 0; i < destination.size(); ++i) {
          if (i < to || i >= to + bytes) {
            ASSERT_EQ(destination[i], std::byte{0}) << "byte " << i << " outside the copy";
          }
        }
      }
    }
  }
}

void copies_every_byte(bool streaming) {
  detail::ParallelCopy copy(4, streaming);
  std::vector<std::byte> source(9_MiB + 123);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = std::byte(i * 131 % 251);
  std::vector<std::byte> destination(source.size());
  for (std::size_t bytes : {std::size_t{1}, 4_KiB, 1_MiB - 1, 2_MiB + 7, 9_MiB + 123}) {
    for (int round = 0; round < 20; ++round) {
      std::fill(destination.begin(), destination.end(), std::byte{0});
      const std::size_t offset = static_cast<std::size_t>(round) % 3;
      const std::size_t length = std::min(bytes, source.size() - offset);
      copy.run(destination.data() + offset, source.data() + offset, length);
      ASSERT_EQ(std::memcmp(destination.data() + offset, source.data() + offset, length), 0)
          << bytes << " bytes, round " << round;
    }
  }
}

}  // namespace
}  // namespace vram::testing
