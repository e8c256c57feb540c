// YoungStreams: a stream is young for its first kYoungFrees frees on a thread, then ages; a
// stream the table has not seen (or whose slot another took since) is young again; each
// thread has its own table.
#include <gtest/gtest.h>

#include <thread>

#include "device_pool/young_streams.hpp"

namespace vram::testing {
namespace {

using detail::StreamKey;
using detail::YoungStreams;

TEST(YoungStreams, AStreamIsYoungForItsFirstFreesThenAges) {
  YoungStreams table;
  const StreamKey s = 0x7f0012340000;
  for (std::uint32_t i = 0; i < YoungStreams::kYoungFrees; ++i) {
    EXPECT_TRUE(table.note_free(s)) << "free " << i;
  }
  EXPECT_FALSE(table.note_free(s));
  EXPECT_FALSE(table.note_free(s)) << "stays aged";
  EXPECT_TRUE(table.note_free(s + 0x1000)) << "another stream is young";
  EXPECT_FALSE(table.note_free(s)) << "the first is still aged";
}

TEST(YoungStreams, ManyStreamsTakeEachOthersSlotsAndAreYoungAgain) {
  YoungStreams table;
  const StreamKey first = 0x7f0012340000;
  for (std::uint32_t i = 0; i < YoungStreams::kYoungFrees; ++i) (void)table.note_free(first);
  ASSERT_FALSE(table.note_free(first));
  // More streams than slots: one of them takes the first stream's slot.
  for (StreamKey k = 1; k <= 4 * YoungStreams::kSlots; ++k) {
    EXPECT_TRUE(table.note_free(first + k * 0x1000)) << "a new stream is young";
  }
  EXPECT_TRUE(table.note_free(first)) << "its slot was taken: young again";
}

TEST(YoungStreams, EachThreadCountsItsOwnFrees) {
  const StreamKey s = 0x7f0056780000;
  for (std::uint32_t i = 0; i < YoungStreams::kYoungFrees; ++i) {
    (void)detail::tl_young_streams.note_free(s);
  }
  EXPECT_FALSE(detail::tl_young_streams.note_free(s));
  bool young_elsewhere = false;
  std::thread([&] { young_elsewhere = detail::tl_young_streams.note_free(s); }).join();
  EXPECT_TRUE(young_elsewhere);
}

}  // namespace
}  // namespace vram::testing
