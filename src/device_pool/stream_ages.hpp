// src/device_pool/stream_ages.hpp: which caller streams one thread has freed on often enough to
// call them steady; the others are young (a stream per request, destroyed after it).
//
// Rule (DevicePool::deallocate_async on a young stream S): the call first records a marker on
// S (after the work its caller queued on the block), then the block goes to its tier, never to
// a thread cache, and is filed there pending under that marker (SegmentTier::free_keeping): at
// no moment is it free under S's tag alone, which only a quiesce could give to other streams
// once S is gone. So whatever S's caller does next (destroy S), S's freed blocks reach other
// streams once that marker completed, with no device-wide synchronize. A steady stream's frees
// keep the warm path (no marker; one is wanted when another stream needs the memory and
// recorded by S's next call, stream_wants.hpp).
//
// Counted on the slow path only: a young stream's frees all take it (its key cannot tag the
// thread's cache), so it turns steady after kSteadyFrees of them; a steady one's warm frees
// are not counted and need not be. Streams that are always recordable (the legacy default
// stream, every cudaStreamPerThread) are never young: a marker on them may be recorded later.
//
// The driver gives a destroyed stream's handle to a later stream: the stream behind a handle
// is named (StreamFence::stream_id; the call proves it alive) when its entry starts and when it
// would turn steady, so streams made and destroyed behind one handle never add up to a steady
// one. A steady stream's warm frees are not named: one destroyed and followed by another
// behind its handle keeps the warm path, and its frees are served by wants, which the handle's
// next call records (its old stream's work has completed: the contract of destroying a
// stream, device_pool.hpp).
//
// The holder's state only (ThreadCache): no stealer reads or writes it.
#pragma once

#include <array>
#include <cstdint>

#include "tier/stream_key.hpp"

namespace vram::detail {

class StreamAges {
 public:
  static constexpr std::uint32_t kSteadyFrees = 32;
  static constexpr std::size_t kTracked = 8;

  // A caller's stream that a marker may not be recorded on later (young() may answer true).
  static bool caller_stream(StreamKey key) noexcept {
    return key != kUntagged && !always_recordable(key);
  }
  // Counts a slow-path free on `key`'s caller stream; true when the stream is young (before
  // this free it had fewer than kSteadyFrees). `id_of()` names the stream behind the handle
  // now (StreamFence::stream_id, 0: unknown), asked when a key starts and when it would turn
  // steady: another stream behind the handle by then starts again (young). A key not tracked
  // replaces the one with the fewest frees.
  template <class IdOf>
  bool note_free(StreamKey key, IdOf id_of) noexcept {
    Entry* fewest = &entries_[0];
    for (Entry& e : entries_) {
      if (e.key == key) {
        if (e.frees >= kSteadyFrees) return false;
        if (++e.frees == kSteadyFrees) {
          const std::uint64_t id = id_of();
          if (id != e.id) e = Entry{key, id, 1};  // not the stream it counted
        }
        return true;
      }
      if (e.frees < fewest->frees) fewest = &e;
    }
    *fewest = Entry{key, id_of(), 1};
    return true;
  }
  // Whether `key` may tag the thread's cache: no stream, one always recordable, or steady.
  bool steady(StreamKey key) const noexcept {
    if (!caller_stream(key)) return true;
    for (const Entry& e : entries_) {
      if (e.key == key) return e.frees >= kSteadyFrees;
    }
    return false;
  }

 private:
  struct Entry {
    StreamKey key = kUntagged;
    std::uint64_t id = 0;
    std::uint32_t frees = 0;
  };
  std::array<Entry, kTracked> entries_{};
};

}  // namespace vram::detail
