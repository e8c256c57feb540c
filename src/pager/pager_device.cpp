// src/pager/pager_device.cpp: the weight pager's CUDA device (PagerDevice), the production
// side of the seam in vram/weight_pager.hpp.
//
// What it owns: the host weights' registrations, the device arena (freed at shutdown), the
// copy stream, one ready event a slot (recorded after the slot's latest page-in), one
// release event a slot and stream (re-recorded by each release on that stream: it covers
// the earlier ones), the timing samples, and for pageable weights the PageableStager.
//
// Invariants
//   - A page-in waits (on the copy stream, never on the host) for every release event
//     recorded for its slot since the slot's previous page-in.
//   - A timing sample is read only once its events completed (Event::ready()), never
//     waited for; a sample evicted before its acquire is read as an orphan (copy time only).
//   - shutdown() stops the stager, waits for the release events and the copy stream, then
//     frees the arena and unregisters the host weights; it runs once the pager is closed.
#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda/event_pool.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/memory.hpp"
#include "staging/pageable_stager.hpp"
#include "vram/copy.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/event.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/upstream.hpp"
#include "vram/weight_pager.hpp"

namespace vram::cuda {
namespace {

constexpr std::size_t kMaxRegisterChunk = std::size_t{2} << 30;
constexpr std::size_t kTimingSamples = 8;

// One sampled page-in: its copy time and, once acquired, how long the compute waited.
struct TimingSample {
  enum class State { free, attached, needed, orphaned };
  Event start{Event::Timing::enabled};
  Event end{Event::Timing::enabled};
  Event need{Event::Timing::enabled};
  std::size_t bytes = 0;
  State state = State::free;
  std::atomic<bool> recorded{false};  // start and end recorded (by the stager thread)
};

struct SlotEvents {
  Event ready;  // recorded on the copy stream after the slot's latest page-in
  // Release events since the slot's latest page-in, one per stream (a later release on the
  // same stream re-records it: it covers the earlier one).
  std::vector<Event> releases;
  std::vector<cudaStream_t> release_streams;
  std::size_t recorded = 0;
  std::uint64_t wanted = 0;        // staged: ticket of the latest page-in queued
  TimingSample* sample = nullptr;  // the latest page-in's sample, until acquired
};

// Pageable weights: the PageableStager (src/staging/pageable_stager.hpp) stages each
// page-in through pinned buffers on its driver thread; this is its CUDA side: the copy
// stream, the slot's release and ready events, the timing sample.
class CudaStagedTarget final : public vram::detail::StagedCopyTarget {
 public:
  CudaStagedTarget(int device, cudaStream_t copy, std::vector<SlotEvents>& slots)
      : device_(device), copy_(copy), slots_(slots) {}

  void bind_thread() override { set_current_device(device_); }

  // The job's releases were recorded before it was queued and are not re-recorded until
  // the slot's new layer is acquired, which waits for this job to be issued.
  void begin(const vram::detail::StagerJob& job) override {
    SlotEvents& slot = slots_[job.slot];
    for (std::size_t i = 0; i < job.release_count; ++i) slot.releases[i].make_wait(copy_);
    if (auto* sample = static_cast<TimingSample*>(job.context)) sample->start.record(copy_);
  }

  PendingCopy copy(std::byte* device, PooledStaging& staging) override {
    return vram::copy_to_device_async(device, staging, copy_);
  }

  void end(const vram::detail::StagerJob& job) override {
    if (auto* sample = static_cast<TimingSample*>(job.context)) {
      sample->end.record(copy_);
      sample->recorded.store(true, std::memory_order_release);
    }
    slots_[job.slot].ready.record(copy_);
  }

 private:
  int device_;
  cudaStream_t copy_;
  std::vector<SlotEvents>& slots_;
};

class CudaPagerDevice final : public PagerDevice {
 public:
  explicit CudaPagerDevice(int device) : device_(device) {
    DeviceGuard guard(device_);  // throws a CudaError for a bad ordinal
  }
  ~CudaPagerDevice() override { shutdown(nullptr, 0); }

  std::size_t first_device_range(std::span<const HostRange> ranges) override {
    DeviceGuard guard(device_);
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      if (pointer_info(ranges[i].data).kind == PointerKind::device) return i;
    }
    return ranges.size();
  }

  std::string pin_host(std::span<const HostRange> ranges, std::size_t chunk_bytes,
                       WeightPagerLoad& load) override {
    DeviceGuard guard(device_);
    const auto start = std::chrono::steady_clock::now();
    std::vector<cuda::HostRange> unpinned;
    for (const auto& range : ranges) {
      if (pointer_info(range.data).kind == PointerKind::pinned_host) {
        load.already_pinned_bytes += range.bytes;  // page-locked by its owner: used as is
        continue;
      }
      unpinned.push_back({range.data, range.bytes});
    }
    const std::size_t chunk = std::max<std::size_t>(1, std::min(chunk_bytes, kMaxRegisterChunk));
    if (const auto failure = register_host_pages(unpinned, chunk, registered_)) {
      unregister_host_pages(registered_);
      load.pinned_bytes = 0;
      load.register_calls = 0;
      return failure->reason + ", which CUDA pinning may ignore";
    }
    for (const auto& registration : registered_) load.pinned_bytes += registration.bytes;
    load.register_calls = registered_.size();
    load.pin_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return {};
  }

