// vram/pinned_staging_pool.hpp: a bounded pool of page-locked host staging buffers.
//
// Why: an engine that pages weights would pin a staging buffer per page-in, and pinning a
// buffer costs far more than the copy it serves. The pool pins a handful of buffers and
// reuses them.
//
//   vram::PinnedStagingPool pool({.max_buffers = 8, .max_bytes = 512_MiB});
//   pool.reserve(2, 64_MiB);                         // pin ahead, at start-up
//   auto staging = pool.acquire(layer_bytes);        // best fit, or a fresh pin
//   std::memcpy(staging.data(), layer, layer_bytes);
//   auto done = vram::copy_to_device(device_ptr, staging, stream);
//   staging.retire(std::move(done.completed));       // reusable from now on
//
// When a buffer may be handed out again
//   Only after retire(CopyCompleted) or retire(buffer, CopyCompleted) with a witness that
//   names the buffer's current lease, and only once every copy issued from that lease
//   (copy_to_device[_async] on the PooledStaging) has been observed complete (see copy.hpp
//   for why this is sound). Every acquire() is a new lease with a process-unique id, so a
//   witness of an earlier loan of the same buffer, or of an earlier pin at the same
//   address, names nothing current.
//   A refused witness (empty/moved-from, another lease, a stale lease, or copies from the
//   lease still unobserved) throws vram::InvalidArgument and loses nothing: the lease (or
//   the PinnedBuffer given to retire()) stays with the caller, intact, and can be retired
//   later with a valid witness. witness_mismatches counts refusals. retire() of a buffer
//   that is not a lease of this pool (another pool's, or a PinnedBuffer made by hand over
//   any upstream, pageable or not) throws vram::InvalidArgument, leaves the buffer with the
//   caller, and counts foreign_buffers.
//   Without a witness there is no way back: destroying a PooledStaging (or the PinnedBuffer
//   its into_inner() gave) frees its buffer (counted in freed_without_witness), never
//   reuses it; if copies issued from it are still unobserved, the memory is freed only once
//   the last of their PendingCopy objects has waited for its copy and gone.
//   Handles: a copy of a PinnedStagingPool is another handle of the same pool. A moved-from
//   one throws vram::InvalidArgument from acquire, retire (the buffer stays with the
//   caller), reserve and stats; clear and reset_counters do nothing. An upstream of device
//   memory is refused at construction (the host fills staging buffers).
//
// Choice and bounds
//   acquire(len) takes the smallest free buffer with capacity >= len (best fit, no
//   power-of-two rounding) or pins exactly len bytes. A returned buffer is kept only
//   while the free list stays within max_buffers and max_bytes; otherwise it is freed.
//   Thread-safe: one mutex around the free list (a page-in costs milliseconds; the lock
//   is held for a scan of at most max_buffers entries, never during a pin or unpin). One
//   lease is used by one thread at a time; its PendingCopy objects may be waited anywhere.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>

#include "vram/copy.hpp"
#include "vram/upstream.hpp"

namespace vram {

namespace detail {
struct StagingPoolState;  // the pool's free list and counters (src/staging/pinned_staging_pool.cpp)
struct StagingLease;      // the ledger of one loan (src/staging/staging_lease.hpp)
}  // namespace detail

// An owning pinned buffer (move-only). Destruction frees it to its upstream (deferred while
// copies issued from its lease are unobserved). A buffer made with this constructor is no
// pool's lease: no PinnedStagingPool::retire() accepts it.
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
  // The lease this buffer is on loan under; 0 when it is not a pool's lease.
  std::uint64_t lease_id() const noexcept;
  // Copies issued from the lease whose completion no host has observed yet.
  std::uint64_t copies_in_flight() const noexcept;
  void reset() noexcept;

