#include "vram/pinned_staging_pool.hpp"

#include <algorithm>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "vram/cuda/error.hpp"
#include "vram/pinned_host_upstream.hpp"

namespace vram {
namespace {
std::atomic<std::uint64_t> global_pins{0};
std::atomic<std::uint64_t> global_reuse_count{0};
}  // namespace

namespace detail {

// Invariant: free_bytes == sum of capacities in free_list; free_list.size() <= max_buffers
// and free_bytes <= max_bytes after every operation.
struct StagingPoolState {
  StagingPoolState(std::shared_ptr<Upstream> upstream_in, PinnedStagingPool::Options options_in)
      : upstream(std::move(upstream_in)), options(options_in) {
    if (!upstream) throw InvalidArgument("vram::PinnedStagingPool: the upstream is null");
  }

  // Whether one more buffer of `capacity` bytes stays within both bounds. Needs `mutex`.
  bool fits_locked(std::size_t capacity) const {
    return free_list.size() < options.max_buffers &&
           capacity <= options.max_bytes - std::min(options.max_bytes, free_bytes);
  }

  // Moves `buffer` into the free list if the bounds allow; otherwise leaves it to the
  // caller, who frees it outside the lock (unpinning can take milliseconds).
  bool try_keep(PinnedBuffer& buffer) {
    std::lock_guard lock(mutex);
    if (!fits_locked(buffer.capacity())) return false;
    free_bytes += buffer.capacity();
    free_list.push_back(std::move(buffer));
    return true;
  }

  // One real pin, counted per pool and process-wide.
  PinnedBuffer pin(std::size_t len) {
    PinnedBuffer fresh(upstream, len);
    pin_calls.fetch_add(1, std::memory_order_relaxed);
    global_pins.fetch_add(1, std::memory_order_relaxed);
    return fresh;
  }

  // The one way back into the free list: a witness covering the buffer, then the bounds.
  // A buffer that fails either is freed when `buffer` goes out of scope.
  void take_back(PinnedBuffer buffer, const CopyCompleted& completed) {
    if (!completed.covers_range_in(buffer.data(), buffer.capacity())) {
      witness_mismatches.fetch_add(1, std::memory_order_relaxed);
      return;  // proves nothing about this buffer
    }
    if (try_keep(buffer)) {
      retired.fetch_add(1, std::memory_order_relaxed);
    } else {
      freed_over_bounds.fetch_add(1, std::memory_order_relaxed);
    }
  }

