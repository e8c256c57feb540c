// src/device_pool/stream_ages.hpp: which caller streams one thread frees on long enough to call
// them steady; the others are young (a stream per request, destroyed after it).
//
// Rule (DevicePool::deallocate_async on a young stream S): the call first records a marker on
// S (after the work its caller queued on the block), then the block goes to its tier, never to
// a thread cache or heap, and is filed there pending under that marker
// (SegmentTier::free_keeping): at no moment is it free under S's tag alone, which only a
// quiesce could give to other streams once S is gone. So whatever S's caller does next
// (destroy S), S's freed blocks reach other streams once that marker completed, with no
// device-wide synchronize. A steady stream's frees keep the warm path (no marker; one is
// wanted when another stream needs the memory and recorded by S's next call,
// stream_wants.hpp), and only a steady stream may become a thread heap's home.
//
// Steady: kSteadyFrees slow-path frees while the thread has freed on no other caller stream (a
// thread's one stream), or after it came back to the stream from another (a stream pool used
// in turns); else kLoneSteadyFrees. A stream per request is not come back to, so from the
// thread's second stream on one with up to kLoneSteadyFrees frees stays young to its end (a
// longer one turns steady and its later frees wait for wants or a quiesce; so does a first
// stream past kSteadyFrees).
//
// Counted on the slow path only: a young stream's frees all take it (its key cannot tag the
// thread's cache); a steady one's warm frees are not counted and need not be. Streams that are
// always recordable (the legacy default stream, every cudaStreamPerThread) are never young: a
// marker on them may be recorded later.
//
// The driver gives a destroyed stream's handle to a later stream: the stream behind a handle
// is named (StreamFence::stream_id; the call proves it alive) when its entry starts and when it
// would turn steady, so streams made and destroyed behind one handle never add up to a steady
// one (with a fence that cannot name streams they may). A steady stream's warm frees are not
// named: one destroyed and followed by another behind its handle keeps the warm path, and its
// frees are served by wants, which the handle's next call records (its old stream's work has
// completed: the contract of destroying a stream, device_pool.hpp).
//
// kTracked entries; a new stream replaces the young entry used longest ago (a steady one only
// when all are steady), so a pool of up to kTracked streams used in turns turns steady, and
// streams made per request replace each other.
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
  static constexpr std::uint32_t kLoneSteadyFrees = 64;
  static constexpr std::size_t kTracked = 64;

  // A caller's stream that a marker may not be recorded on later (young() may answer true).
  static bool caller_stream(StreamKey key) noexcept {
    return key != kUntagged && !always_recordable(key);
  }
  // Counts a slow-path free on `key`'s caller stream; true when the stream is young (it was
  // not steady before this free). `id_of()` names the stream behind the handle now
  // (StreamFence::stream_id, 0: unknown), asked when a key starts and when it would turn
  // steady: another stream behind the handle by then starts again (young).
  template <class IdOf>
  bool note_free(StreamKey key, IdOf id_of) noexcept {
    ++tick_;
    const bool switched = key != last_key_;
    last_key_ = key;
    Entry* victim = nullptr;
    for (Entry& e : entries_) {
      if (e.key == key) {
        if (e.steady) return false;
        e.last = tick_;
        e.came_back = e.came_back || switched;
        if (++e.frees >= (e.came_back || !others_seen_ ? kSteadyFrees : kLoneSteadyFrees)) {
          const std::uint64_t id = id_of();
          if (id != e.id) {
            e = Entry{key, id, 1, tick_, false, false};  // not the stream it counted
          } else {
            e.steady = true;  // from its next free on
          }
        }
        return true;
      }
      if (victim == nullptr || older_victim(e, *victim)) victim = &e;
    }
    others_seen_ = others_seen_ || tick_ > 1;  // a caller stream was freed on before
    *victim = Entry{key, id_of(), 1, tick_, false, false};
    return true;
  }
  // Whether `key` may tag the thread's cache or be its heap's home: no stream, one always
  // recordable, or steady.
  bool steady(StreamKey key) const noexcept {
    if (!caller_stream(key)) return true;
    for (const Entry& e : entries_) {
      if (e.key == key) return e.steady;
    }
    return false;
  }
  // The thread's table starts afresh (a cache adopted by another thread).
  void clear() noexcept { *this = StreamAges{}; }

 private:
  struct Entry {
    StreamKey key = kUntagged;
    std::uint64_t id = 0;
    std::uint32_t frees = 0;
    std::uint64_t last = 0;  // tick_ of its latest counted free
    bool came_back = false;  // freed on again after a free on another stream
    bool steady = false;
  };
  // `e` is replaced before `victim`: young before steady, then the one used longest ago.
  static bool older_victim(const Entry& e, const Entry& victim) noexcept {
    if (e.steady != victim.steady) return !e.steady;
    return e.last < victim.last;
  }
  std::array<Entry, kTracked> entries_{};
  std::uint64_t tick_ = 0;
  StreamKey last_key_ = kUntagged;
  bool others_seen_ = false;  // frees on more than one caller stream key
};

}  // namespace vram::detail
