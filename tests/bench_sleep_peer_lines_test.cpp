// The sleep scenario's reading of bench/torch_sleep.py's --lines output
// (tools/bench/sleep_peer_lines.hpp): the lines as its _print_lines writes them, an absent or
// failed peer, missing parts and steps, and lines of other output in between.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "bench/sleep_peer_lines.hpp"

namespace vram::bench {
namespace {

const std::vector<std::string> kParts = {"weights", "weights_asleep", "kv", "many"};

// What _print_lines writes for three timed cycles of each part.
std::vector<std::string> printed() {
  return {"BYTES weights 8589934592",
          "BYTES weights_asleep 8589934592",
          "BYTES kv 8589934592",
          "BYTES many 9929453312",
          "SECONDS weights sleep 4.480000000 4.490000000 4.470000000",
          "SECONDS weights wake 1.470000000 1.480000000 1.460000000",
          "SECONDS weights_asleep sleep 4.400000000 4.410000000 4.420000000",
          "SECONDS weights_asleep wake 1.400000000 1.410000000 1.420000000",
          "SECONDS kv sleep 0.005000000 0.005100000 0.004900000",
          "SECONDS kv wake 0.000700000 0.000680000 0.000690000",
          "SECONDS many sleep 6.100000000 6.200000000 6.300000000",
          "SECONDS many wake 2.100000000 2.200000000 2.300000000"};
}

TEST(BenchSleepPeerLines, ThePrintedLinesGiveEveryPartBytesAndBothSteps) {
  std::vector<std::string> lines = printed();
  lines.insert(lines.begin() + 2, "a warning the package printed");
  const SleepPeerLines peer = read_sleep_peer_lines(lines);
  EXPECT_TRUE(peer.absent.empty());
  ASSERT_TRUE(peer.complete(kParts));
  EXPECT_EQ(peer.bytes.at("many"), 9929453312U);
  EXPECT_EQ(peer.parts.at("weights_asleep").wake_s, (std::vector<double>{1.40, 1.41, 1.42}));
  EXPECT_EQ(peer.parts.at("kv").sleep_s.size(), 3U);
  EXPECT_EQ(peer.last, "a warning the package printed");
}

TEST(BenchSleepPeerLines, AnAbsentOrFailedPeerSaysWhy) {
  const SleepPeerLines absent =
      read_sleep_peer_lines({"ABSENT torch_memory_saver is not installed (No module)"});
  EXPECT_EQ(absent.absent, "torch_memory_saver is not installed (No module)");
  EXPECT_FALSE(absent.complete(kParts));
  const SleepPeerLines failed =
      read_sleep_peer_lines({"BYTES weights 1", "ERROR RuntimeError('x')"});
  EXPECT_EQ(failed.absent, "its run failed: RuntimeError('x')");
}

TEST(BenchSleepPeerLines, AMissingPartOrStepIsIncomplete) {
  for (std::size_t drop = 0; drop < printed().size(); ++drop) {
    std::vector<std::string> lines = printed();
    lines.erase(lines.begin() + static_cast<std::ptrdiff_t>(drop));
    EXPECT_FALSE(read_sleep_peer_lines(lines).complete(kParts)) << "without " << printed()[drop];
  }
  std::vector<std::string> uneven = printed();
  uneven[5] = "SECONDS weights wake 1.47";  // fewer wakes than sleeps
  EXPECT_FALSE(read_sleep_peer_lines(uneven).complete(kParts));
  std::vector<std::string> odd_step = printed();
  odd_step[5] = "SECONDS weights nap 1.47 1.48 1.46";  // not a step: kept as another line
  const SleepPeerLines peer = read_sleep_peer_lines(odd_step);
  EXPECT_FALSE(peer.complete(kParts));
  EXPECT_EQ(peer.last, odd_step[5]);
}

}  // namespace
}  // namespace vram::bench
