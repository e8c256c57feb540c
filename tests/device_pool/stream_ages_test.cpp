// StreamAges (src/device_pool/stream_ages.hpp): when a caller stream turns steady, when a new
// stream behind its handle makes it young again, and which entry a new stream takes.
#include "device_pool/stream_ages.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

namespace vram::testing {
namespace {

using detail::StreamAges;
using detail::StreamKey;

constexpr StreamKey kA = 0x1000;
constexpr StreamKey kB = 0x2000;

// Frees on `key` until note_free() finds it steady before the free; returns how many were young.
std::uint32_t young_frees(StreamAges& ages, StreamKey key, std::uint64_t id) {
  std::uint32_t young = 0;
  while (ages.note_free(key, [id] { return id; }).young) ++young;
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
  EXPECT_TRUE(ages.note_free(kA, [] { return 1; }).young);
  EXPECT_TRUE(ages.note_free(kB, [] { return 2; }).young);
  EXPECT_EQ(young_frees(ages, kA, 1), StreamAges::kSteadyFrees - 1);  // one counted before
}

TEST(StreamAges, AnotherStreamBehindTheHandleStartsYoungAgain) {
  StreamAges ages;
  // Named when its entry starts: 1; at the threshold the handle names stream 2: young again.
  std::uint64_t id = 1;
  for (std::uint32_t i = 0; i + 1 < StreamAges::kLoneSteadyFrees; ++i) {
    EXPECT_TRUE(ages.note_free(kA, [&] { return id; }).young);
  }
  id = 2;
  EXPECT_TRUE(ages.note_free(kA, [&] { return id; }).young);
  EXPECT_FALSE(ages.steady(kA)) << "a new stream behind the handle counted as the old one";
  // Steady, then the handle names a new stream: young within kRenameFrees frees.
  EXPECT_EQ(young_frees(ages, kA, 2), StreamAges::kLoneSteadyFrees - 1);
  ASSERT_TRUE(ages.steady(kA));
  std::uint32_t frees = 0;
  while (!ages.note_free(kA, [] { return 3; }).young) ++frees;
  EXPECT_LT(frees, StreamAges::kRenameFrees);
  EXPECT_FALSE(ages.steady(kA));
}

// A steady stream is named kRenameFrees slow-path frees after it turned steady, then each gap
// twice the last up to kMostRenameFrees: few driver calls on a busy stream, and a new stream
// behind its handle still found within kMostRenameFrees frees.
TEST(StreamAges, ASteadyStreamIsNamedLessOftenUpToTheLongestGap) {
  StreamAges ages;
  (void)young_frees(ages, kA, 1);
  ASSERT_TRUE(ages.steady(kA));
  std::vector<std::uint32_t> named_at;  // steady frees at each naming
  // young_frees' last free was the first steady one.
  for (std::uint32_t frees = 1; frees < 4096; ++frees) {
    bool named = false;
    EXPECT_FALSE(ages.note_free(kA,
                                [&] {
                                  named = true;
                                  return std::uint64_t{1};
                                })
                     .young);
    if (named) named_at.push_back(frees + 1);
  }
  ASSERT_GE(named_at.size(), 6U);
  EXPECT_EQ(named_at[0], StreamAges::kRenameFrees);
  std::uint32_t gap = StreamAges::kRenameFrees;
  for (std::size_t i = 1; i < named_at.size(); ++i) {
    gap = std::min(2 * gap, StreamAges::kMostRenameFrees);
    EXPECT_EQ(named_at[i] - named_at[i - 1], gap) << "naming " << i;
  }
  EXPECT_EQ(gap, StreamAges::kMostRenameFrees) << "the gap never reached its longest";
  // Now the handle names another stream: found within the longest gap, young again, and the
  // new entry starts over (a steady stream after it is named kRenameFrees frees in again).
  std::uint32_t until = 0;
  while (!ages.note_free(kA, [] { return std::uint64_t{2}; }).young) ++until;
  EXPECT_LT(until, StreamAges::kMostRenameFrees);
  EXPECT_FALSE(ages.steady(kA));
  (void)young_frees(ages, kA, 2);
  ASSERT_TRUE(ages.steady(kA));
  until = 0;
  while (!ages.note_free(kA, [] { return std::uint64_t{3}; }).young) ++until;
  EXPECT_LT(until, StreamAges::kRenameFrees);
}

TEST(StreamAges, ANewStreamNeverTakesASteadyEntryWhileAnotherIsFree) {
  StreamAges ages;
  (void)young_frees(ages, kA, 1);
  ASSERT_TRUE(ages.steady(kA));
  // More new streams than the table holds, each freed on once.
  for (StreamKey key = 0x10000; key < 0x10000 + 4 * StreamAges::kTracked * 0x100; key += 0x100) {
    EXPECT_TRUE(ages.note_free(key, [] { return 9; }).young);
  }
  EXPECT_TRUE(ages.steady(kA)) << "a new stream replaced the steady one";
}

// Reproducible pseudo-random draws (a linear congruential generator's high bits).
struct Draws {
  std::uint64_t seed;
  std::uint64_t operator()() noexcept {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return seed >> 33;
  }
};

// The deallocation's slow path takes steady(key) from note_free()'s answer: they agree after
// every free, through thresholds, renames and entries replaced.
TEST(StreamAges, EachFreesSteadyAnswerIsWhatSteadyAnswersAfterIt) {
  StreamAges ages;
  Draws next{12345};
  std::uint32_t turned_steady = 0;
  std::uint32_t young = 0;
  for (int i = 0; i < 20000; ++i) {
    // Few keys most of the time (they turn steady), now and then one of many (entries replaced).
    const std::uint64_t pick = next();
    const StreamKey key =
        (pick % 8 == 0 ? 0x100000 + (pick % 200) * 0x100 : 0x1000 + (pick % 3) * 0x100);
    const std::uint64_t id =
        next() % 50 == 0 ? next() % 4 + 2 : 1;  // a new stream behind it at times
    const bool was_steady = ages.steady(key);
    const StreamAges::Free free = ages.note_free(key, [id] { return id; });
    ASSERT_EQ(free.steady, ages.steady(key)) << "free " << i;
    if (free.young) ++young;
    if (free.young && free.steady) ++turned_steady;
    if (!free.young) ASSERT_TRUE(was_steady) << "free " << i;
  }
  EXPECT_GT(young, 0u);
  EXPECT_GT(turned_steady, 0u);
}

// steady_free() is note_free()'s common case inline: a table that tries it first answers every
// free, names streams at the same frees and says steady() the same as one that only takes
// note_free(), through renames, evictions past kTracked and keys that come and go.
TEST(StreamAges, SteadyFreeCountsAsNoteFreeDoesAndChangesNothingWhenItDeclines) {
  StreamAges both;
  StreamAges plain;
  Draws next{777};
  std::uint32_t inline_frees = 0;
  std::uint32_t named_both = 0;
  std::uint32_t named_plain = 0;
  std::array<bool, 100> rare_keys_seen{};
  for (int i = 0; i < 200000; ++i) {
    const std::uint64_t pick = next();
    // Mostly a few keys (steady, renamed at their gaps); now and then one of 100 (more than
    // the table holds: entries replaced).
    const bool rare = pick % 16 == 0;
    const std::uint64_t rare_key = next() % 100;
    if (rare) rare_keys_seen[rare_key] = true;
    const StreamKey key = rare ? 0x100000 + rare_key * 0x100 : 0x1000 + (pick % 3) * 0x100;
    const std::uint64_t id = next() % 400 == 0 ? next() % 4 + 2 : 1;
    StreamAges::Free got{false, true};
    if (both.steady_free(key)) {
      ++inline_frees;
    } else {
      got = both.note_free(key, [&] { return ++named_both, id; });
    }
    const StreamAges::Free want = plain.note_free(key, [&] { return ++named_plain, id; });
    ASSERT_EQ(got.young, want.young) << "free " << i;
    ASSERT_EQ(got.steady, want.steady) << "free " << i;
    ASSERT_EQ(named_both, named_plain) << "free " << i;
    if (i % 64 == 0) {
      for (std::uint64_t k = 0; k < 100; ++k) {
        ASSERT_EQ(both.steady(0x100000 + k * 0x100), plain.steady(0x100000 + k * 0x100));
      }
      for (std::uint64_t k = 0; k < 3; ++k) {
        ASSERT_EQ(both.steady(0x1000 + k * 0x100), plain.steady(0x1000 + k * 0x100));
      }
    }
  }
  EXPECT_GT(inline_frees, 10000u) << "the inline case is the common one";
  EXPECT_GT(named_plain, 100u) << "renames and new entries were exercised";
  EXPECT_GT(
      static_cast<std::size_t>(std::count(rare_keys_seen.begin(), rare_keys_seen.end(), true)),
      StreamAges::kTracked)
      << "more keys than the table holds: entries were replaced";
}

// steady_free() names the last key as note_free() does: a young stream's next free after a
// steady one's counts as coming back (kSteadyFrees), also when steady() moved the table's
// last-found entry in between without a free.
TEST(StreamAges, SteadyFreeLeavesTheLastKeyAsNoteFreeDoes) {
  StreamAges both;
  StreamAges plain;
  const StreamKey steady_key = 0x1000;
  const StreamKey young_key = 0x2000;
  auto free_on = [&](StreamKey key, std::uint64_t id) {
    StreamAges::Free got{false, true};
    if (!both.steady_free(key)) got = both.note_free(key, [id] { return id; });
    const StreamAges::Free want = plain.note_free(key, [id] { return id; });
    EXPECT_EQ(got.young, want.young);
    EXPECT_EQ(got.steady, want.steady);
    return want;
  };
  for (std::uint32_t i = 0; i <= StreamAges::kLoneSteadyFrees; ++i) free_on(steady_key, 1);
  ASSERT_TRUE(plain.steady(steady_key));
  for (int i = 0; i < 3; ++i) free_on(young_key, 2);
  // steady() finds the steady key's entry without a free; then a free on it (note_free()
  // counts it: the young key's free took the hot key from steady_free()).
  ASSERT_TRUE(both.steady(steady_key));
  ASSERT_TRUE(plain.steady(steady_key));
  EXPECT_TRUE(free_on(steady_key, 1).steady);
  std::uint32_t frees = 3;
  while (!free_on(young_key, 2).steady) ASSERT_LT(++frees, StreamAges::kLoneSteadyFrees + 8);
  EXPECT_LE(frees, StreamAges::kSteadyFrees) << "the young key came back after the steady one";
  EXPECT_TRUE(both.steady(young_key));
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
