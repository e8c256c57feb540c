// vram/reserve_observer.hpp: told when memory joins a DevicePool's reserved set and before
// it leaves it (DevicePoolOptions::observer).
//
// A unit of reserved memory is what one upstream call or one map takes: a segment from the
// upstream (cudaMalloc), or a run of granules mapped at once by the virtual-memory large
// tier or a sleep tag (one cuMemCreate + cuMemMap). A unit always goes back whole (one
// upstream deallocation, one unmap), so every giving_back() names exactly a span an earlier
// reserved() named, and spans never overlap while both are reserved.
//
//   reserved(span)     after the upstream call or the map succeeded, before any block of
//                      the span is handed out.
//   giving_back(span)  before the upstream deallocation or the unmap, after the pool took
//                      the span off its books: no block of it is live or handed out again,
//                      and the memory is still valid during the call.
//
// Both run on the thread that grows or gives back (any thread calling the pool, trim(),
// destruction), possibly under the pool's internal locks: an observer must not call the
// pool, must not block on another thread that may call it, and must not throw (noexcept).
// Calls for different spans may come from several threads at once.
#pragma once

#include <cstddef>
#include <cstdint>

namespace vram {

struct ReservedSpan {
  std::uintptr_t address = 0;
  std::size_t bytes = 0;
  bool virtual_memory = false;  // granules mapped (the large tier's or a sleep tag's)
};

class ReserveObserver {
 public:
  ReserveObserver() = default;
  ReserveObserver(const ReserveObserver&) = delete;
  ReserveObserver& operator=(const ReserveObserver&) = delete;
  virtual ~ReserveObserver() = default;
  virtual void reserved(const ReservedSpan& span) noexcept = 0;
  virtual void giving_back(const ReservedSpan& span) noexcept = 0;
};

}  // namespace vram