 private:
  friend class PinnedStagingPool;
  friend class PooledStaging;
  friend class PendingCopy;
  std::shared_ptr<Upstream> upstream_;
  std::byte* data_ = nullptr;
  std::size_t capacity_ = 0;
  std::shared_ptr<detail::StagingLease> lease_;  // set while on loan from a pool
};

struct PinnedStagingStats {
  std::uint64_t pin_calls = 0;  // real pins (upstream allocations)
  std::uint64_t reuses = 0;     // acquires served from the free list
  std::uint64_t retired = 0;    // buffers returned with a witness and kept
  std::uint64_t freed_over_bounds = 0;
  std::uint64_t freed_without_witness = 0;
  std::uint64_t witness_mismatches = 0;  // witnesses refused by retire()
  std::uint64_t foreign_buffers = 0;     // retire() of a buffer not leased from this pool
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
  // Returns a raw buffer (from PooledStaging::into_inner) with a witness of its lease.
  // Throws vram::InvalidArgument, leaving `buffer` with the caller intact, when the buffer
  // is not this pool's lease or the witness does not prove it idle (see the class comment).
  // An empty buffer is a no-op.
  void retire(PinnedBuffer&& buffer, CopyCompleted completed);
  // The earlier name of retire(buffer, witness).
  [[deprecated("use PinnedStagingPool::retire(buffer, witness)")]] void release(
      PinnedBuffer&& buffer, CopyCompleted completed) {
    retire(std::move(buffer), std::move(completed));
  }
  // Pins `count` buffers of `len` bytes into the free list now (as the bounds allow).
  void reserve(std::size_t count, std::size_t len);
  // Frees every retained buffer.
  void clear();
  // Whether the bounds can retain `count` live buffers of `len` bytes at once (a
  // look-ahead prefetch needs two) without freeing one of them on retire.
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
  friend class PooledStaging;
  // The one way back into the free list. Throws (leaving `buffer` untouched) unless
  // `completed` names the buffer's current lease and no copy from it is unobserved.
  static void take_back(detail::StagingPoolState& pool, PinnedBuffer& buffer,
                        CopyCompleted& completed, const char* caller);
  detail::StagingPoolState& live_state(const char* call) const;  // throws when moved from
  std::shared_ptr<detail::StagingPoolState> state_;
};

// A staging buffer borrowed from a PinnedStagingPool: one lease. Move-only. Returns to the
// pool only through retire(witness); destroyed without one, it frees its buffer (after
// any copies issued from it). Never throws or asserts on destruction. The pool may be
// destroyed first: the buffer stays valid.
class PooledStaging {
 public:
  PooledStaging(PooledStaging&& other) noexcept
      : pool_(std::move(other.pool_)),
        buffer_(std::move(other.buffer_)),
        len_(std::exchange(other.len_, 0)) {}
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
  std::uint64_t lease_id() const noexcept { return buffer_.lease_id(); }
  std::uint64_t copies_in_flight() const noexcept { return buffer_.copies_in_flight(); }

  // Back to the pool for reuse, proven after every copy issued from this lease completed.
  // Throws vram::InvalidArgument (this lease stays intact) for a refused witness or an
  // empty (moved-from, already returned) lease.
  void retire(CopyCompleted completed);
  // Hands out the raw buffer, still on this lease, for a path that returns it later with
  // PinnedStagingPool::retire(buffer, witness). Copies issued before stay counted on it.
  [[nodiscard]] PinnedBuffer into_inner() noexcept;

 private:
  friend class PinnedStagingPool;
  friend class PendingCopy;
  PooledStaging(std::shared_ptr<detail::StagingPoolState> pool, PinnedBuffer buffer,
                std::size_t len) noexcept
      : pool_(std::move(pool)), buffer_(std::move(buffer)), len_(len) {}
  void drop_without_witness() noexcept;
  std::shared_ptr<detail::StagingPoolState> pool_;
  PinnedBuffer buffer_;
  std::size_t len_ = 0;
};

}  // namespace vram
