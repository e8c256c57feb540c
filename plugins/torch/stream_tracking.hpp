// stream_tracking.hpp: blocks used on other streams than their allocation stream
// (tensor.record_stream), per device.
//
// Invariants:
// - A block with recorded streams reaches the pool only after an event recorded on each of
//   those streams (other than the allocation stream) after its free has completed; then it
//   is released with its allocation stream, so the pool's own stream-ordered rule covers
//   that stream.
// - A recorded stream that is not certainly running its work at the free (being captured:
//   its event would be a node of the graph, never completed; or its state unknown) gets its
//   event at a later release() that finds it running its work; until then the block stays
//   held (PyTorch defers such events the same way). Such a stream is never synchronized.
// - A stream whose event cannot be made or recorded is synchronized instead: at the free, or
//   at a release() that may wait; a release() that may not wait leaves it for the next one.
//   No recorded stream is ever left unordered.
// - An event observed complete after a wait is queried again. One recorded just as another
//   thread began capturing its stream is a node of that graph: the query never reports it
//   complete, and its block stays held for good (memory kept, never handed out early).
// - Without host memory for the bookkeeping, or when the device cannot be made current (the
//   runtime shutting down), the free synchronizes every recorded stream and releases the
//   block (one being captured cannot be synchronized: its capture fails, and the block goes
//   back at once; a null stream is then the current device's).
// - A private pool's block (a MemPool's, a capture's) is held back before its pool may hand
//   it out again: within a capture too, where the graph would order nothing after the
//   recorded streams' work. A block of a MemPool's own allocator (`foreign`) goes back to
//   its ForeignPool, whose reference the held record keeps; a graph pool's block goes
//   through the pool back to its graph pool.
// - Left open: a shared block (allocated outside every private pool) freed during a capture
//   on a stream a route accepts becomes that route's pool's block at once (captured work may
//   use it at every launch) and its recorded streams are forgotten, so that capture may
//   hand it out again before a captured side stream's read of it. The fallback C interface
//   treats every block so while routes are open.
// - recorded_, held_count_ and held_bytes_ mirror the containers under the mutex, so the
//   warm path (nothing recorded, nothing held back) reads one atomic and takes no lock.
//   While a block waits for a capture to end, each allocation's release() that gets the
//   mutex asks the capture state of each such stream.
// - Events come from the device's vram::cuda::EventPool and return to it once completed;
//   they are observed in relaxed capture mode (src/cuda/event_pool.hpp).
// - A held-back block is still its pool's, neither free nor a tensor's: snapshots list it
//   active, not allocated (PyTorch's "active_pending_free"), in its pool's segment (a
//   snapshot taken while it moves to or from held_back_ may show it before or after, or as
//   free memory of the shared pool).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda/event_pool.hpp"
#include "foreign_pool.hpp"
#include "vram/device_pool.hpp"

namespace vram_torch {

// What a snapshot shows of a held-back block besides its address, bytes and stream.
struct HeldBlockShown {
  std::pair<std::uint64_t, std::uint64_t> pool{0, 0};  // c10::MempoolId_t; {0, 0}: shared
  std::shared_ptr<void> context;                       // the allocation's stack, if recorded
};

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
  // `shown`: what a snapshot shows of it while it is held.
  using Shown = HeldBlockShown;
  bool hold_back(void* ptr, std::size_t size, std::size_t bytes, cudaStream_t stream,
                 const std::shared_ptr<ForeignPool>& foreign = nullptr,
                 const Shown& shown = {}) noexcept {
    if (recorded_.load(std::memory_order_acquire) == 0) return false;
    return hold_back_recorded(ptr, size, bytes, stream, take_recorded(ptr), foreign, shown);
  }

  // The streams recorded for the live block `ptr`, forgotten here (none recorded: one load).
  // Taken before a block may reach another owner without hold_back() (a capture's route, or
  // cudaFree), so that none applies to a later block at that address.
  std::vector<cudaStream_t> take(void* ptr) noexcept {
    if (recorded_.load(std::memory_order_acquire) == 0) return {};
    return take_recorded(ptr);
  }
  // As hold_back() for a block that is no MemPool allocator's, with the streams take() gave.
  bool hold_back_taken(void* ptr, std::size_t size, std::size_t bytes, cudaStream_t stream,
                       std::vector<cudaStream_t> recorded, const Shown& shown = {}) noexcept {
    if (recorded.empty()) return false;
    return hold_back_recorded(ptr, size, bytes, stream, std::move(recorded), nullptr, shown);
  }

  // Hands every held-back block whose events have all completed to its owner (the pool or
  // its ForeignPool). `wait`: waits for the events instead (memory is short, or
  // empty_cache); a block whose recorded stream is still captured stays held either way.
  // Without `wait`, a thread that finds another one releasing returns at once. Returns the
  // blocks released.
  std::size_t release(bool wait) noexcept;

  std::size_t held_blocks() const noexcept { return held_count_.load(std::memory_order_relaxed); }
  // The blocks held back now, as a snapshot shows them (a MemPool allocator's blocks are
  // left out: its ForeignPool lists them). Throws std::bad_alloc.
  struct HeldView {
    std::uintptr_t address = 0;
    std::size_t size = 0;           // requested bytes
    std::size_t bytes = 0;          // the block's bytes
    cudaStream_t stream = nullptr;  // the stream it was allocated on
    Shown shown;
  };
  std::vector<HeldView> held() const;
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
    Shown shown;
  };

  bool hold_back_recorded(void* ptr, std::size_t size, std::size_t bytes, cudaStream_t stream,
                          std::vector<cudaStream_t> streams,
                          const std::shared_ptr<ForeignPool>& foreign, const Shown& shown) noexcept;
  // Under mutex_ (or on a record no other thread sees yet), device_ current: records the
  // event of each stream of `held.captured` that runs its work now; one whose event cannot
  // be recorded is synchronized when `wait`, else left. True when none is left.
  bool record_uncaptured(HeldBack& held, bool wait) noexcept;
  // The streams recorded for the live block `ptr`, forgotten here (empty: none).
  std::vector<cudaStream_t> take_recorded(void* ptr) noexcept;

  const int device_;
  vram::DevicePool& pool_;
  vram::cuda::EventPool events_;
  mutable std::mutex mutex_;  // guards streams_of_ and held_back_
  std::unordered_map<void*, std::vector<cudaStream_t>> streams_of_;  // live blocks only
  std::vector<HeldBack> held_back_;
  std::atomic<std::size_t> recorded_{0};    // streams_of_.size()
  std::atomic<std::size_t> held_count_{0};  // held_back_.size()
  std::atomic<std::uint64_t> held_bytes_{0};
};

}  // namespace vram_torch
