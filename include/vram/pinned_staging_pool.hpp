// vram/pinned_staging_pool.hpp: a bounded pool of page-locked host staging buffers.
//
// Why: an engine that pages weights pins a staging buffer per page-in, and pinning costs
// far more than the copy it serves (0.7 ms for 1 MiB, 169 ms for 256 MiB on the H200
// against 55 GB/s of copy). The pool pins a handful of buffers and reuses them.
//
//   vram::PinnedStagingPool pool({.max_buffers = 8, .max_bytes = 512_MiB});
//   pool.reserve(2, 64_MiB);                         // pin ahead, at start-up
//   auto staging = pool.acquire(layer_bytes);        // best fit, or a fresh pin
//   std::memcpy(staging.data(), layer, layer_bytes);
//   auto done = vram::copy_to_device(device_ptr, staging, stream);
//   staging.retire(std::move(done.completed));       // reusable from now on
//
// When a buffer may be handed out again
//   Only after retire(CopyCompleted) or release(buffer, CopyCompleted), with a witness
//   that the copy reading the buffer completed (see copy.hpp). Without a witness there
//   is no way to return it: destroying a PooledStaging frees its buffer (counted in
//   freed_without_witness), never reuses it. A witness whose copied range is not inside
//   the buffer (from another buffer or another pool's copy) proves nothing about it:
//   the buffer is freed, not reused, and witness_mismatches counts it.
//
// Choice and bounds
//   acquire(len) takes the smallest free buffer with capacity >= len (best fit, no
//   power-of-two rounding) or pins exactly len bytes. A returned buffer is kept only
//   while the free list stays within max_buffers and max_bytes; otherwise it is freed.
//   Thread-safe: one mutex around the free list (a page-in costs milliseconds; the lock
//   is held for a scan of at most max_buffers entries, never during a pin or unpin).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "vram/copy.hpp"
#include "vram/upstream.hpp"

namespace vram {

namespace detail {
struct StagingPoolState;
}

// An owning pinned buffer (move-only). Destruction frees it to its upstream.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(std::shared_ptr<Upstream> upstream, std::size_t capacity);
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { reset(); }

  std::byte* data() const noexcept { return data_; }
  std::size_t capacity() const noexcept { return capacity_; }
  explicit operator bool() const noexcept { return data_ != nullptr; }
  void reset() noexcept;

 private:
  std::shared_ptr<Upstream> upstream_;
  std::byte* data_ = nullptr;
  std::size_t capacity_ = 0;
};

struct PinnedStagingStats {
  std::uint64_t pin_calls = 0;  // real pins (upstream allocations)
  std::uint64_t reuses = 0;     // acquires served from the free list
  std::uint64_t retired = 0;    // buffers returned with a witness and kept
  std::uint64_t freed_over_bounds = 0;
  std::uint64_t freed_without_witness = 0;
  std::uint64_t witness_mismatches = 0;
  std::size_t free_buffers = 0;
  std::size_t free_bytes = 0;
};

class PooledStaging;

struct PinnedStagingPoolOptions {
  std::size_t max_buffers = 8;
  std::size_t max_bytes = std::size_t{512} << 20;
};

class PinnedStagingPool {
 public:
  using Options = PinnedStagingPoolOptions;

  // Over page-locked host memory (PinnedHostUpstream, automatic method).
  PinnedStagingPool() : PinnedStagingPool(Options{}) {}
  explicit PinnedStagingPool(Options options);
  // Over any upstream (HostMemoryUpstream in the CPU tests).
  explicit PinnedStagingPool(std::shared_ptr<Upstream> upstream, Options options = {});

  // Throws vram::InvalidArgument for zero bytes, vram::PinningError when pinning fails.
  [[nodiscard]] PooledStaging acquire(std::size_t len);
  // Returns a raw buffer (from PooledStaging::into_inner) with its witness.
  void release(PinnedBuffer buffer, CopyCompleted completed);
  // Pins `count` buffers of `len` bytes into the free list now (as the bounds allow).
  void reserve(std::size_t count, std::size_t len);
  // Frees every retained buffer.
  void clear();
  // Whether the bounds can retain `count` live buffers of `len` bytes at once (a
  // look-ahead prefetch needs two) without freeing one of them on release.
  bool can_retain_concurrent(std::size_t len, std::size_t count) const noexcept;

  PinnedStagingStats stats() const;
  // Zeroes this pool's counters (a new measurement window); the buffers stay.
  void reset_counters() noexcept;
  // Process-wide counters over every pool: real pins and reuses.
  static std::uint64_t global_pin_calls() noexcept;
  static std::uint64_t global_reuses() noexcept;
  static void reset_global_counters() noexcept;

  const Options& options() const noexcept;

 private:
  std::shared_ptr<detail::StagingPoolState> state_;
};

// A staging buffer borrowed from a PinnedStagingPool. Move-only. Returns to the pool only
// through retire(witness); destroyed without one, it frees its buffer. Never throws or
// asserts on destruction. The pool may be destroyed first: the buffer stays valid.
class PooledStaging {
 public:
  PooledStaging(PooledStaging&&) noexcept = default;
  PooledStaging& operator=(PooledStaging&& other) noexcept;
  PooledStaging(const PooledStaging&) = delete;
  PooledStaging& operator=(const PooledStaging&) = delete;
  ~PooledStaging();

  std::byte* data() noexcept { return buffer_.data(); }
  const std::byte* data() const noexcept { return buffer_.data(); }
  std::size_t len() const noexcept { return len_; }  // bytes asked for
  std::size_t capacity() const noexcept { return buffer_.capacity(); }
  std::span<std::byte> bytes() noexcept { return {buffer_.data(), len_}; }
  std::span<const std::byte> bytes() const noexcept { return {buffer_.data(), len_}; }
  explicit operator bool() const noexcept { return static_cast<bool>(buffer_); }

  // Back to the pool for reuse, proven after the copy that read it completed.
  void retire(CopyCompleted completed);
  // Hands out the raw buffer for a path that returns it later with release().
  [[nodiscard]] PinnedBuffer into_inner() noexcept;

 private:
  friend class PinnedStagingPool;
  PooledStaging(std::shared_ptr<detail::StagingPoolState> pool, PinnedBuffer buffer,
                std::size_t len) noexcept
      : pool_(std::move(pool)), buffer_(std::move(buffer)), len_(len) {}
  void drop_without_witness() noexcept;
  std::shared_ptr<detail::StagingPoolState> pool_;
  PinnedBuffer buffer_;
  std::size_t len_ = 0;
};

}  // namespace vram
