// Completion fences for host-only tests of PendingWork and the copy witness, and an
// emulation of CUDA streams that are created and destroyed, for DevicePool's stream rules.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "vram/stream_fence.hpp"

namespace vram::testing {

// Never fires on its own and fires when waited, counting the waits: a test sees whether
// something waited for it (and does not hang when something does).
struct FiresWhenWaited {
  std::shared_ptr<std::atomic<int>> waits = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<std::atomic<bool>> fired = std::make_shared<std::atomic<bool>>(false);
  bool ready() const { return fired->load(); }
  void wait() {
    waits->fetch_add(1);
    fired->store(true);
  }
};

// Streams of an emulated device, as a DevicePool's StreamFence. Work enqueued on a stream
// runs (on the calling thread, under the fence's mutex) when the stream is synchronized, when
// a marker on it is waited for, or when the device is quiesced; a marker completes once the
// work queued before it has run. Handles are recycled after destroy(), as the driver may.
// Flags what is undefined on a device: a record on a stream after it was destroyed
// (records_on_destroyed()). The legacy stream (null, cudaStreamLegacy) always exists; its
// markers complete at the next quiesce (or when waited for, which quiesces).
class StreamLifetimeFence final : public StreamFence {
 public:
  // recycle_handles: a destroyed stream's handle may name a later stream (else every
  // stream gets a new one). names_streams: stream_id() tells the streams behind a handle
  // apart (else it answers 0, "cannot tell", as a fence without cudaStreamGetId would).
  explicit StreamLifetimeFence(bool recycle_handles = true, bool names_streams = true)
      : recycle_(recycle_handles), names_(names_streams) {}
  cudaStream_t create() {
    std::lock_guard lock(mutex_);
    std::uintptr_t handle = 0;
    if (recycle_ && !free_handles_.empty()) {
      handle = free_handles_.back();
      free_handles_.pop_back();
    } else {
      handle = next_handle_;
      next_handle_ += 0x100;
    }
    streams_[handle].alive = true;  // a recycled node keeps its counts: old markers stay done
    streams_[handle].id = ++created_ids_;
    ++created_;
    return reinterpret_cast<cudaStream_t>(handle);
  }
  // Like cudaStreamDestroy after cudaStreamSynchronize: its work has run.
  void destroy(cudaStream_t stream) {
    std::lock_guard lock(mutex_);
    Stream& s = streams_.at(key(stream));
    run(s, s.queued);
    s.alive = false;
    free_handles_.push_back(key(stream));
  }
  void enqueue(cudaStream_t stream, std::function<void()> work) {
    std::lock_guard lock(mutex_);
    Stream& s = streams_.at(key(stream));
    s.work.push_back(std::move(work));
    ++s.queued;
  }
  void synchronize(cudaStream_t stream) {
    std::lock_guard lock(mutex_);
    Stream& s = streams_.at(key(stream));
    run(s, s.queued);
  }

  std::uint64_t record(cudaStream_t stream) override {
    std::lock_guard lock(mutex_);
    ++records_;
    Marker m;
    if (stream == nullptr || stream == cudaStreamLegacy) {
      m.legacy = true;
      m.after_quiesce = quiesces_ + 1;
    } else {
      auto it = streams_.find(key(stream));
      if (it == streams_.end() || !it->second.alive) {
        ++records_on_destroyed_;  // undefined on a device: the pool must never do it
        m.legacy = true;
        m.after_quiesce = quiesces_ + 1;
      } else {
        m.stream = &it->second;
        m.position = it->second.queued;
      }
    }
    markers_.push_back(m);
    return markers_.size();  // 1, 2, ...
  }
  // A live stream's id; 0 for the legacy stream and any handle not created here.
  std::uint64_t stream_id(cudaStream_t stream) noexcept override {
    std::lock_guard lock(mutex_);
    const auto it = streams_.find(key(stream));
    if (it == streams_.end()) return 0;
    if (!it->second.alive) ++ids_of_destroyed_;
    return names_ ? it->second.id : 0;
  }
  std::uint64_t ids_of_destroyed() const { return locked(ids_of_destroyed_); }
  bool completed(std::uint64_t marker) noexcept override {
    std::lock_guard lock(mutex_);
    return done(markers_[marker - 1]);
  }
  void wait(std::uint64_t marker) noexcept override {
    std::lock_guard lock(mutex_);
    ++waits_;
    Marker& m = markers_[marker - 1];
    if (m.legacy) {
      quiesce_locked();
    } else {
      run(*m.stream, m.position);
    }
  }
  void release(std::uint64_t marker) noexcept override {
    std::lock_guard lock(mutex_);
    ++released_;
    (void)marker;
  }
  void quiesce() noexcept override {
    std::lock_guard lock(mutex_);
    quiesce_locked();
  }

  std::uint64_t records() const { return locked(records_); }
  std::uint64_t records_on_destroyed() const { return locked(records_on_destroyed_); }
  std::uint64_t quiesces() const { return locked(quiesces_); }
  std::uint64_t waits() const { return locked(waits_); }
  std::uint64_t released() const { return locked(released_); }
  std::uint64_t streams_created() const { return locked(created_); }

 private:
  struct Stream {
    bool alive = true;
    std::uint64_t id = 0;  // stream_id(): a new one for every stream created on the handle
    std::deque<std::function<void()>> work;
    std::uint64_t queued = 0;  // work items ever enqueued
    std::uint64_t ran = 0;     // of those, run
  };
  struct Marker {
    Stream* stream = nullptr;
    std::uint64_t position = 0;  // the stream's `queued` at the record
    bool legacy = false;
    std::uint64_t after_quiesce = 0;
  };
  static std::uintptr_t key(cudaStream_t stream) {
    return reinterpret_cast<std::uintptr_t>(stream);
  }
  bool done(const Marker& m) const {
    return m.legacy ? quiesces_ >= m.after_quiesce : m.stream->ran >= m.position;
  }
  static void run(Stream& s, std::uint64_t upto) {
    while (s.ran < upto) {
      std::function<void()> work = std::move(s.work.front());
      s.work.pop_front();
      ++s.ran;
      work();
    }
  }
  void quiesce_locked() {
    ++quiesces_;
    for (auto& [handle, s] : streams_) run(s, s.queued);
  }
  std::uint64_t locked(const std::uint64_t& value) const {
    std::lock_guard lock(mutex_);
    return value;
  }

  const bool recycle_;
  const bool names_;
  mutable std::mutex mutex_;
  // Node-based: a Marker's Stream* stays valid (a recycled handle reuses its node).
  std::unordered_map<std::uintptr_t, Stream> streams_;
  std::vector<std::uintptr_t> free_handles_;
  std::uintptr_t next_handle_ = 0x1000;
  std::deque<Marker> markers_;
  std::uint64_t records_ = 0;
  std::uint64_t records_on_destroyed_ = 0;
  std::uint64_t quiesces_ = 0;
  std::uint64_t waits_ = 0;
  std::uint64_t released_ = 0;
  std::uint64_t created_ = 0;
  std::uint64_t created_ids_ = 0;
  std::uint64_t ids_of_destroyed_ = 0;  // stream_id() asked of a destroyed stream
};

}  // namespace vram::testing
