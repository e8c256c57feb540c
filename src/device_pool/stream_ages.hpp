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
// stream_wants.hpp), and only a steady stream may become a thread heap's home. One exception:
// a young free of a block that a thread heap placed (thread_heap.hpp) goes back to
// its heap tagged with S, with no marker (a heap's ranges have no pending state): like a
// steady stream's, it reaches other streams by a want or a quiesce.
//
// Steady: kSteadyFrees slow-path frees once the thread came back to the stream after freeing
// on another (a stream pool used in turns), else kLoneSteadyFrees (a thread's one stream, a
// stream per request). A
// stream per request is not come back to, so one with up to kLoneSteadyFrees frees stays
// young to its end; a longer one turns steady and its later frees wait for wants or a quiesce.
//
// Counted on the slow path only: a young stream's frees all take it (its key cannot tag the
// thread's cache); a steady one's warm frees are not counted and need not be. Streams that are
// always recordable (the legacy default stream, every cudaStreamPerThread) are never young: a
// marker on them may be recorded later.
//
// The driver gives a destroyed stream's handle to a later stream: the stream behind a handle
// is named (StreamFence::stream_id; the call proves it alive) when its entry starts, when it
// would turn steady and, once steady, after kRenameFrees slow-path frees, the gap doubling with
// each naming that finds the same stream up to kMostRenameFrees and staying there while it
// does (a driver call per 8 frees cost a busy stream more than its frees' own work). So
// streams made and destroyed behind one handle do not add up to a steady one, and a steady
// one's handle given to a new stream makes it young at the next naming: within the gap then
// running (kRenameFrees at first, at most kMostRenameFrees) (with a fence that cannot name
// streams, neither holds). Once it is found, the blocks cached under the key go to their
// tiers and the thread's heap stops serving it (DevicePoolCore::record_young_marker). Until then
// the new stream's frees take the steady path: served by wants, which the handle's next call
// records (its old stream's work has completed: the contract of destroying a stream,
// device_pool.hpp). So the first stream made behind the handle of a long-steady one takes
// that path for up to kMostRenameFrees slow-path frees; those after it meet a young entry.
//
// kTracked entries; a new stream takes an empty entry, else a young one found from a point that
// moves pseudo-randomly (a steady one only when all are steady), so streams made per request
// replace each other and most of a pool of streams used in turns, even past kTracked, turn steady.
//
// The holder's state only (ThreadCache): no stealer reads or writes it.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

#include "tier/stream_key.hpp"

namespace vram::detail {

class StreamAges {
 public:
  static constexpr std::uint32_t kSteadyFrees = 32;
  static constexpr std::uint32_t kLoneSteadyFrees = 48;
  static constexpr std::uint32_t kRenameFrees = 8;
  static constexpr std::uint32_t kMostRenameFrees = 256;
  static_assert(kRenameFrees <= kMostRenameFrees);
  static constexpr std::size_t kTracked = 64;

