// src/tier/contention_watch.hpp: whether a tier's mutex was contended between two of one
// thread's calls into the tier (TierMutex::contentions(), read after each call).
//
// A count that did not change writes nothing: a thread alone on a tier reads it after every
// call. Not thread-safe: the owning thread's state.
#pragma once

#include <cstdint>

namespace vram::detail {

class ContentionWatch {
 public:
  // True when `count` differs from the count of this thread's last call (none before its
  // first call, or since reset()).
  bool moved(std::uint32_t count) noexcept {
    if (count == seen_) [[likely]]
      return false;
    const bool before = seen_ != kNotSeen;
    seen_ = count;
    return before;
  }
  // Counting starts again from the next call (a new thread's).
  void reset() noexcept { seen_ = kNotSeen; }

 private:
  static constexpr std::uint64_t kNotSeen = ~std::uint64_t{0};  // no count yet
  std::uint64_t seen_ = kNotSeen;
};

}  // namespace vram::detail
