#include "stream_tracking.hpp"

#include <algorithm>
#include <utility>

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

bool StreamTracking::hold_back_recorded(void* ptr, std::size_t size, cudaStream_t stream,
                                        const std::shared_ptr<ForeignPool>& foreign) noexcept {
  std::vector<cudaStream_t> streams = take_recorded(ptr);
  if (streams.empty()) return false;
  streams.erase(std::remove(streams.begin(), streams.end(), stream), streams.end());
  if (streams.empty()) return false;
  const std::size_t bytes = foreign ? ForeignPool::round(size) : pool_.block_bytes(size);
  HeldBack held{ptr, size, bytes, stream, {}, foreign};
  try {
    held.events.reserve(streams.size());
    // A null stream names the current device's legacy stream: the block's device here.
    vram::cuda::DeviceGuard guard(device_);
    for (cudaStream_t other : streams) {
      cudaEvent_t event = events_.try_take();
      if (event == nullptr || !vram::cuda::try_record(event, other)) {
        // Cannot order the reuse after that stream: wait for it here instead.
        events_.give_back(event);
        (void)vram::cuda::try_synchronize_stream(other);
        continue;
      }
      held.events.push_back(event);
    }
    // Every recorded stream was waited for: the caller releases the block at once.
    if (held.events.empty()) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    held_back_.push_back(std::move(held));
    held_count_.store(held_back_.size(), std::memory_order_relaxed);
    held_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    return true;
  } catch (...) {
    // No host memory for the bookkeeping, or the device cannot be made current: order the
    // reuse by waiting for those streams.
    for (cudaStream_t other : streams) (void)vram::cuda::try_synchronize_stream(other);
    for (cudaEvent_t event : held.events) events_.give_back(event);
    return false;
  }
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
    for (std::size_t i = 0; i < held_back_.size();) {
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