  // A caller's stream that a marker may not be recorded on later (note_free() may find it young).
  static bool caller_stream(StreamKey key) noexcept {
    return key != kUntagged && !always_recordable(key);
  }
  // What note_free() found: `young`, the stream was not steady before this free (its marker
  // is wanted); `steady`, what steady(key) answers after it (the free that turns a stream
  // steady is young and steady).
  struct Free {
    bool young;
    bool steady;
  };
  // Counts a slow-path free on `key`'s caller stream. `id_of()` names the stream behind the
  // handle now (StreamFence::stream_id, 0: unknown), asked when a key starts, when it would
  // turn steady and at a steady one's slow-path frees kRenameFrees, then twice as many (to
  // kMostRenameFrees) apart: another stream behind the handle by then starts again (young).
  template <class IdOf>
  Free note_free(StreamKey key, IdOf id_of) noexcept {
    settle_hot();
    ++tick_;
    const bool switched = key != last_key_;
    last_key_ = key;
    if (Entry* found = find(key)) {
      Entry& e = *found;
      if (e.steady) {
        if (++e.frees < e.rename_at) [[likely]] {
          make_hot(e);
          return {false, true};
        }
        const std::uint64_t id = id_of();
        if (id == e.id) {
          e.frees = 0;
          e.rename_at = std::min(2 * e.rename_at, kMostRenameFrees);
          make_hot(e);
          return {false, true};
        }
        e = Entry{key, id, 1, false, false};  // a new stream behind the handle
        return {true, false};
      }
      e.came_back = e.came_back || switched;
      if (++e.frees >= (e.came_back ? kSteadyFrees : kLoneSteadyFrees)) {
        const std::uint64_t id = id_of();
        if (id != e.id) {
          e = Entry{key, id, 1, false, false};  // not the stream it counted
        } else {
          e.steady = true;  // from its next free on
          e.frees = 0;      // counts to the next naming from here
          make_hot(e);
        }
      }
      return {true, e.steady};
    }
    Entry* e = victim();
    *e = Entry{key, id_of(), 1, false, false};
    last_index_ = static_cast<std::uint32_t>(e - entries_.data());
    return {true, false};
  }
  // note_free()'s most common case, inline: `key` is the steady stream note_free() counted
  // last, not due a naming at this free. True: counted as note_free() counts it ({false,
  // true}); false: nothing changed (call note_free()).
  bool steady_free(StreamKey key) noexcept {
    if (key != hot_key_ || hot_left_ <= 1) return false;
    --hot_left_;
    return true;
  }
  // Whether `key` may be the thread's heap's home: no stream, one always recordable, or
  // steady. (Whether a free's stream may tag the thread's cache comes from note_free or
  // steady_free on the slow path.)
  bool steady(StreamKey key) noexcept {
    if (!caller_stream(key)) return true;
    const Entry* e = find(key);
    return e != nullptr && e->steady;
  }
  // The thread's table starts afresh (a cache adopted by another thread).
  void clear() noexcept { *this = StreamAges{}; }

 private:
  struct Entry {
    StreamKey key = kUntagged;
    std::uint64_t id = 0;
    std::uint32_t frees = 0;
    bool came_back = false;  // freed on again after a free on another stream
    bool steady = false;
    std::uint32_t rename_at = kRenameFrees;  // steady: slow-path frees to the next naming
  };
  // `key`'s entry, or null. A thread frees on one stream most of the time: the entry found
  // last is asked first, so those frees read one entry instead of the table.
  Entry* find(StreamKey key) noexcept {
    if (entries_[last_index_].key == key) return &entries_[last_index_];
    for (std::uint32_t i = 0; i < kTracked; ++i) {
      if (entries_[i].key == key) {
        last_index_ = i;
        return &entries_[i];
      }
    }
    return nullptr;
  }
  // The entry a new key takes: an empty or young one, found from a point that moves
  // pseudo-randomly (streams used in turns past kTracked do not evict each other in the order
  // they come back, so most survive to turn steady); a steady one only when all are.
  Entry* victim() noexcept {
    for (Entry& e : entries_) {
      if (e.key == kUntagged) return &e;
    }
    static_assert(kTracked == 64, "the start below takes 6 bits of the hash");
    const std::size_t from = static_cast<std::size_t>((tick_ * 0x9E3779B97F4A7C15ull) >> 58);
    for (std::size_t i = 0; i < kTracked; ++i) {
      Entry& e = entries_[(from + i) % kTracked];
      if (!e.steady) return &e;
    }
    return &entries_[from];
  }
  // The hot stream: steady_free() counts its frees down in hot_left_ alone (frees to its next
  // naming, rename_at - frees, its entry's frees as of make_hot()); settle_hot() adds what it
  // counted to its entry and the tick before note_free() reads or changes any entry. While
  // hot_key_ is set it is last_key_, and entries_[hot_index_] is its entry, steady.
  void make_hot(const Entry& e) noexcept {
    hot_key_ = e.key;
    hot_index_ = static_cast<std::uint32_t>(&e - entries_.data());
    hot_left_ = e.rename_at - e.frees;
  }
  void settle_hot() noexcept {
    if (hot_key_ == kUntagged) return;
    Entry& e = entries_[hot_index_];
    const std::uint32_t counted = e.rename_at - e.frees - hot_left_;
    e.frees += counted;
    tick_ += counted;
    hot_key_ = kUntagged;
  }

  std::array<Entry, kTracked> entries_{};
  std::uint64_t tick_ = 0;
  StreamKey last_key_ = kUntagged;
  std::uint32_t last_index_ = 0;  // the entry find() returned or victim() filled last
  StreamKey hot_key_ = kUntagged;
  std::uint32_t hot_index_ = 0;
  std::uint32_t hot_left_ = 0;
};

}  // namespace vram::detail
