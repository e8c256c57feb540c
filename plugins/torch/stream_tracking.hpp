// stream_tracking.hpp: blocks used on other streams than their allocation stream
// (tensor.record_stream), per device.
//
// Invariants:
// - A block with recorded streams reaches the pool only after an event recorded at its
//   free on each of those streams (other than the allocation stream) has completed; then
//   it is released with its allocation stream, so the pool's own stream-ordered rule
//   covers that stream.
// - A stream whose event cannot be made or recorded is synchronized at the free instead,
//   so no recorded stream is ever left unordered.
// - A recorded stream being captured at the free (its event would be a node of the graph,
//   never completed) gets its event once it is no longer captured, at a release(); until
//   then the block stays held (PyTorch defers such events the same way). Such a stream is
//   never synchronized.
// - A block of a MemPool's own allocator (`foreign`) follows the same rules and goes back to
//   its ForeignPool instead of the pool; the held record keeps that ForeignPool alive.
// - recorded() and held_blocks() mirror the sizes of the containers under the mutex, so
//   the warm path (nothing recorded, nothing held back) reads one relaxed atomic and takes
//   no lock.
// - Events come from the device's vram::cuda::EventPool and return to it once completed;
//   they are observed in relaxed capture mode (src/cuda/event_pool.hpp).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cuda/event_pool.hpp"
#include "foreign_pool.hpp"
#include "vram/device_pool.hpp"

namespace vram_torch {

class StreamTracking {
 public:
  StreamTracking(int device, vram::DevicePool& pool)
      : device_(device), pool_(pool), events_(device) {}
  StreamTracking(const StreamTracking&) = delete;
  StreamTracking& operator=(const StreamTracking&) = delete;

  // record_stream: `stream` uses the live block `ptr`. Throws std::bad_alloc.
  void record(void* ptr, cudaStream_t stream);

  // At the free of `ptr` (`size` requested, `bytes` counted at its allocation, allocated on
  // `stream`): true when the block is held back (the pool, or `foreign` when the block is
  // one of its blocks, gets it from release()); false when the caller hands it back now.
  bool hold_back(void* ptr, std::size_t size, std::size_t bytes, cudaStream_t stream,
                 const std::shared_ptr<ForeignPool>& foreign = nullptr) noexcept {
    if (recorded_.load(std::memory_order_acquire) == 0) return false;
    return hold_back_recorded(ptr, size, bytes, stream, foreign);
  }

  // Hands every held-back block whose events have all completed to its owner (the pool or
  // its ForeignPool). `wait`: waits for the events instead (memory is short, or
  // empty_cache); a block whose recorded stream is still captured stays held either way.
  // Without `wait`, a thread that finds another one releasing returns at once. Returns the
  // blocks released.
  std::size_t release(bool wait) noexcept;

  std::size_t held_blocks() const noexcept { return held_count_.load(std::memory_order_relaxed); }
  std::uint64_t held_bytes() const noexcept { return held_bytes_.load(std::memory_order_relaxed); }

 private:
  // A freed block still used by other streams: reusable once every event has completed.
  struct HeldBack {
    void* ptr;
    std::size_t size;
    std::size_t bytes;  // the block's bytes, as held_bytes() counts them
    cudaStream_t alloc_stream;
    std::vector<cudaEvent_t> events;
    std::vector<cudaStream_t> captured;    // captured at the free: no event recorded yet
    std::shared_ptr<ForeignPool> foreign;  // null: the pool's block
  };

  bool hold_back_recorded(void* ptr, std::size_t size, std::size_t bytes, cudaStream_t stream,
                          const std::shared_ptr<ForeignPool>& foreign) noexcept;
  // Under mutex_ (or on a record no other thread sees yet), device_ current: records the
  // event of each stream of `held.captured` that is no longer captured (one that cannot have
  // an event recorded is synchronized); true when none is left.
  bool record_uncaptured(HeldBack& held) noexcept;
  // The streams recorded for the live block `ptr`, forgotten here (empty: none).
  std::vector<cudaStream_t> take_recorded(void* ptr) noexcept;

  const int device_;
  vram::DevicePool& pool_;
  vram::cuda::EventPool events_;
  std::mutex mutex_;  // guards streams_of_ and held_back_
  std::unordered_map<void*, std::vector<cudaStream_t>> streams_of_;  // live blocks only
  std::vector<HeldBack> held_back_;
  std::atomic<std::size_t> recorded_{0};    // streams_of_.size()
  std::atomic<std::size_t> held_count_{0};  // held_back_.size()
  std::atomic<std::uint64_t> held_bytes_{0};
};

}  // namespace vram_torch
