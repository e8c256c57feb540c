// vram/stream_fence.hpp: stream markers, "has the work queued on this stream so far
// completed?", pluggable. (A fence here is a stream marker, not a memory barrier: for those
// see vram/detail/asymmetric_barrier.hpp.)
//
// DevicePool's stream-ordered release (deallocate_async) hands a block to another stream
// only after the work queued on the freeing stream has completed. It asks a StreamFence:
// record(stream) marks "everything queued on `stream` up to now", completed(marker) checks
// it without blocking, wait(marker) blocks, release(marker) recycles it, quiesce() waits for
// every stream.
//
// Which streams the pool passes to record(): the legacy default stream (null or
// cudaStreamLegacy) at any time, and a caller's stream S only inside an allocate_async or
// deallocate_async that passes S (the caller may destroy S after its last call: the pool
// never records on it later). A marker, once recorded, may be checked, waited for and
// released after its stream was destroyed (a CUDA event outlives its stream). A custom
// fence may rely on this.
//
//   CudaEventFence   CUDA events, recycled (never created per free once warm); the default
//                    of a pool over device memory.
//   ImmediateFence   every marker is complete at once: host memory has no queued work;
//                    the default of a pool over any other upstream.
//   ManualFence      markers complete when the owner says so (complete_all / complete):
//                    emulates streams in host-only tests and trace replay.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace vram {
namespace cuda {
class EventPool;  // src/cuda/event_pool.hpp
}

class StreamFence {
 public:
  StreamFence() = default;
  StreamFence(const StreamFence&) = delete;
  StreamFence& operator=(const StreamFence&) = delete;
  virtual ~StreamFence() = default;
  // A marker after all work queued on `stream` so far. Throws on failure (the pool then
  // waits for nothing and keeps the blocks tagged with the stream). A number names one
  // record until it is released (it may come back after that), unless every marker is
  // complete at once (ImmediateFence): the pool finds a record's blocks by its number.
  virtual std::uint64_t record(cudaStream_t stream) = 0;
  // Non-blocking: has the work before `marker` completed?
  virtual bool completed(std::uint64_t marker) noexcept = 0;
  // Blocks until it has (growing past the budget, trim(wait), the out-of-memory path).
  virtual void wait(std::uint64_t marker) noexcept = 0;
  // The marker is no longer needed.
  virtual void release(std::uint64_t marker) noexcept = 0;
  // Blocks until all work queued so far on every stream has completed, without touching
  // any stream (used by trim, destruction, the out-of-memory retry and growth past the
  // budget: a stream that freed blocks may be gone).
  virtual void quiesce() noexcept = 0;
  // quiesce(), saying whether it is known to have completed: false (e.g. the synchronize
  // failed) and the pool treats no stream's frees as complete.
  virtual bool try_quiesce() noexcept {
    quiesce();
    return true;
  }
  // The id of the CUDA graph capture `stream` is in, 0 when it is not being captured (or
  // the fence cannot tell): DevicePool keeps blocks a capture without a scope touches out
  // of the shared tiers (device_pool.hpp, "CUDA graphs"). Never called for the legacy stream.
  virtual std::uint64_t capture_of(cudaStream_t /*stream*/) noexcept { return 0; }
  // Which stream `stream` names now, as a number no later stream gets (a destroyed stream's
  // handle may name a new one): DevicePool tells a thread's steady stream from streams made
  // and destroyed around a few requests (thread_heap.hpp). 0: the fence cannot tell. Asked
  // only during a call on that stream (which proves it alive).
  virtual std::uint64_t stream_id(cudaStream_t /*stream*/) noexcept { return 0; }
};

class ImmediateFence final : public StreamFence {
 public:
  std::uint64_t record(cudaStream_t) override { return 0; }
  bool completed(std::uint64_t) noexcept override { return true; }
  void wait(std::uint64_t) noexcept override {}
  void release(std::uint64_t) noexcept override {}
  void quiesce() noexcept override {}
};

// Markers are numbered 1, 2, ...; complete(n) completes every marker up to n.
class ManualFence final : public StreamFence {
 public:
  std::uint64_t record(cudaStream_t) override {
    std::lock_guard lock(mutex_);
    return ++recorded_;
  }
  bool completed(std::uint64_t marker) noexcept override {
    std::lock_guard lock(mutex_);
    return marker <= completed_;
  }
  // Nothing would ever complete it: a test that waits must complete first.
  void wait(std::uint64_t marker) noexcept override {
    std::lock_guard lock(mutex_);
    ++waits_;
    if (marker > completed_) completed_ = marker;
  }
  void release(std::uint64_t) noexcept override {}
  // The emulated device finishes everything queued (as a device synchronize would).
  void quiesce() noexcept override {
    std::lock_guard lock(mutex_);
    ++quiesces_;
    completed_ = recorded_;
  }
  void complete(std::uint64_t marker) {
    std::lock_guard lock(mutex_);
    if (marker > completed_) completed_ = marker;
  }
  void complete_all() {
    std::lock_guard lock(mutex_);
    completed_ = recorded_;
  }
  std::uint64_t recorded() const {
    std::lock_guard lock(mutex_);
    return recorded_;
  }
  // Emulated graph capture: `stream` is being captured with id `capture` (0: it ends).
  void set_capture(cudaStream_t stream, std::uint64_t capture) {
    std::lock_guard lock(mutex_);
    std::erase_if(captures_, [&](const auto& c) { return c.first == stream; });
    if (capture != 0) captures_.emplace_back(stream, capture);
    any_capture_.store(!captures_.empty(), std::memory_order_relaxed);
  }
  std::uint64_t capture_of(cudaStream_t stream) noexcept override {
    if (!any_capture_.load(std::memory_order_relaxed)) return 0;
    std::lock_guard lock(mutex_);
    for (const auto& [captured, id] : captures_) {
      if (captured == stream) return id;
    }
    return 0;
  }
  // Blocking waits the pool made (each completes its marker, as the device would).
  std::uint64_t waits() const {
    std::lock_guard lock(mutex_);
    return waits_;
  }
  // Quiesces the pool made (each completes everything, as a device synchronize would).
  std::uint64_t quiesces() const {
    std::lock_guard lock(mutex_);
    return quiesces_;
  }

 private:
  mutable std::mutex mutex_;
  std::uint64_t waits_ = 0;
  std::uint64_t quiesces_ = 0;
  std::uint64_t recorded_ = 0;
  std::uint64_t completed_ = 0;
  std::vector<std::pair<cudaStream_t, std::uint64_t>> captures_;
  std::atomic<bool> any_capture_{false};
};

// CUDA events (timing disabled) on `device`, recycled through the library's event pool: a
// marker is one event, recorded on the stream; once warm, record() creates no event.
class CudaEventFence final : public StreamFence {
 public:
  explicit CudaEventFence(int device);
  ~CudaEventFence() override;
  std::uint64_t record(cudaStream_t stream) override;
  bool completed(std::uint64_t marker) noexcept override;
  void wait(std::uint64_t marker) noexcept override;
  void release(std::uint64_t marker) noexcept override;
  // A device synchronize on the fence's device (errors, e.g. at driver shutdown, ignored;
  // try_quiesce() reports them).
  void quiesce() noexcept override;
  bool try_quiesce() noexcept override;
  std::uint64_t capture_of(cudaStream_t stream) noexcept override;
  std::uint64_t stream_id(cudaStream_t stream) noexcept override;

 private:
  int device_;
  std::unique_ptr<cuda::EventPool> events_;
};

}  // namespace vram
