// StreamAges (src/device_pool/stream_ages.hpp): when a caller stream turns steady, when a new
// stream behind its handle makes it young again, and which entry a new stream takes.
#include "device_pool/stream_ages.hpp"

#include <gtest/gtest.h>

#include <cstdint>

namespace vram::testing {
namespace {

using detail::StreamAges;
using detail::StreamKey;

constexpr StreamKey kA = 0x1000;
constexpr StreamKey kB = 0x2000;

// Frees on `key` until note_free() says steady (false); returns how many were young.
std::uint32_t young_frees(StreamAges& ages, StreamKey key, std::uint64_t id) {
  std::uint32_t young = 0;
  while (ages.note_free(key, [id] { return id; })) ++young;
  return young;
}

TEST(StreamAges, AStreamAloneTurnsSteadyAfterTheLoneThreshold) {
  StreamAges ages;
  EXPECT_FALSE(ages.steady(kA));
  EXPECT_EQ(young_frees(ages, kA, 7), StreamAges::kLoneSteadyFrees);
  EXPECT_TRUE(ages.steady(kA));
}

TEST(StreamAges, AStreamComeBackToTurnsSteadyAfterTheShorterThreshold) {
  StreamAges ages;
  EXPECT_TRUE(ages.note_free(kA, [] { return 1; }));
  EXPECT_TRUE(ages.note_free(kB, [] { return 2; }));
  EXPECT_EQ(young_frees(ages, kA, 1), StreamAges::kSteadyFrees - 1);  // one counted before
}

TEST(StreamAges, AnotherStreamBehindTheHandleStartsYoungAgain) {
  StreamAges ages;
  // Named when its entry starts: 1; at the threshold the handle names stream 2: young again.
  std::uint64_t id = 1;
  for (std::uint32_t i = 0; i + 1 < StreamAges::kLoneSteadyFrees; ++i) {
    EXPECT_TRUE(ages.note_free(kA, [&] { return id; }));
  }
  id = 2;
  EXPECT_TRUE(ages.note_free(kA, [&] { return id; }));
  EXPECT_FALSE(ages.steady(kA)) << "a new stream behind the handle counted as the old one";
  // Steady, then the handle names a new stream: young within kRenameFrees frees.
  EXPECT_EQ(young_frees(ages, kA, 2), StreamAges::kLoneSteadyFrees - 1);
  ASSERT_TRUE(ages.steady(kA));
  std::uint32_t frees = 0;
  while (!ages.note_free(kA, [] { return 3; })) ++frees;
  EXPECT_LT(frees, StreamAges::kRenameFrees);
  EXPECT_FALSE(ages.steady(kA));
}

TEST(StreamAges, ANewStreamNeverTakesASteadyEntryWhileAnotherIsFree) {
  StreamAges ages;
  (void)young_frees(ages, kA, 1);
  ASSERT_TRUE(ages.steady(kA));
  // More new streams than the table holds, each freed on once.
  for (StreamKey key = 0x10000; key < 0x10000 + 4 * StreamAges::kTracked * 0x100; key += 0x100) {
    EXPECT_TRUE(ages.note_free(key, [] { return 9; }));
  }
  EXPECT_TRUE(ages.steady(kA)) << "a new stream replaced the steady one";
}

TEST(StreamAges, StreamsThatAreAlwaysRecordableAreNeverYoung) {
  StreamAges ages;
  EXPECT_TRUE(ages.steady(detail::kUntagged));
  EXPECT_TRUE(ages.steady(reinterpret_cast<StreamKey>(cudaStreamLegacy)));
  EXPECT_TRUE(ages.steady(StreamKey{0}));
  EXPECT_FALSE(StreamAges::caller_stream(detail::kPerThreadKey | 5));
}

}  // namespace
}  // namespace vram::testing