  void* allocate_arena(std::size_t bytes) override {
    return DeviceMemoryUpstream(device_).allocate(bytes);  // OutOfMemory names the size
  }

  // A resident layer may share its first or last page with a streamed (registered) one.
  void upload(void* device, const void* host, std::size_t bytes) override {
    DeviceGuard guard(device_);
    for_each_registered_piece(
        host, bytes, [&](std::size_t offset, const void* at, std::size_t piece) {
          copy_to_device(static_cast<std::byte*>(device) + offset, at, piece, "cudaMemcpy(upload)");
        });
  }

  void configure(std::size_t slot_count, bool staged, const WeightPagerOptions& options) override {
    DeviceGuard guard(device_);
    copy_.emplace();
    slots_.resize(slot_count);
    for (auto& slot : slots_) {
      slot.releases.reserve(4);
      slot.release_streams.reserve(4);
    }
    period_ = options.stall_sample_period;
    if (period_ != 0) {
      for (auto& sample : samples_) sample = std::make_unique<TimingSample>();
    }
    if (staged && slot_count > 0) {
      target_ = std::make_unique<CudaStagedTarget>(device_, copy_->get(), slots_);
      stager_ = std::make_unique<vram::detail::PageableStager>(
          *target_, vram::detail::PageableStagerOptions{.slot_count = slot_count,
                                                        .chunk_bytes = options.staging_chunk_bytes,
                                                        .staging_buffers = options.staging_buffers,
                                                        .fill_threads = options.fill_threads,
                                                        .streaming_fill = options.streaming_fill,
                                                        .staging_upstream = nullptr});
    }
  }

  void page_in(std::size_t slot_index, void* device, const void* host, std::size_t bytes) override {
    DeviceGuard guard(device_);
    SlotEvents& slot = slots_[slot_index];
    if (slot.sample != nullptr) {  // evicted before it was acquired: no compute wait to see
      slot.sample->state = TimingSample::State::orphaned;
      slot.sample = nullptr;
    }
    TimingSample* sample = take_sample(bytes);
    const std::size_t releases = slot.recorded;
    slot.recorded = 0;
    slot.sample = sample;
    if (stager_) {
      slot.wanted = ++tickets_;
      stager_->enqueue(vram::detail::StagerJob{slot_index, static_cast<std::byte*>(device),
                                               static_cast<const std::byte*>(host), bytes,
                                               slot.wanted, releases, sample});
      return;
    }
    const cudaStream_t copy = copy_->get();
    for (std::size_t i = 0; i < releases; ++i) slot.releases[i].make_wait(copy);
    if (sample != nullptr) sample->start.record(copy);
    copy_registered(static_cast<std::byte*>(device), host, bytes, copy);
    if (sample != nullptr) {
      sample->end.record(copy);
      sample->recorded.store(true, std::memory_order_release);
    }
    slot.ready.record(copy);
  }

  void wait_ready(std::size_t slot_index, cudaStream_t stream) override {
    SlotEvents& slot = slots_[slot_index];
    if (stager_) host_wait_ms_ += stager_->wait_issued(slot_index, slot.wanted);
    DeviceGuard guard(device_);
    if (slot.sample != nullptr) {
      slot.sample->need.record(stream);  // when the compute asked for the layer
      slot.sample->state = TimingSample::State::needed;
      slot.sample = nullptr;
    }
    slot.ready.make_wait(stream);
  }

  void record_release(std::size_t slot_index, cudaStream_t stream) override {
    DeviceGuard guard(device_);
    SlotEvents& slot = slots_[slot_index];
    std::size_t index = 0;
    while (index < slot.recorded && slot.release_streams[index] != stream) ++index;
    if (index == slot.releases.size()) {  // a new stream: cold, once per slot and stream
      slot.releases.emplace_back();
      slot.release_streams.push_back(stream);
    }
    slot.release_streams[index] = stream;
    slot.releases[index].record(stream);
    slot.recorded = std::max(slot.recorded, index + 1);
  }

  void collect(WeightPagerStats& stats) override {
    harvest();
    stats.timed_page_ins += timed_;
    stats.timed_bytes += timed_bytes_;
    stats.timed_copy_ms += timed_ms_;
    stats.stall_samples += stall_samples_;
    stats.stalled += stalled_;
    stats.stall_ms_sampled += stall_ms_;
    stats.host_wait_ms += host_wait_ms_;
    if (stager_) stats.staging_pin_calls = stager_->pins_after_load();
    timed_ = timed_bytes_ = stall_samples_ = stalled_ = 0;
    timed_ms_ = stall_ms_ = host_wait_ms_ = 0;
  }

  void synchronize() override {
    if (stager_) stager_->drain();
    if (copy_) copy_->synchronize();
  }

