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
// Per thread: a table of kSlots streams freed on, by a hash of the handle, with their
// counts. A stream whose slot another took since is young again. A handle the driver gives
// a new stream continues the count of the destroyed one: its calls serve wants as the old
// stream's would.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "tier/stream_key.hpp"

namespace vram::detail {

class YoungStreams {
 public:
  static constexpr std::uint32_t kYoungFrees = 64;
  static constexpr std::size_t kSlots = 64;  // a power of two

  // Counts a free on `key` (a caller's stream: not always_recordable); true while the
  // stream is young.
  bool note_free(StreamKey key) noexcept {
    Slot& slot = slots_[(key * 0x9E3779B97F4A7C15ull) >> 58 & (kSlots - 1)];
    if (slot.key != key) [[unlikely]]
      slot = Slot{key, 0};  // a stream not seen lately (or one sharing its slot) is young
    if (slot.frees >= kYoungFrees) [[likely]]
      return false;
    ++slot.frees;
    return true;
  }

 private:
  struct Slot {
    StreamKey key = kUntagged;
    std::uint32_t frees = 0;
  };
  std::array<Slot, kSlots> slots_{};
};

// The calling thread's table (every pool's: a stream's age does not depend on the pool).
inline thread_local YoungStreams tl_young_streams;

}  // namespace vram::detail
