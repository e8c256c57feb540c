#include "vram/pinned_staging_pool.hpp"

#include <algorithm>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "staging_lease.hpp"
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
    if (upstream->kind() == MemoryKind::device) {
      throw InvalidArgument("vram::PinnedStagingPool: the upstream '" +
                            std::string(upstream->name()) +
                            "' hands out device memory, which the host cannot fill. Fix: "
                            "stage through host memory (PinnedHostUpstream, the default).");
    }
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

  const std::uint64_t id = StagingLease::next_id();  // identity checked by retire()
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
  std::atomic<std::uint64_t> foreign_buffers{0};
};

}  // namespace detail

namespace {
// Bad input to a hand-made PinnedBuffer is a clear error, not a null dereference.
std::shared_ptr<Upstream> checked_upstream(std::shared_ptr<Upstream> upstream,
                                           std::size_t capacity) {
  if (!upstream) throw InvalidArgument("vram::PinnedBuffer: the upstream is null.");
  if (capacity == 0) {
    throw InvalidArgument(
        "vram::PinnedBuffer: zero bytes requested. Fix: ask for at least one byte.");
  }
  return upstream;
}
}  // namespace

PinnedBuffer::PinnedBuffer(std::shared_ptr<Upstream> upstream, std::size_t capacity)
    : upstream_(checked_upstream(std::move(upstream), capacity)),
      data_(static_cast<std::byte*>(upstream_->allocate(capacity))),
      capacity_(capacity) {}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : upstream_(std::move(other.upstream_)),
      data_(std::exchange(other.data_, nullptr)),
      capacity_(std::exchange(other.capacity_, 0)),
      lease_(std::move(other.lease_)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    upstream_ = std::move(other.upstream_);
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
    lease_ = std::move(other.lease_);
  }
  return *this;
}

std::uint64_t PinnedBuffer::lease_id() const noexcept { return lease_ ? lease_->id : 0; }

std::uint64_t PinnedBuffer::copies_in_flight() const noexcept {
  return lease_ ? lease_->copies_in_flight() : 0;
}

void PinnedBuffer::reset() noexcept {
  if (data_ != nullptr && lease_) {
    if (auto pool = lease_->raw_owner.lock()) {  // a raw buffer still on loan: no witness
      pool->freed_without_witness.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (data_ != nullptr) {
    if (lease_ && lease_->copies_in_flight() != 0) {
      // A DMA may still read this memory: park it on the ledger, which the in-flight
      // PendingCopy objects keep alive; the last of them frees it after its wait. A copy
      // observed between the check and here only makes the parking unnecessary, not unsafe.
      lease_->parked_upstream = std::move(upstream_);
      lease_->parked = data_;
      lease_->parked_bytes = capacity_;
    } else {
      upstream_->deallocate(data_, capacity_);
    }
  }
  data_ = nullptr;
  capacity_ = 0;
  upstream_.reset();
  lease_.reset();
}

PinnedStagingPool::PinnedStagingPool(Options options)
    : PinnedStagingPool(std::make_shared<PinnedHostUpstream>(), options) {}

PinnedStagingPool::PinnedStagingPool(std::shared_ptr<Upstream> upstream, Options options)
    : state_(std::make_shared<detail::StagingPoolState>(std::move(upstream), options)) {}

detail::StagingPoolState& PinnedStagingPool::live_state(const char* call) const {
  if (!state_) [[unlikely]] {
    throw InvalidArgument(std::string("vram::PinnedStagingPool::") + call +
                          ": the pool was moved from. Fix: use the pool it was moved to.");
  }
  return *state_;
}

PooledStaging PinnedStagingPool::acquire(std::size_t len) {
  auto& s = live_state("acquire");
  if (len == 0) {
    throw InvalidArgument(
        "vram::PinnedStagingPool::acquire: zero bytes requested. Fix: keep zero-sized "
        "buffers as null sentinels and ask for at least one byte.");
  }
  // A new ledger for every loan, made before the free list is touched (it can throw).
  auto lease = std::make_shared<detail::StagingLease>(s.id, detail::StagingLease::next_id());
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
      buffer.lease_ = std::move(lease);
      return PooledStaging(state_, std::move(buffer), len);
    }
  }
  PinnedBuffer fresh = s.pin(len);  // pinned outside the lock
  fresh.lease_ = std::move(lease);
  return PooledStaging(state_, std::move(fresh), len);
}

