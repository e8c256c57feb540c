#include "stream_tracking.hpp"

#include <algorithm>
#include <optional>
#include <utility>

#include "cuda/capture.hpp"
#include "cuda/memory.hpp"
#include "vram/cuda/device.hpp"

namespace vram_torch {

namespace {

// True when every event has completed; `wait`: blocks until they have. A wait that ends
// without the work (an event that is a node of a capture) is no completion.
bool completed(const std::vector<cudaEvent_t>& events, bool wait) noexcept {
  for (cudaEvent_t event : events) {
    if (wait) vram::cuda::synchronize(event);
    if (vram::cuda::query(event) == vram::cuda::EventState::pending) return false;
  }
  return true;
}

bool runs_its_work(cudaStream_t stream) noexcept {
  return vram::cuda::capture_info(stream).state == vram::cuda::CaptureState::none;
}

}  // namespace

void StreamTracking::record(void* ptr, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& streams = streams_of_[ptr];
  if (std::find(streams.begin(), streams.end(), stream) == streams.end()) {
    streams.push_back(stream);
  }
  recorded_.store(streams_of_.size(), std::memory_order_release);
}

std::vector<cudaStream_t> StreamTracking::take_recorded(void* ptr) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = streams_of_.find(ptr);
  if (it == streams_of_.end()) return {};
  std::vector<cudaStream_t> streams = std::move(it->second);
  streams_of_.erase(it);
  recorded_.store(streams_of_.size(), std::memory_order_release);
  return streams;
}

bool StreamTracking::hold_back_recorded(void* ptr, std::size_t size, std::size_t bytes,
                                        cudaStream_t stream, std::vector<cudaStream_t> streams,
                                        const std::shared_ptr<ForeignPool>& foreign,
                                        const Shown& shown) noexcept {
  streams.erase(std::remove(streams.begin(), streams.end(), stream), streams.end());
  if (streams.empty()) return false;
  // A null stream names the current device's legacy stream: the block's device here.
  std::optional<vram::cuda::DeviceGuard> guard;
  HeldBack held{ptr, size, bytes, stream, {}, {}, foreign, shown};
  try {
    guard.emplace(device_);
    held.events.reserve(streams.size());
    held.captured = std::move(streams);  // moved last: the catch below reads `streams`
  } catch (...) {
    for (cudaStream_t other : streams) (void)vram::cuda::try_synchronize_stream(other);
    return false;
  }
  if (record_uncaptured(held, true) && held.events.empty()) {
    return false;  // every recorded stream was waited for: the caller releases it at once
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    try {
      held_back_.push_back(std::move(held));  // on a throw, `held` is unchanged
      held_count_.store(held_back_.size(), std::memory_order_relaxed);
      held_bytes_.fetch_add(bytes, std::memory_order_relaxed);
      return true;
    } catch (...) {
    }
  }
  // No host memory to keep the record: its streams are waited for here instead.
  for (cudaStream_t other : held.captured) (void)vram::cuda::try_synchronize_stream(other);
  for (cudaEvent_t event : held.events) {
    vram::cuda::synchronize(event);
    events_.give_back(event);
  }
  return false;
}

bool StreamTracking::record_uncaptured(HeldBack& held, bool wait) noexcept {
  for (std::size_t i = 0; i < held.captured.size();) {
    const cudaStream_t other = held.captured[i];
    if (!runs_its_work(other)) {
      ++i;  // its event would be a node of a graph: recorded once the capture has ended
      continue;
    }
    cudaEvent_t event = events_.try_take();
    if (event != nullptr && vram::cuda::try_record(event, other)) {
      held.events.push_back(event);  // reserved for every recorded stream: never throws
    } else {
      events_.give_back(event);
      if (!wait) {
        ++i;  // the next release() tries again
        continue;
      }
      (void)vram::cuda::try_synchronize_stream(other);  // cannot order it by an event
    }
    held.captured[i] = held.captured.back();
    held.captured.pop_back();
  }
  return held.captured.empty();
}

std::size_t StreamTracking::release(bool wait) noexcept {
  std::vector<HeldBack> ready;
  {
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    if (wait) {
      lock.lock();
    } else if (!lock.try_lock()) {
      return 0;  // another thread is at it; the next allocation looks again
    }
    std::optional<vram::cuda::DeviceGuard> guard;  // for the events of captured streams
    for (std::size_t i = 0; i < held_back_.size();) {
      if (!held_back_[i].captured.empty()) {
        try {
          if (!guard) guard.emplace(device_);
        } catch (...) {
          ++i;  // the device cannot be made current: the next release tries again
          continue;
        }
        if (!record_uncaptured(held_back_[i], wait)) {
          ++i;
          continue;
        }
      }
      if (!completed(held_back_[i].events, wait)) {
        ++i;
        continue;
      }
      if (ready.empty()) {
        try {
          ready.reserve(held_back_.size() - i);  // every later one may be ready too
        } catch (...) {
          break;  // no host memory: the blocks stay held
        }
      }
      for (cudaEvent_t event : held_back_[i].events) events_.give_back(event);
      ready.push_back(std::move(held_back_[i]));  // within the reserved room: never throws
      held_back_[i] = std::move(held_back_.back());
      held_back_.pop_back();
    }
    held_count_.store(held_back_.size(), std::memory_order_relaxed);
  }
  for (const HeldBack& block : ready) {
    held_bytes_.fetch_sub(block.bytes, std::memory_order_relaxed);
    if (block.foreign) {
      block.foreign->deallocate(block.ptr);
    } else {
      pool_.deallocate_async(block.ptr, block.size, block.alloc_stream);
    }
  }
  return ready.size();
}

std::vector<StreamTracking::HeldView> StreamTracking::held() const {
  std::vector<HeldView> views;
  if (held_count_.load(std::memory_order_relaxed) == 0) return views;
  std::lock_guard<std::mutex> lock(mutex_);
  views.reserve(held_back_.size());
  for (const HeldBack& block : held_back_) {
    if (block.foreign) continue;
    views.push_back({reinterpret_cast<std::uintptr_t>(block.ptr), block.size, block.bytes,
                     block.alloc_stream, block.shown});
  }
  return views;
}

}  // namespace vram_torch
