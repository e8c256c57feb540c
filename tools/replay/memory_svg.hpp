// memory_svg.hpp: the memory picture of `vram replay --svg FILE`: for each trace, the bytes
// each allocator reserved over the trace's events and the bytes the trace kept live, one
// panel per trace, one line per allocator, in one standalone SVG file.
//
// Rules: every allocator of a panel is drawn against the same axes (events 0..the trace's
// last; bytes 0..the panel's largest reserved or live value); the live line is the trace's
// own (the same for every allocator), drawn dashed; names are escaped for XML.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "replay/replay.hpp"

namespace vram::replay {

struct AllocatorSeries {
  std::string allocator;
  std::vector<MemorySample> samples;  // in event order
};

struct TracePicture {
  std::string trace;
  std::size_t events = 0;
  std::vector<AllocatorSeries> series;  // one per allocator, in the report's order
};

// A standalone SVG document of the panels, top to bottom.
std::string memory_svg(const std::vector<TracePicture>& pictures);

}  // namespace vram::replay