void PinnedStagingPool::take_back(detail::StagingPoolState& pool, PinnedBuffer& buffer,
                                  CopyCompleted& completed, const char* caller) {
  const detail::StagingLease& lease = *buffer.lease_;
  std::string refusal;
  if (!completed) {
    refusal = "the witness is empty (moved from, or of a copy from raw host memory)";
  } else if (completed.lease() != lease.id) {
    refusal = "the witness names lease " + std::to_string(completed.lease()) +
              ", not this buffer's current lease " + std::to_string(lease.id) +
              " (a witness of another buffer, or of an earlier loan of this one)";
  } else if (const std::uint64_t in_flight = lease.copies_in_flight(); in_flight != 0) {
    refusal = std::to_string(in_flight) +
              " copy(ies) issued from this lease are not yet observed complete";
  }
  if (!refusal.empty()) {
    pool.witness_mismatches.fetch_add(1, std::memory_order_relaxed);
    throw InvalidArgument(std::string("vram::PinnedStagingPool::") + caller +
                          ": witness refused: " + refusal +
                          ". The buffer stays with the caller. Fix: wait() every PendingCopy "
                          "issued from this lease and retire with one of their witnesses.");
  }
  PinnedBuffer kept = std::move(buffer);
  kept.lease_.reset();  // the loan ends; the next acquire() makes a new one
  if (pool.try_keep(kept)) {
    pool.retired.fetch_add(1, std::memory_order_relaxed);
  } else {
    pool.freed_over_bounds.fetch_add(1, std::memory_order_relaxed);
  }  // else `kept` is freed here, outside the lock
}

void PinnedStagingPool::retire(PinnedBuffer&& buffer, CopyCompleted completed) {
  if (!buffer) return;
  auto& s = live_state("retire");  // moved from: the buffer stays with the caller
  if (!buffer.lease_ || buffer.lease_->pool_id != s.id) {
    s.foreign_buffers.fetch_add(1, std::memory_order_relaxed);
    throw InvalidArgument(
        "vram::PinnedStagingPool::retire: this PinnedBuffer is not a lease of this pool (" +
        std::string(buffer.lease_ ? "another pool's" : "made outside any pool") +
        "). The buffer stays with the caller. Fix: retire a buffer to the pool it was "
        "acquired from; a buffer made by hand is freed by destroying it.");
  }
  take_back(s, buffer, completed, "retire");
}

void PinnedStagingPool::reserve(std::size_t count, std::size_t len) {
  auto& s = live_state("reserve");
  if (len == 0) throw InvalidArgument("vram::PinnedStagingPool::reserve: zero bytes requested.");
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
  if (!state_) return;  // a moved-from pool holds nothing
  std::vector<PinnedBuffer> dropped;
  {
    std::lock_guard lock(state_->mutex);
    dropped.swap(state_->free_list);
    state_->free_bytes = 0;
  }
}

bool PinnedStagingPool::can_retain_concurrent(std::size_t len, std::size_t count) const noexcept {
  if (!state_) return false;
  const auto& options = state_->options;
  if (count > options.max_buffers) return false;
  return count == 0 || len <= options.max_bytes / count;
}

PinnedStagingStats PinnedStagingPool::stats() const {
  const auto& s = live_state("stats");
  PinnedStagingStats out;
  out.pin_calls = s.pin_calls.load(std::memory_order_relaxed);
  out.reuses = s.reuses.load(std::memory_order_relaxed);
  out.retired = s.retired.load(std::memory_order_relaxed);
  out.freed_over_bounds = s.freed_over_bounds.load(std::memory_order_relaxed);
  out.freed_without_witness = s.freed_without_witness.load(std::memory_order_relaxed);
  out.witness_mismatches = s.witness_mismatches.load(std::memory_order_relaxed);
  out.foreign_buffers = s.foreign_buffers.load(std::memory_order_relaxed);
  std::lock_guard lock(s.mutex);
  out.free_buffers = s.free_list.size();
  out.free_bytes = s.free_bytes;
  return out;
}

void PinnedStagingPool::reset_counters() noexcept {
  if (!state_) return;
  auto& s = *state_;
  for (auto* counter : {&s.pin_calls, &s.reuses, &s.retired, &s.freed_over_bounds,
                        &s.freed_without_witness, &s.witness_mismatches, &s.foreign_buffers}) {
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
  static const Options defaults{};
  return state_ ? state_->options : defaults;
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
  if (!buffer_ || !pool_) {
    throw InvalidArgument(
        "vram::PooledStaging::retire: this lease is empty (moved from, already retired, or "
        "into_inner()). Fix: retire the lease that holds the buffer.");
  }
  PinnedStagingPool::take_back(*pool_, buffer_, completed, "retire");  // throws if refused
  pool_.reset();
  len_ = 0;
}

PinnedBuffer PooledStaging::into_inner() noexcept {
  if (buffer_ && buffer_.lease_) buffer_.lease_->raw_owner = pool_;
  pool_.reset();
  len_ = 0;
  return std::move(buffer_);
}

}  // namespace vram
