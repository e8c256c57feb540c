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
// slot 0 only (a stream aged there, not due for an identity check, is the whole check). A
// miss moves or inserts the stream to slot 0 and evicts the least recently freed on; an
// evicted stream is young again when it comes back (a few fenced frees more, never a lost
// fence).
//
// Handles: the driver may give a destroyed stream's handle to a new stream, which would
// continue the old stream's count. So the table also keeps each stream's identity (the
// fence's identity_of, cudaStreamGetId: never reused), read at every young free and every
// kCheckEvery-th aged free: a new identity under a handle makes the stream young again and
// marks the handle churning; a churning handle's every free reads the identity (out of
// line; streams made per request cost far more than that) until kSettledFrees frees of one
// identity. Where the fence cannot tell (0), a recycled handle keeps its count, and once
// aged its frees wait, as before, for a call on that handle or a quiesce.
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
  static constexpr std::uint32_t kCheckEvery = 64;
  static constexpr std::uint32_t kSettledFrees = 4096;
  static constexpr std::size_t kSlots = 16;

  // The warm test: `key` is the stream this thread freed on last, aged, its handle not
  // churning and no identity check due (counts the free toward the next check).
  bool aged_front(StreamKey key) noexcept {
    Slot& s = slots_[0];
    return s.key == key && s.frees >= kYoungFrees && !s.churning && --s.until_check != 0;
  }
  // One free on `key` (moved to slot 0, counted); `identity()` is called when a check is
  // due (young, churning, or kCheckEvery aged frees since the last). True when the free is
  // young (it is fenced).
  template <class Identity>
  bool note_free(StreamKey key, Identity identity) noexcept {
    std::size_t i = 0;
    while (i < kSlots && slots_[i].key != key) ++i;
    Slot slot = i < kSlots ? slots_[i] : Slot{key};
    if (i == kSlots) i = kSlots - 1;  // evicts the least recently freed on
    for (; i > 0; --i) slots_[i] = slots_[i - 1];
    if (slot.frees < kYoungFrees || slot.churning || slot.until_check == 0) {
      const std::uint64_t id = identity();
      if (id != 0 && slot.id != 0 && id != slot.id) {  // another stream got the handle
        slot.frees = 0;
        slot.churning = true;
      }
      if (id != 0) slot.id = id;
      slot.until_check = kCheckEvery;
    }
    const bool young = slot.frees < kYoungFrees;
    if (slot.frees < kSettledFrees) ++slot.frees;
    if (slot.frees == kSettledFrees) slot.churning = false;
    slots_[0] = slot;
    return young;
  }
  bool note_free(StreamKey key) noexcept {
    return note_free(key, [] { return std::uint64_t{0}; });
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
  bool churning(StreamKey key) const noexcept {
    for (const Slot& s : slots_) {
      if (s.key == key) return s.churning;
    }
    return false;
  }

 private:
  struct Slot {
    StreamKey key = kUntagged;
    std::uint32_t frees = 0;
    std::uint32_t until_check = kCheckEvery;  // aged frees until the next identity check
    std::uint64_t id = 0;                     // the identity last read (0: none)
    bool churning = false;                    // the handle changed streams
  };
  Slot slots_[kSlots];
};

// The calling thread's table (device_pool.cpp).
YoungStreams& thread_young_streams() noexcept;

}  // namespace vram::detail
