// The sleep scenario's reading of its Python peer's lines (sleep_peer_lines.hpp).
#include "bench/sleep_peer_lines.hpp"

#include <sstream>

namespace vram::bench {

bool SleepPeerLines::complete(const std::vector<std::string>& names) const {
  for (const std::string& name : names) {
    const auto part = parts.find(name);
    if (part == parts.end() || bytes.find(name) == bytes.end() || part->second.sleep_s.empty() ||
        part->second.sleep_s.size() != part->second.wake_s.size()) {
      return false;
    }
  }
  return true;
}

SleepPeerLines read_sleep_peer_lines(const std::vector<std::string>& lines) {
  SleepPeerLines peer;
  for (const std::string& line : lines) {
    std::istringstream in(line);
    std::string kind;
    in >> kind;
    if (kind == "ABSENT" || kind == "ERROR") {
      std::string rest;
      std::getline(in, rest);
      const std::size_t text = rest.find_first_not_of(' ');
      rest = text == std::string::npos ? "" : rest.substr(text);
      peer.absent = kind == "ABSENT" ? rest : "its run failed: " + rest;
      return peer;
    }
    std::string part;
    std::string step;
    if (kind == "BYTES") {
      std::size_t bytes = 0;
      if (in >> part >> bytes) peer.bytes[part] = bytes;
    } else if (kind == "SECONDS" && in >> part >> step && (step == "sleep" || step == "wake")) {
      std::vector<double>& into =
          step == "sleep" ? peer.parts[part].sleep_s : peer.parts[part].wake_s;
      for (double seconds = 0; in >> seconds;) into.push_back(seconds);
    } else if (!line.empty()) {
      peer.last = line;
    }
  }
  return peer;
}

}  // namespace vram::bench
