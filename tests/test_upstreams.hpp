// Test-only upstreams: an accounting wrapper with a capacity and a fault schedule, and
// per-memory-kind helpers so the same pool contract runs over host and device memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "vram/cuda/error.hpp"
#include "vram/upstream.hpp"

namespace vram::testing {

// Wraps an upstream; counts calls and live bytes, rejects foreign or double frees loudly,
// and fails allocations on a schedule: past `capacity_bytes` live, every `fail_every`-th
// call, or once when the cumulative bytes asked for would pass `fail_once_at_total`.
class TestUpstream final : public Upstream {
 public:
  struct Options {
    std::size_t capacity_bytes = SIZE_MAX;
    std::uint64_t fail_every = 0;
    std::size_t fail_once_at_total = SIZE_MAX;
  };
  explicit TestUpstream(std::shared_ptr<Upstream> inner, Options options)
      : inner_(std::move(inner)), options_(options) {}
  explicit TestUpstream(std::shared_ptr<Upstream> inner)
      : TestUpstream(std::move(inner), Options{}) {}

  void* allocate(std::size_t bytes) override {
    {
      std::lock_guard lock(mutex_);
      ++calls_;
      const bool scheduled = options_.fail_every != 0 && calls_ % options_.fail_every == 0;
      const bool once = !failed_once_ && total_asked_ + bytes > options_.fail_once_at_total;
      total_asked_ += bytes;
      if (once) failed_once_ = true;
      if (scheduled || once || live_bytes_ + bytes > options_.capacity_bytes) {
        ++injected_failures_;
        throw OutOfMemory(bytes, 0, 0, "TestUpstream: injected failure");
      }
    }
    void* block = inner_->allocate(bytes);
    std::lock_guard lock(mutex_);
    live_[block] = bytes;
    live_bytes_ += bytes;
    ++allocations_;
    return block;
  }
  void deallocate(void* block, std::size_t bytes) noexcept override {
    {
      std::lock_guard lock(mutex_);
      auto it = live_.find(block);
      if (it == live_.end() || it->second != bytes) {
        ++bad_frees_;
        return;
      }
      live_.erase(it);
      live_bytes_ -= bytes;
      ++frees_;
    }
    inner_->deallocate(block, bytes);
  }
  MemoryKind kind() const noexcept override { return inner_->kind(); }
  std::string_view name() const noexcept override { return "test"; }
  std::size_t alignment() const noexcept override { return inner_->alignment(); }
  std::size_t available_bytes() const noexcept override {
    std::lock_guard lock(mutex_);
    const std::size_t left =
        live_bytes_ < options_.capacity_bytes ? options_.capacity_bytes - live_bytes_ : 0;
    return std::min(left, inner_->available_bytes());
  }

  void set_options(Options options) {
    std::lock_guard lock(mutex_);
    options_ = options;
    failed_once_ = false;
    total_asked_ = 0;
    calls_ = 0;
  }
  std::size_t live_bytes() const {
    std::lock_guard lock(mutex_);
    return live_bytes_;
  }
  std::uint64_t allocations() const {
    std::lock_guard lock(mutex_);
    return allocations_;
  }
  std::uint64_t frees() const {
    std::lock_guard lock(mutex_);
    return frees_;
  }
  std::uint64_t bad_frees() const {
    std::lock_guard lock(mutex_);
    return bad_frees_;
  }
  std::uint64_t injected_failures() const {
    std::lock_guard lock(mutex_);
    return injected_failures_;
  }

 private:
  std::shared_ptr<Upstream> inner_;
  Options options_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, std::size_t> live_;
  std::size_t live_bytes_ = 0;
  std::size_t total_asked_ = 0;
  bool failed_once_ = false;
  std::uint64_t calls_ = 0;
  std::uint64_t allocations_ = 0;
  std::uint64_t frees_ = 0;
  std::uint64_t bad_frees_ = 0;
  std::uint64_t injected_failures_ = 0;
};

// Memory-kind helpers for typed tests.
struct HostMemory {
  static constexpr const char* kName = "host";
  static bool available() { return true; }
  static std::shared_ptr<Upstream> make() { return std::make_shared<HostMemoryUpstream>(); }
  static void fill(void* block, std::size_t bytes, unsigned char value) {
    std::memset(block, value, bytes);
  }
  static bool holds(const void* block, std::size_t bytes, unsigned char value) {
    const auto* p = static_cast<const unsigned char*>(block);
    for (std::size_t i = 0; i < bytes; ++i) {
      if (p[i] != value) return false;
    }
    return true;
  }
};

struct DeviceMemory {
  static constexpr const char* kName = "device";
  static std::shared_ptr<Upstream> make() { return std::make_shared<DeviceMemoryUpstream>(0); }
  static void fill(void* block, std::size_t bytes, unsigned char value) {
    cuda::check(cudaMemset(block, value, bytes), "cudaMemset");
  }
  static bool holds(const void* block, std::size_t bytes, unsigned char value) {
    std::string host(bytes, '\0');
    cuda::check(cudaMemcpy(host.data(), block, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
    for (char c : host) {
      if (static_cast<unsigned char>(c) != value) return false;
    }
    return true;
  }
};

}  // namespace vram::testing
