// tools/bench/sleep_peer_lines.hpp: the lines bench/torch_sleep.py's child prints with
// --lines (its _print_lines), read back by the sleep scenario.
//
// The lines: `ABSENT <text>` or `ERROR <text>` (nothing measured), else `BYTES <part> <n>` per
// part and `SECONDS <part> <sleep|wake> <s> <s> ...` per part and step; any other line is kept
// as the last one seen (for a message when results are missing).
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

namespace vram::bench {

// Seconds of each timed cycle of one part, sleep and wake.
struct CycleTimes {
  std::vector<double> sleep_s;
  std::vector<double> wake_s;
};

struct SleepPeerLines {
  std::map<std::string, CycleTimes> parts;
  std::map<std::string, std::size_t> bytes;
  std::string absent;  // the text of ABSENT or "its run failed: " and that of ERROR; "": none
  std::string last;    // the last other line
  // Every part of `names` has its bytes and both steps' times, the same count of each.
  bool complete(const std::vector<std::string>& names) const;
};

SleepPeerLines read_sleep_peer_lines(const std::vector<std::string>& lines);

}  // namespace vram::bench