  void shutdown(void* arena, std::size_t arena_bytes) noexcept override {
    if (stager_) {
      stager_->stop();
      stager_.reset();
    }
    // The slot memory may be overwritten or freed only after the compute that read it.
    for (auto& slot : slots_) {
      for (std::size_t i = 0; i < slot.recorded; ++i) cuda::synchronize(slot.releases[i].get());
      slot.recorded = 0;
    }
    if (copy_) (void)try_synchronize_stream(copy_->get());
    (void)arena_bytes;
    free_device(arena);
    unregister_host_pages(registered_);
  }

 private:
  TimingSample* take_sample(std::size_t bytes) {
    if (period_ == 0 || ++page_in_count_ % period_ != 0) return nullptr;
    for (int pass = 0; pass < 2; ++pass) {
      for (auto& sample : samples_) {
        if (sample && sample->state == TimingSample::State::free) {
          sample->state = TimingSample::State::attached;
          sample->bytes = bytes;
          sample->recorded.store(false, std::memory_order_relaxed);
          return sample.get();
        }
      }
      harvest();  // none free: read the completed ones (non-blocking), then look again
    }
    return nullptr;
  }

  void harvest() {
    for (auto& sample : samples_) {
      if (!sample) continue;
      const auto state = sample->state;
      if (state != TimingSample::State::needed && state != TimingSample::State::orphaned) {
        continue;
      }
      if (!sample->recorded.load(std::memory_order_acquire) || !sample->end.ready()) continue;
      if (state == TimingSample::State::needed && !sample->need.ready()) continue;
      timed_ += 1;
      timed_bytes_ += sample->bytes;
      timed_ms_ += Event::elapsed_ms(sample->start, sample->end);
      if (state == TimingSample::State::needed) {
        const float waited = Event::elapsed_ms(sample->need, sample->end);
        ++stall_samples_;
        if (waited > 0) {
          ++stalled_;
          stall_ms_ += waited;
        }
      }
      sample->state = TimingSample::State::free;
    }
  }

  // One copy per registration the source range crosses: CUDA wants a copy's host range
  // inside one registration (or none). registered_ is sorted by address (it is filled from
  // sorted, merged ranges), so a layer inside one registration is a single copy.
  void copy_registered(std::byte* device, const void* host, std::size_t bytes, cudaStream_t copy) {
    for_each_registered_piece(
        host, bytes, [&](std::size_t offset, const void* at, std::size_t piece) {
          copy_to_device_async(device + offset, at, piece, copy, "cudaMemcpyAsync(page-in)");
        });
  }

  // Calls copy(offset, host + offset, piece) for consecutive pieces of [host, host + bytes),
  // each inside one registration or outside all of them.
  template <typename Copy>
  void for_each_registered_piece(const void* host, std::size_t bytes, Copy&& copy) const {
    const auto first = reinterpret_cast<std::uintptr_t>(host);
    std::uintptr_t at = first;
    const std::uintptr_t end = at + bytes;
    while (at < end) {
      std::size_t piece = end - at;
      auto after = std::upper_bound(
          registered_.begin(), registered_.end(), at,
          [](std::uintptr_t address, const HostRegistration& registration) {
            return address < reinterpret_cast<std::uintptr_t>(registration.pointer);
          });
      if (after != registered_.begin()) {
        const auto begin = reinterpret_cast<std::uintptr_t>(std::prev(after)->pointer);
        const std::uintptr_t stop = begin + std::prev(after)->bytes;
        if (at < stop) piece = std::min<std::size_t>(piece, stop - at);
      }
      if (after != registered_.end()) {  // the next registration starts a new piece
        const auto next = reinterpret_cast<std::uintptr_t>(after->pointer);
        if (next > at) piece = std::min<std::size_t>(piece, next - at);
      }
      copy(static_cast<std::size_t>(at - first), reinterpret_cast<const void*>(at), piece);
      at += piece;
    }
  }

  int device_;
  std::vector<HostRegistration> registered_;  // in address order
  std::optional<Stream> copy_;
  std::vector<SlotEvents> slots_;
  std::array<std::unique_ptr<TimingSample>, kTimingSamples> samples_{};
  unsigned period_ = 0;
  std::uint64_t page_in_count_ = 0;
  std::uint64_t tickets_ = 0;
  std::uint64_t timed_ = 0;
  std::uint64_t timed_bytes_ = 0;
  std::uint64_t stall_samples_ = 0;
  std::uint64_t stalled_ = 0;
  double timed_ms_ = 0;
  double stall_ms_ = 0;
  double host_wait_ms_ = 0;
  std::unique_ptr<CudaStagedTarget> target_;
  std::unique_ptr<vram::detail::PageableStager> stager_;  // last: stopped first (uses target_)
};

}  // namespace
}  // namespace vram::cuda

namespace vram {

std::unique_ptr<PagerDevice> make_cuda_pager_device(int device) {
  return std::make_unique<cuda::CudaPagerDevice>(device);
}

}  // namespace vram
