// src/device_pool/young_streams.hpp: the streams a thread has freed blocks on only a few
// times so far.
//
// A stream that lives for a few calls (created for one request, synchronized and destroyed
// when it is done) is not seen again after its last free: the blocks freed on it would
// reach other streams only after a device-wide quiesce (stream_wants.hpp). So a
// deallocate_async on a young stream, one of the first kYoungFrees frees this thread made on
// it, also records a marker on it (DevicePoolCore::mark_stream_frees; the call proves the
// stream alive), and its blocks reach any stream once that marker completes. A stream that
// stays (a thread's own, a decode loop's) soon ages: its frees record nothing, and another
// stream that needs its blocks wants a marker, which its next call records.
//
// Per thread: the last kSlots streams freed on, with their counts. A stream that dropped out
// of the table is young again. A handle the driver gives a new stream continues the count of
// the destroyed one: its calls serve wants as the old stream's would.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "tier/stream_key.hpp"

namespace vram::detail {

class YoungStreams {
 public:
  static constexpr std::uint32_t kYoungFrees = 64;
  static constexpr std::size_t kSlots = 8;

  // Counts a free on `key` (a caller's stream: not always_recordable); true while the
  // stream is young.
  bool note_free(StreamKey key) noexcept {
    if (slots_[last_].key == key) [[likely]]
      return count(slots_[last_]);
    for (std::size_t i = 0; i < kSlots; ++i) {
      if (slots_[i].key == key) {
        last_ = i;
        return count(slots_[i]);
      }
    }
    next_ = (next_ + 1) % kSlots;  // the oldest entry goes
    slots_[next_] = Slot{key, 0};
    last_ = next_;
    return count(slots_[next_]);
  }

 private:
  struct Slot {
    StreamKey key = kUntagged;
    std::uint32_t frees = 0;
  };
  static bool count(Slot& slot) noexcept {
    if (slot.frees >= kYoungFrees) return false;
    ++slot.frees;
    return true;
  }
  std::array<Slot, kSlots> slots_{};
  std::size_t last_ = 0;
  std::size_t next_ = 0;
};

// The calling thread's table (every pool's: a stream's age does not depend on the pool).
inline thread_local YoungStreams tl_young_streams;

}  // namespace vram::detail
