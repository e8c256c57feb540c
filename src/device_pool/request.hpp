// src/device_pool/request.hpp: one DevicePool allocate or deallocate, computed once where the call
// enters the core (DevicePoolCore::request_of) and carried down unchanged.
//
// Rule: nothing below the entry recomputes a size class, a rounding or a tier; a tier is
// handed block_bytes, already rounded to its granularity (SegmentTier asserts it).
#pragma once

#include <cstddef>

#include "tier/stream_key.hpp"

namespace vram::detail {

class SegmentTier;

struct Request {
  std::size_t bytes = 0;        // as the caller asked: 1 .. SizeClasses::kMaxBytes
  std::size_t block_bytes = 0;  // what the block holds and the counters count: a small
                                // class's bytes rounded to 256, else the large tier's rounding
  std::size_t index = 0;        // the size class (small requests only)
  SegmentTier* tier = nullptr;  // the tier the block is carved from
  StreamKey key = kUntagged;    // the caller's stream; kUntagged: none
  bool small = false;           // bytes <= small_max: cached per class (bins, rings)
};

}  // namespace vram::detail
