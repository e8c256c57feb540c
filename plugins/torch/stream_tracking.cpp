#include "stream_tracking.hpp"

#include <algorithm>
#include <optional>
#include <utility>

#include "cuda/capture.hpp"
#include "cuda/memory.hpp"
#include "vram/cuda/device.hpp"

namespace vram_torch {

namespace {

// True when every event has completed; `wait`: blocks until they have.
bool completed(const std::vector<cudaEvent_t>& events, bool wait) noexcept {
  for (cudaEvent_t event : events) {
    if (wait) {
      vram::cuda::synchronize(event);
    } else if (vram::cuda::query(event) == vram::cuda::EventState::pending) {
      return false;
    }
  }
  return true;
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
                                        cudaStream_t stream,
                                        const std::shared_ptr<ForeignPool>& foreign) noexcept {
  std::vector<cudaStream_t> streams = take_recorded(ptr);
  if (streams.empty()) return false;
  streams.erase(std::remove(streams.begin(), streams.end(), stream), streams.end());
  if (streams.empty()) return false;
  HeldBack held{ptr, size, bytes, stream, {}, {}, foreign};
  try {
    held.events.reserve(streams.size());
    // A null stream names the current device's legacy stream: the block's device here.
    vram::cuda::DeviceGuard guard(device_);
    held.captured = std::move(streams);
    if (record_uncaptured(held) && held.events.empty()) {
      return false;  // every recorded stream was waited for: the caller releases it at once
    }
    std::lock_guard<std::mutex> lock(mutex_);
    held_back_.push_back(std::move(held));
    held_count_.store(held_back_.size(), std::memory_order_relaxed);
    held_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    return true;
  } catch (...) {
    // No host memory for the bookkeeping, or the device cannot be made current: order the
    // reuse by waiting for those streams (a captured one cannot be waited for: the block is
    // left unreleased, which is safe).
    const std::vector<cudaStream_t>& left = held.captured.empty() ? streams : held.captured;
    bool captured = false;
    for (cudaStream_t other : left) {
      if (vram::cuda::capture_info(other).state == vram::cuda::CaptureState::active) {
        captured = true;
      } else {
        (void)vram::cuda::try_synchronize_stream(other);
      }
    }
    for (cudaEvent_t event : held.events) {
      vram::cuda::synchronize(event);
      events_.give_back(event);
    }
    return captured;
  }
}

bool StreamTracking::record_uncaptured(HeldBack& held) noexcept {
  for (std::size_t i = 0; i < held.captured.size();) {
    const cudaStream_t other = held.captured[i];
    const vram::cuda::CaptureState state = vram::cuda::capture_info(other).state;
    if (state == vram::cuda::CaptureState::active ||
        state == vram::cuda::CaptureState::invalidated) {
      ++i;  // its event would be a node of the graph: recorded once the capture has ended
      continue;
    }
    cudaEvent_t event = events_.try_take();
    if (event == nullptr || !vram::cuda::try_record(event, other)) {
      // Cannot order the reuse after that stream: wait for it here instead.
      events_.give_back(event);
      (void)vram::cuda::try_synchronize_stream(other);
    } else {
      held.events.push_back(event);  // reserved for every recorded stream: never throws
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
        if (!record_uncaptured(held_back_[i])) {
          ++i;
          continue;
        }
      }
      if (!completed(held_back_[i].events, wait)) {
        ++i;
        continue;
      }
      for (cudaEvent_t event : held_back_[i].events) events_.give_back(event);
      ready.push_back(std::move(held_back_[i]));
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

}  // namespace vram_torch
