// src/device_pool/quiescer.hpp: the device-wide quiesces of one DevicePool (StreamFence::quiesce).
//
// After a quiesce every range freed on a stream before it began is free for all streams,
// with no marker recorded on any stream (a stream may have been destroyed since its frees).
// One quiesce at a time; a caller that read generation() before it looked at the tiers
// skips its own when another began since (quiesce_since: that one covers the same frees).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>

#include "thread_heap.hpp"
#include "tier/segment_tier.hpp"
#include "tier/stream_wants.hpp"
#include "vram/stream_fence.hpp"

namespace vram::detail {

class Quiescer {
 public:
  // The thread heaps over each tier, whose stream ranges a quiesce frees too (only its address is
  // kept: the core makes it after this).
  Quiescer(StreamFence& fence, SegmentTier& small, SegmentTier& large, StreamWants& wants,
           ThreadHeaps& large_heaps, ThreadHeaps& small_heaps) noexcept
      : fence_(fence),
        small_(small),
        large_(large),
        wants_(wants),
        large_heaps_(large_heaps),
        small_heaps_(small_heaps) {}

  // Quiesces begun so far: read it before looking at the tiers, pass it to quiesce_since().
  std::uint64_t generation() const noexcept { return generation_.load(std::memory_order_relaxed); }
  void quiesce() noexcept;
  // A quiesce for stranded stream frees, unless another began after `seen` (false).
  bool quiesce_since(std::uint64_t seen) noexcept;
  std::uint64_t quiesces() const noexcept { return quiesces_.load(std::memory_order_relaxed); }
  std::uint64_t quiesces_for_streams() const noexcept {
    return for_streams_.load(std::memory_order_relaxed);
  }

 private:
  void quiesce_locked() noexcept;

  StreamFence& fence_;
  SegmentTier& small_;
  SegmentTier& large_;
  StreamWants& wants_;
  ThreadHeaps& large_heaps_;
  ThreadHeaps& small_heaps_;
  std::mutex mutex_;  // after the slow path's mutex, before a tier's and the wants' mutex
  std::atomic<std::uint64_t> generation_{0};  // quiesces begun, written under mutex_
  std::atomic<std::uint64_t> quiesces_{0};
  std::atomic<std::uint64_t> for_streams_{0};
};

}  // namespace vram::detail
