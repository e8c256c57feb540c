// src/tier/stream_wants.hpp: the caller streams whose free ranges another stream's request wants,
// each waiting for the next call that passes the stream itself to record its marker.
//
// Rule (DevicePool never records on a caller's stream outside a call that passes it): the
// pool cannot know whether a stream that freed blocks still exists (its owner may have
// synchronized and destroyed it), and recording an event on a destroyed stream is undefined.
// So a segment tier that needs a marker on such a stream (always_recordable() false) only
// wants it here; the next allocate_async/deallocate_async on that stream, which proves it
// alive, takes the want and records one marker covering every free of the stream that
// reached the tiers before the record (DevicePoolCore::serve_want, holding no tier mutex).
// A stream never seen again keeps its ranges until a device-wide quiesce: growth past the
// budget or to a new peak of reserved bytes that they could serve, the out-of-memory
// retry, trim().
//
// The warm path tests one word, `bits` (a bit per hash of the key, set while some wanted key
// hashes to it), with a relaxed load: a stale clear bit delays a marker, never breaks
// safety; a set bit of another key costs one lookup under the mutex. The wants own the
// word's low kBits bits (kMask); the bits above are its owner's (a DevicePool's other
// checks), and the wants never change them.
//
// Thread-safe: want() runs under a tier's mutex (the mutex here is taken after it, never
// before: no tier call is made while it is held).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "stream_key.hpp"

namespace vram::detail {

class StreamWants {
 public:
  // At most this many keys wait at once; a want beyond it is dropped (its stream's ranges
  // then wait for a quiesce), so streams destroyed with ranges left cannot grow the list.
  static constexpr std::size_t kMaxWanted = 1024;
  static constexpr unsigned kBits = 62;
  static constexpr std::uint64_t kMask = (std::uint64_t{1} << kBits) - 1;

  // `bits`: the word the wants publish to (its low kBits bits are theirs).
  explicit StreamWants(std::atomic<std::uint64_t>& bits) noexcept : bits_(bits) {}
  StreamWants(const StreamWants&) = delete;
  StreamWants& operator=(const StreamWants&) = delete;

  // The bit of `key` in `bits` (one of the low kBits); 0 for a stream that is always
  // recordable (never wanted).
  static std::uint64_t bit_of(StreamKey key) noexcept {
    if (always_recordable(key)) return 0;
    const std::uint64_t hash = (key * 0x9E3779B97F4A7C15ull) >> 32;
    return std::uint64_t{1} << ((hash * kBits) >> 32);
  }

  void want(StreamKey key) noexcept {
    std::lock_guard lock(mutex_);
    if (std::find(keys_.begin(), keys_.end(), key) != keys_.end()) return;
    if (keys_.size() >= kMaxWanted) return;
    try {
      keys_.push_back(key);
    } catch (...) {  // no host memory: the ranges wait for a quiesce
      return;
    }
    ++wanted_;
    publish();
  }
  // True when `key` was wanted (the want is gone: the caller records the marker).
  bool take(StreamKey key) noexcept {
    std::lock_guard lock(mutex_);
    auto it = std::find(keys_.begin(), keys_.end(), key);
    if (it == keys_.end()) return false;
    *it = keys_.back();
    keys_.pop_back();
    publish();
    return true;
  }
  // Every want is dropped (after a quiesce untagged what they were for; a range freed
  // after its mark wants again when another stream needs it).
  void clear() noexcept {
    std::lock_guard lock(mutex_);
    keys_.clear();
    publish();
  }
  // Wants made so far (stats).
  std::uint64_t wanted() const noexcept {
    std::lock_guard lock(mutex_);
    return wanted_;
  }

 private:
  void publish() noexcept {
    std::uint64_t bits = 0;
    for (StreamKey key : keys_) bits |= bit_of(key);
    // Only the wants write the low bits, under mutex_, so a load here reads what the last
    // publish left (the mutex orders it after that one): one exclusive-or turns them into
    // `bits` and leaves the owner's bits as they are.
    const std::uint64_t now = bits_.load(std::memory_order_relaxed) & kMask;
    if (bits != now) bits_.fetch_xor(bits ^ now, std::memory_order_relaxed);
  }

  mutable std::mutex mutex_;
  std::vector<StreamKey> keys_;
  std::uint64_t wanted_ = 0;
  std::atomic<std::uint64_t>& bits_;
};

}  // namespace vram::detail
