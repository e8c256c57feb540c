#include "vram/copy.hpp"

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cuda/memory.hpp"
#include "staging_lease.hpp"
#include "vram/cuda/error.hpp"
#include "vram/pinned_staging_pool.hpp"

namespace vram {
namespace {

// Timing events recycled per thread: creating and destroying two events per copy costs
// microseconds that a small page-in feels. An event goes back only after the host saw it
// complete, so a recycled event is never still pending.
constexpr std::size_t kMaxCachedEvents = 16;
thread_local std::vector<cuda::Event> tl_event_cache;

cuda::Event take_timing_event() {
  if (!tl_event_cache.empty()) {
    cuda::Event event = std::move(tl_event_cache.back());
    tl_event_cache.pop_back();
    return event;
  }
  return cuda::Event(cuda::Event::Timing::enabled);
}

void recycle_timing_event(std::optional<cuda::Event>& event) noexcept {
  if (!event || event->get() == nullptr || tl_event_cache.size() >= kMaxCachedEvents) {
    event.reset();
    return;
  }
  try {
    tl_event_cache.push_back(std::move(*event));
  } catch (...) {  // no room: the event is simply destroyed
  }
  event.reset();
}

void check_copy_arguments(const void* device_destination, const void* host_source,
                          std::size_t bytes) {
  if (bytes == 0) {
    throw InvalidArgument("vram::copy_to_device: zero bytes. Fix: skip empty copies.");
  }
  if (device_destination == nullptr || host_source == nullptr) {
    throw InvalidArgument("vram::copy_to_device: null destination or source.");
  }
}

}  // namespace

PendingCopy copy_to_device_async(void* device_destination, const void* host_source,
                                 std::size_t bytes, cudaStream_t stream) {
  check_copy_arguments(device_destination, host_source, bytes);
  PendingCopy copy;
  copy.start_.emplace(take_timing_event());
  copy.end_.emplace(take_timing_event());
  copy.start_->record(stream);
  cuda::copy_to_device_async(device_destination, host_source, bytes, stream,
                             "cudaMemcpyAsync(HostToDevice)");
  copy.record_end(stream);
  return copy;
}

PendingCopy copy_to_device_async(void* device_destination, PooledStaging& source,
                                 std::size_t offset, std::size_t bytes, cudaStream_t stream) {
  if (!source) {
    throw InvalidArgument(
        "vram::copy_to_device: the staging lease is empty (moved from or returned). Fix: "
        "copy from a lease you still hold.");
  }
  if (offset > source.len() || bytes > source.len() - offset) {
    throw InvalidArgument("vram::copy_to_device: range [" + std::to_string(offset) + ", +" +
                          std::to_string(bytes) + ") lies outside the staging lease of " +
                          std::to_string(source.len()) + " bytes.");
  }
  check_copy_arguments(device_destination, source.data(), bytes);
  const auto& lease = PendingCopy::lease_of(source);
  PendingCopy copy;
  copy.start_.emplace(take_timing_event());
  copy.end_.emplace(take_timing_event());
  copy.start_->record(stream);
  cuda::copy_to_device_async(device_destination, source.data() + offset, bytes, stream,
                             "cudaMemcpyAsync(HostToDevice)");
  // The copy is queued: count it on the lease before anything else can throw, so the
  // buffer cannot be retired until this copy is observed complete.
  copy.lease_ = lease;
  copy.sequence_ = lease->copies_enqueued.fetch_add(1, std::memory_order_acq_rel) + 1;
  copy.record_end(stream);
  return copy;
}

PendingCopy copy_to_device_async(void* device_destination, PooledStaging& source,
                                 cudaStream_t stream) {
  return copy_to_device_async(device_destination, source, 0, source.len(), stream);
}

CopyResult copy_to_device(void* device_destination, const void* host_source, std::size_t bytes,
                          cudaStream_t stream) {
  return copy_to_device_async(device_destination, host_source, bytes, stream).wait_timed();
}

CopyResult copy_to_device(void* device_destination, PooledStaging& source, cudaStream_t stream) {
  return copy_to_device_async(device_destination, source, stream).wait_timed();
}

PendingCopy PendingCopy::host_fenced(detail::MintKey, PooledStaging& staging,
                                     std::unique_ptr<detail::HostFence> fence) {
  if (!staging || !fence) {
    throw InvalidArgument("vram::PendingCopy::host_fenced: empty lease or null fence.");
  }
  PendingCopy copy;
  copy.host_fence_ = std::move(fence);
  copy.lease_ = lease_of(staging);
  copy.sequence_ = copy.lease_->copies_enqueued.fetch_add(1, std::memory_order_acq_rel) + 1;
  copy.pending_ = true;
  return copy;
}

const std::shared_ptr<detail::StagingLease>& PendingCopy::lease_of(PooledStaging& staging) {
  return staging.buffer_.lease_;
}

void PendingCopy::record_end(cudaStream_t stream) {
  try {
    end_->record(stream);
  } catch (...) {
    // The copy is queued but has no end event: drain the stream instead. If even that
    // fails, the copy stays unobserved: the lease can never be retired and the buffer's
    // memory is leaked (kept parked) rather than reused.
    if (cuda::try_synchronize_stream(stream)) {
      mark_observed();
    } else if (lease_) {
      (void)new std::shared_ptr<detail::StagingLease>(lease_);
    }
    throw;
  }
  pending_ = true;  // from here on the destructor waits for the copy's end event
}

PendingCopy::PendingCopy(PendingCopy&& other) noexcept
    : lease_(std::move(other.lease_)),
      sequence_(std::exchange(other.sequence_, 0)),
      start_(std::move(other.start_)),
      end_(std::move(other.end_)),
      host_fence_(std::move(other.host_fence_)),
      pending_(std::exchange(other.pending_, false)) {
  other.start_.reset();
  other.end_.reset();
}

PendingCopy& PendingCopy::operator=(PendingCopy&& other) noexcept {
  if (this != &other) {
    abandon();  // the copy this object still tracks must end before it is forgotten
    lease_ = std::move(other.lease_);
    sequence_ = std::exchange(other.sequence_, 0);
    start_ = std::move(other.start_);
    end_ = std::move(other.end_);
    host_fence_ = std::move(other.host_fence_);
    pending_ = std::exchange(other.pending_, false);
    other.start_.reset();
    other.end_.reset();
  }
  return *this;
}

PendingCopy::~PendingCopy() { abandon(); }

void PendingCopy::wait_fence() {
  if (host_fence_) {
    host_fence_->wait();
  } else if (end_) {
    end_->wait();
  }
}

void PendingCopy::mark_observed() noexcept {
  if (lease_) lease_->copies_completed.fetch_add(1, std::memory_order_acq_rel);
}

void PendingCopy::abandon() noexcept {
  if (pending_) {
    try {
      wait_fence();  // the source must not be reused or freed while the DMA reads it
    } catch (const std::exception& error) {
      std::fprintf(stderr,
                   "vram::PendingCopy: waiting for an abandoned copy failed (%s); its "
                   "staging buffer is leaked rather than freed or reused\n",
                   error.what());
      // The copy may still read the buffer: keep the ledger (and any parked memory) alive
      // for the life of the process, and leave the copy unobserved so the lease can never
      // be retired. The events may still be pending: not recycled.
      if (lease_) (void)new std::shared_ptr<detail::StagingLease>(std::move(lease_));
      if (start_) (void)new cuda::Event(std::move(*start_));
      if (end_) (void)new cuda::Event(std::move(*end_));
      start_.reset();
      end_.reset();
      host_fence_.reset();
      pending_ = false;
      return;
    }
    mark_observed();
    pending_ = false;
  }
  recycle_timing_event(start_);
  recycle_timing_event(end_);
  host_fence_.reset();
  lease_.reset();
  sequence_ = 0;
}

bool PendingCopy::ready() const {
  if (!pending_) return true;
  if (host_fence_) return host_fence_->ready();
  return !end_ || end_->ready();
}

CopyCompleted PendingCopy::wait() && {
  if (!pending_) {
    throw InvalidArgument(
        "vram::PendingCopy::wait: this copy was already waited for (or moved from); a copy "
        "yields exactly one CopyCompleted. Fix: keep the witness from the first wait().");
  }
  wait_fence();  // host-observed completion: only now may a witness exist
  mark_observed();
  pending_ = false;
  CopyCompleted witness(detail::MintKey{}, lease_ ? lease_->id : 0, sequence_);
  abandon();  // nothing pending: recycles the events and lets go of the ledger
  return witness;
}

CopyResult PendingCopy::wait_timed() && {
  if (!pending_) {
    throw InvalidArgument(
        "vram::PendingCopy::wait_timed: this copy was already waited for (or moved from).");
  }
  wait_fence();
  float elapsed = 0.0F;
  if (start_ && end_) elapsed = cuda::Event::elapsed_ms(*start_, *end_);
  CopyCompleted witness = std::move(*this).wait();  // the fence is ready: returns at once
  return CopyResult{std::move(witness), elapsed};
}

}  // namespace vram