  std::shared_ptr<Upstream> upstream;
  PinnedStagingPool::Options options;
  mutable std::mutex mutex;
  std::vector<PinnedBuffer> free_list;
  std::size_t free_bytes = 0;
  std::atomic<std::uint64_t> pin_calls{0};
  std::atomic<std::uint64_t> reuses{0};
  std::atomic<std::uint64_t> retired{0};
  std::atomic<std::uint64_t> freed_over_bounds{0};
  std::atomic<std::uint64_t> freed_without_witness{0};
  std::atomic<std::uint64_t> witness_mismatches{0};
};

}  // namespace detail

PinnedBuffer::PinnedBuffer(std::shared_ptr<Upstream> upstream, std::size_t capacity)
    : upstream_(std::move(upstream)),
      data_(static_cast<std::byte*>(upstream_->allocate(capacity))),
      capacity_(capacity) {}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : upstream_(std::move(other.upstream_)),
      data_(std::exchange(other.data_, nullptr)),
      capacity_(std::exchange(other.capacity_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    upstream_ = std::move(other.upstream_);
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

void PinnedBuffer::reset() noexcept {
  if (data_ != nullptr) upstream_->deallocate(data_, capacity_);
  data_ = nullptr;
  capacity_ = 0;
  upstream_.reset();
}

PinnedStagingPool::PinnedStagingPool(Options options)
    : PinnedStagingPool(std::make_shared<PinnedHostUpstream>(), options) {}

PinnedStagingPool::PinnedStagingPool(std::shared_ptr<Upstream> upstream, Options options)
    : state_(std::make_shared<detail::StagingPoolState>(std::move(upstream), options)) {}

PooledStaging PinnedStagingPool::acquire(std::size_t len) {
  if (len == 0) {
    throw InvalidArgument(
        "vram::PinnedStagingPool::acquire: zero bytes requested. Fix: keep zero-sized "
        "buffers as null sentinels and ask for at least one byte.");
  }
  auto& s = *state_;
  {
    std::lock_guard lock(s.mutex);
    auto best = s.free_list.end();
    for (auto it = s.free_list.begin(); it != s.free_list.end(); ++it) {
      if (it->capacity() >= len &&
          (best == s.free_list.end() || it->capacity() < best->capacity())) {
        best = it;
      }
    }
    if (best != s.free_list.end()) {
      PinnedBuffer buffer = std::move(*best);
      *best = std::move(s.free_list.back());
      s.free_list.pop_back();
      s.free_bytes -= buffer.capacity();
      s.reuses.fetch_add(1, std::memory_order_relaxed);
      global_reuse_count.fetch_add(1, std::memory_order_relaxed);
      return PooledStaging(state_, std::move(buffer), len);
    }
  }
  return PooledStaging(state_, s.pin(len), len);  // pinned outside the lock
}

void PinnedStagingPool::release(PinnedBuffer buffer, CopyCompleted completed) {
  if (!buffer) return;
  state_->take_back(std::move(buffer), completed);
}

void PinnedStagingPool::reserve(std::size_t count, std::size_t len) {
  if (len == 0) throw InvalidArgument("vram::PinnedStagingPool::reserve: zero bytes requested.");
  auto& s = *state_;
  for (std::size_t i = 0; i < count; ++i) {
    {
      std::lock_guard lock(s.mutex);
      if (!s.fits_locked(len)) return;  // do not pin what could not be kept
    }
    PinnedBuffer fresh = s.pin(len);
    if (!s.try_keep(fresh)) return;  // bounds filled meanwhile: `fresh` is freed
  }
}

void PinnedStagingPool::clear() {
  std::vector<PinnedBuffer> dropped;
  {
    std::lock_guard lock(state_->mutex);
    dropped.swap(state_->free_list);
    state_->free_bytes = 0;
  }
}

bool PinnedStagingPool::can_retain_concurrent(std::size_t len, std::size_t count) const noexcept {
  const auto& options = state_->options;
  if (count > options.max_buffers) return false;
  return count == 0 || len <= options.max_bytes / count;
}

PinnedStagingStats PinnedStagingPool::stats() const {
  const auto& s = *state_;
  PinnedStagingStats out;
  out.pin_calls = s.pin_calls.load(std::memory_order_relaxed);
  out.reuses = s.reuses.load(std::memory_order_relaxed);
  out.retired = s.retired.load(std::memory_order_relaxed);
  out.freed_over_bounds = s.freed_over_bounds.load(std::memory_order_relaxed);
  out.freed_without_witness = s.freed_without_witness.load(std::memory_order_relaxed);
  out.witness_mismatches = s.witness_mismatches.load(std::memory_order_relaxed);
  std::lock_guard lock(s.mutex);
  out.free_buffers = s.free_list.size();
  out.free_bytes = s.free_bytes;
  return out;
}

void PinnedStagingPool::reset_counters() noexcept {
  auto& s = *state_;
  for (auto* counter : {&s.pin_calls, &s.reuses, &s.retired, &s.freed_over_bounds,
                        &s.freed_without_witness, &s.witness_mismatches}) {
    counter->store(0, std::memory_order_relaxed);
  }
}

std::uint64_t PinnedStagingPool::global_pin_calls() noexcept {
  return global_pins.load(std::memory_order_relaxed);
}
std::uint64_t PinnedStagingPool::global_reuses() noexcept {
  return global_reuse_count.load(std::memory_order_relaxed);
}
void PinnedStagingPool::reset_global_counters() noexcept {
  global_pins.store(0, std::memory_order_relaxed);
  global_reuse_count.store(0, std::memory_order_relaxed);
}

const PinnedStagingPool::Options& PinnedStagingPool::options() const noexcept {
  return state_->options;
}

PooledStaging& PooledStaging::operator=(PooledStaging&& other) noexcept {
  if (this != &other) {
    drop_without_witness();
    pool_ = std::move(other.pool_);
    buffer_ = std::move(other.buffer_);
    len_ = std::exchange(other.len_, 0);
  }
  return *this;
}

PooledStaging::~PooledStaging() { drop_without_witness(); }

void PooledStaging::drop_without_witness() noexcept {
  // Fallback only: the buffer is freed, never returned to the pool.
  if (buffer_ && pool_) pool_->freed_without_witness.fetch_add(1, std::memory_order_relaxed);
  buffer_.reset();
  pool_.reset();
}

void PooledStaging::retire(CopyCompleted completed) {
  if (!buffer_ || !pool_) return;
  auto pool = std::move(pool_);
  len_ = 0;
  pool->take_back(std::move(buffer_), completed);
}

PinnedBuffer PooledStaging::into_inner() noexcept {
  pool_.reset();
  len_ = 0;
  return std::move(buffer_);
}

}  // namespace vram
