// src/device_pool/young_streams.hpp: the caller streams a thread has freed on only a few times
// (young), whose frees are fenced at once.
//
// Why: a stream-ordered free on a caller's stream leaves its range tagged with the stream,
// and a marker for it is recorded only inside a later call that passes the stream
// (stream_wants.hpp). A stream that is created, used for a few requests, synchronized and
// destroyed is never passed again: its frees wait for a device-wide quiesce. So while a
// stream is young for the calling thread (its first kYoungFrees frees seen by the thread),
// each of its frees goes straight to its tier and a marker is recorded on the stream right
// after it, in the same call (which proves the stream alive): once the marker completes the
// range serves every stream, with no quiesce. A stream that stays (more than kYoungFrees
// frees) costs nothing more: its frees take the warm path.
//
// Table: per thread, kSlots streams, most recently freed on first; the warm path reads
// slot 0 only (a stream aged there is the whole check). A miss moves or inserts the stream
// to slot 0 and evicts the least recently freed on; an evicted stream is young again when
// it comes back (a few fenced frees more, never a lost fence).
//
// Limits: a stream handle the driver gives again to a new stream after the old one was
// destroyed keeps its count here (the handle is the key): a new stream on a handle already
// aged in this thread's table is not fenced at its frees and its ranges wait, as before, for
// a call on that handle or a quiesce.
//
// Not thread-safe: one table per thread (thread_local in device_pool.cpp), touched only by
// its thread; no atomic, no lock.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tier/stream_key.hpp"

namespace vram::detail {

class YoungStreams {
 public:
  static constexpr std::uint32_t kYoungFrees = 64;
  static constexpr std::size_t kSlots = 16;

  // The warm test: `key` is the stream this thread freed on last and it is aged.
  bool aged_front(StreamKey key) const noexcept {
    return slots_[0].key == key && slots_[0].frees >= kYoungFrees;
  }
  // One free on `key` (moved to slot 0, counted); true when it was young (the free is fenced).
  bool note_free(StreamKey key) noexcept {
    std::size_t i = 0;
    while (i < kSlots && slots_[i].key != key) ++i;
    Slot slot = i < kSlots ? slots_[i] : Slot{key, 0};
    if (i == kSlots) i = kSlots - 1;  // evicts the least recently freed on
    for (; i > 0; --i) slots_[i] = slots_[i - 1];
    const bool young = slot.frees < kYoungFrees;
    if (young) ++slot.frees;
    slots_[0] = slot;
    return young;
  }
  // `key` aged at once (tests of what a stream that stays does).
  void age(StreamKey key) noexcept {
    while (note_free(key)) {
    }
  }
  // Every stream young again (tests start from a known table).
  void clear() noexcept { *this = YoungStreams{}; }
  // The frees counted for `key` (0: not in the table).
  std::uint32_t frees_of(StreamKey key) const noexcept {
    for (const Slot& s : slots_) {
      if (s.key == key) return s.frees;
    }
    return 0;
  }

 private:
  struct Slot {
    StreamKey key = kUntagged;
    std::uint32_t frees = 0;
  };
  Slot slots_[kSlots];
};

// The calling thread's table (device_pool.cpp).
YoungStreams& thread_young_streams() noexcept;

}  // namespace vram::detail
