#include "vram/weight_pager.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "vram/copy.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/event.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/detail/pageable_stager.hpp"
#include "vram/pinned_host_upstream.hpp"
#include "vram/pinned_staging_pool.hpp"
#include "vram/upstream.hpp"

namespace vram {
namespace {

constexpr std::size_t kPage = 4096;
constexpr std::size_t kMaxRegisterChunk = std::size_t{2} << 30;
constexpr std::size_t kTimingSamples = 8;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One sampled page-in: its copy time and, once acquired, how long the compute waited.
struct TimingSample {
  enum class State { free, attached, needed, orphaned };
  cuda::Event start{cuda::Event::Timing::enabled};
  cuda::Event end{cuda::Event::Timing::enabled};
  cuda::Event need{cuda::Event::Timing::enabled};
  std::size_t bytes = 0;
  State state = State::free;
  std::atomic<bool> recorded{false};  // start and end recorded (by the stager thread)
};

struct SlotEvents {
  cuda::Event ready;  // recorded on the copy stream after the slot's latest page-in
  // Release events since the slot's latest page-in, one per stream (a later release on the
  // same stream re-records it: it covers the earlier one).
  std::vector<cuda::Event> releases;
  std::vector<cudaStream_t> release_streams;
  std::size_t recorded = 0;
  std::uint64_t wanted = 0;        // staged: ticket of the latest page-in queued
  TimingSample* sample = nullptr;  // the latest page-in's sample, until acquired
};

// Pageable weights: the PageableStager (vram/detail/pageable_stager.hpp) stages each
// page-in through pinned buffers on its driver thread; this is its CUDA side: the copy
// stream, the slot's release and ready events, the timing sample.
class CudaStagedTarget final : public detail::StagedCopyTarget {
 public:
  CudaStagedTarget(int device, cudaStream_t copy, std::vector<SlotEvents>& slots)
      : device_(device), copy_(copy), slots_(slots) {}

  void bind_thread() override { cuda::check(cudaSetDevice(device_), "cudaSetDevice"); }

  // The job's releases were recorded before it was queued and are not re-recorded until
  // the slot's new layer is acquired, which waits for this job to be issued.
  void begin(const detail::StagerJob& job) override {
    SlotEvents& slot = slots_[job.slot];
    for (std::size_t i = 0; i < job.release_count; ++i) slot.releases[i].make_wait(copy_);
    if (auto* sample = static_cast<TimingSample*>(job.context)) sample->start.record(copy_);
  }

  PendingCopy copy(std::byte* device, PooledStaging& staging) override {
    return copy_to_device_async(device, staging, copy_);
  }

  void end(const detail::StagerJob& job) override {
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
    cuda::DeviceGuard guard(device_);  // throws a CudaError for a bad ordinal
  }
  ~CudaPagerDevice() override { shutdown(nullptr, 0); }

  std::size_t first_device_range(std::span<const HostRange> ranges) override {
    cuda::DeviceGuard guard(device_);
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      cudaPointerAttributes attributes{};
      const cudaError_t status = cudaPointerGetAttributes(&attributes, ranges[i].data);
      if (status != cudaSuccess) {
        (void)cudaGetLastError();
        continue;  // unknown to CUDA: plain host memory
      }
      if (attributes.type == cudaMemoryTypeDevice) return i;
    }
    return ranges.size();
  }

  std::string pin_host(std::span<const HostRange> ranges, std::size_t chunk_bytes,
                       WeightPagerLoad& load) override {
    cuda::DeviceGuard guard(device_);
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> pages;  // [begin, end)
    for (const auto& range : ranges) {
      cudaPointerAttributes attributes{};
      if (cudaPointerGetAttributes(&attributes, range.data) == cudaSuccess &&
          attributes.type == cudaMemoryTypeHost) {
        load.already_pinned_bytes += range.bytes;  // page-locked by its owner: used as is
        continue;
      }
      (void)cudaGetLastError();
      const auto begin = reinterpret_cast<std::uintptr_t>(range.data) / kPage * kPage;
      const auto end =
          (reinterpret_cast<std::uintptr_t>(range.data) + range.bytes + kPage - 1) / kPage * kPage;
      pages.emplace_back(begin, end);
    }
    std::sort(pages.begin(), pages.end());
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> merged;
    for (const auto& range : pages) {
      if (!merged.empty() && range.first <= merged.back().second) {
        merged.back().second = std::max(merged.back().second, range.second);
      } else {
        merged.push_back(range);
      }
    }
    const std::size_t chunk =
        std::max(kPage, std::min(chunk_bytes, kMaxRegisterChunk) / kPage * kPage);
    for (const auto& [begin, end] : merged) {
      for (std::uintptr_t at = begin; at < end; at += chunk) {
        const std::size_t length = std::min<std::size_t>(chunk, end - at);
        void* pointer = reinterpret_cast<void*>(at);
        const cudaError_t status = cudaHostRegister(pointer, length, cudaHostRegisterPortable);
        if (status != cudaSuccess) {
          (void)cudaGetLastError();
          std::string reason = std::string("cudaHostRegister of ") + std::to_string(length) +
                               " bytes returned " + cudaGetErrorName(status) + " (" +
                               cudaGetErrorString(status) + "; RLIMIT_MEMLOCK " +
                               memlock_limit_text() + ", which CUDA pinning may ignore)";
          unregister_all();
          load.pinned_bytes = 0;
          load.register_calls = 0;
          return reason;
        }
        registered_.emplace_back(pointer, length);
        load.pinned_bytes += length;
        ++load.register_calls;
      }
    }
    load.pin_seconds = seconds_since(start);
    return {};
  }

  void* allocate_arena(std::size_t bytes) override {
    return DeviceMemoryUpstream(device_).allocate(bytes);  // OutOfMemory names the size
  }

  void upload(void* device, const void* host, std::size_t bytes) override {
    cuda::DeviceGuard guard(device_);
    cuda::check(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy(upload)");
  }

  void configure(std::size_t slot_count, bool staged, const WeightPagerOptions& options) override {
    cuda::DeviceGuard guard(device_);
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
      stager_ = std::make_unique<detail::PageableStager>(
          *target_, detail::PageableStagerOptions{.slot_count = slot_count,
                                                  .chunk_bytes = options.staging_chunk_bytes,
                                                  .staging_buffers = options.staging_buffers,
                                                  .fill_threads = options.fill_threads,
                                                  .streaming_fill = options.streaming_fill,
                                                  .staging_upstream = nullptr});
    }
  }

  void page_in(std::size_t slot_index, void* device, const void* host, std::size_t bytes) override {
    cuda::DeviceGuard guard(device_);
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
      stager_->enqueue(detail::StagerJob{slot_index, static_cast<std::byte*>(device),
                                         static_cast<const std::byte*>(host), bytes, slot.wanted,
                                         releases, sample});
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
    cuda::DeviceGuard guard(device_);
    if (slot.sample != nullptr) {
      slot.sample->need.record(stream);  // when the compute asked for the layer
      slot.sample->state = TimingSample::State::needed;
      slot.sample = nullptr;
    }
    slot.ready.make_wait(stream);
  }

  void record_release(std::size_t slot_index, cudaStream_t stream) override {
    cuda::DeviceGuard guard(device_);
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
      for (std::size_t i = 0; i < slot.recorded; ++i) {
        if (cudaEventSynchronize(slot.releases[i].get()) != cudaSuccess) (void)cudaGetLastError();
      }
      slot.recorded = 0;
    }
    if (copy_ && cudaStreamSynchronize(copy_->get()) != cudaSuccess) (void)cudaGetLastError();
    (void)arena_bytes;
    if (arena != nullptr && cudaFree(arena) != cudaSuccess) (void)cudaGetLastError();
    unregister_all();
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

  static bool complete(const cuda::Event& event) {
    const cudaError_t status = cudaEventQuery(event.get());
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    cuda::check(status, "cudaEventQuery(pager timing)");
    return true;
  }

  void harvest() {
    for (auto& sample : samples_) {
      if (!sample) continue;
      const auto state = sample->state;
      if (state != TimingSample::State::needed && state != TimingSample::State::orphaned) {
        continue;
      }
      if (!sample->recorded.load(std::memory_order_acquire) || !complete(sample->end)) continue;
      if (state == TimingSample::State::needed && !complete(sample->need)) continue;
      timed_ += 1;
      timed_bytes_ += sample->bytes;
      timed_ms_ += cuda::Event::elapsed_ms(sample->start, sample->end);
      if (state == TimingSample::State::needed) {
        const float waited = cuda::Event::elapsed_ms(sample->need, sample->end);
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
    auto at = reinterpret_cast<std::uintptr_t>(host);
    const std::uintptr_t end = at + bytes;
    while (at < end) {
      std::size_t piece = end - at;
      auto after = std::upper_bound(
          registered_.begin(), registered_.end(), at,
          [](std::uintptr_t address, const std::pair<void*, std::size_t>& registration) {
            return address < reinterpret_cast<std::uintptr_t>(registration.first);
          });
      if (after != registered_.begin()) {
        const auto begin = reinterpret_cast<std::uintptr_t>(std::prev(after)->first);
        const std::uintptr_t stop = begin + std::prev(after)->second;
        if (at < stop) piece = std::min<std::size_t>(piece, stop - at);
      }
      if (after != registered_.end()) {  // the next registration starts a new piece
        const auto next = reinterpret_cast<std::uintptr_t>(after->first);
        if (next > at) piece = std::min<std::size_t>(piece, next - at);
      }
      cuda::check(cudaMemcpyAsync(device, reinterpret_cast<const void*>(at), piece,
                                  cudaMemcpyHostToDevice, copy),
                  "cudaMemcpyAsync(page-in)");
      device += piece;
      at += piece;
    }
  }

  void unregister_all() noexcept {
    for (const auto& [pointer, length] : registered_) {
      (void)length;
      if (cudaHostUnregister(pointer) != cudaSuccess) (void)cudaGetLastError();
    }
    registered_.clear();
  }

  int device_;
  std::vector<std::pair<void*, std::size_t>> registered_;
  std::optional<cuda::Stream> copy_;
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
  std::unique_ptr<detail::PageableStager> stager_;  // last: stopped first (uses target_)
};

}  // namespace

std::unique_ptr<PagerDevice> make_cuda_pager_device(int device) {
  return std::make_unique<CudaPagerDevice>(device);
}

namespace detail {

struct PagerState {
  std::mutex mutex;
  std::vector<WeightLayer> layers;
  std::map<std::string, std::size_t, std::less<>> names;
  WeightPagerOptions options;
  std::unique_ptr<PagerDevice> device;
  std::optional<PagerSchedule> schedule;
  WeightPagerLoad load;
  std::byte* arena = nullptr;
  std::size_t arena_bytes = 0;
  WeightPagerStats counters;
  std::string broken;  // the first failure inside acquire/release: the pager is unusable

  ~PagerState() {
    if (schedule && schedule->layers_acquired() > 0) {
      std::fprintf(stderr,
                   "vram::WeightPager: destroyed with %zu layer(s) still acquired; their device "
                   "memory is freed now (after the release events recorded so far).\n",
                   schedule->layers_acquired());
    }
    if (device) device->shutdown(arena, arena_bytes);
  }

  void check_usable() const {
    if (!broken.empty()) {
      throw InvalidArgument("vram::WeightPager: unusable after an earlier failure: " + broken);
    }
  }

  std::size_t index_of(std::string_view name) const {
    auto found = names.find(name);
    if (found == names.end()) {
      throw InvalidArgument("vram::WeightPager: no layer named '" + std::string(name) + "'.");
    }
    return found->second;
  }

  void* acquire(std::size_t layer, cudaStream_t stream) {
    std::lock_guard lock(mutex);
    check_usable();
    const PagerSchedule::Acquired acquired = schedule->acquire(layer);  // throws: no change
    const PagerPlan& plan = schedule->plan();
    try {
      for (const auto& page_in : acquired.page_ins) {
        const WeightLayer& source = layers[page_in.layer];
        device->page_in(page_in.slot, arena + plan.slot_offset(page_in.slot), source.host,
                        source.bytes);
        counters.bytes_paged_in += source.bytes;
        counters.prefetches += page_in.prefetch ? 1 : 0;
      }
      if (!acquired.resident) device->wait_ready(acquired.slot, stream);
    } catch (const std::exception& error) {
      broken = error.what();
      throw;
    }
    ++counters.acquires;
    counters.hits += acquired.hit ? 1 : 0;
    counters.page_ins += acquired.page_ins.size();
    return acquired.resident ? arena + plan.offset[layer] : arena + plan.slot_offset(acquired.slot);
  }

  void release(std::size_t layer, cudaStream_t stream) {
    std::lock_guard lock(mutex);
    check_usable();
    const std::size_t slot = schedule->release(layer);  // throws: no change
    if (slot == PagerSchedule::kNone) return;           // resident: never evicted
    try {
      device->record_release(slot, stream);
    } catch (const std::exception& error) {
      broken = error.what();
      throw;
    }
  }
};

}  // namespace detail

WeightPager::WeightPager(std::vector<WeightLayer> layers, WeightPagerOptions options)
    : WeightPager(std::move(layers), options, nullptr) {}

WeightPager::WeightPager(std::vector<WeightLayer> layers, WeightPagerOptions options,
                         std::unique_ptr<PagerDevice> device) {
  // Validate everything before any allocation or pin.
  std::map<std::string, std::size_t, std::less<>> names;
  std::vector<std::size_t> bytes;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].host == nullptr) {
      throw InvalidArgument("vram::WeightPager: layer " + std::to_string(i) + " ('" +
                            layers[i].name + "') has a null host pointer.");
    }
    if (!layers[i].name.empty() && !names.emplace(layers[i].name, i).second) {
      throw InvalidArgument("vram::WeightPager: two layers are named '" + layers[i].name +
                            "'. Fix: give each layer its own name (or none).");
    }
    bytes.push_back(layers[i].bytes);
  }
  PagerPlan plan =
      plan_residency(std::move(bytes), options.schedule,
                     PagerPlanOptions{.budget_bytes = options.budget_bytes,
                                      .prefetch_depth = options.prefetch_depth,
                                      .alignment = 256,
                                      .copy_to_compute_ratio = options.copy_to_compute_ratio});
  if (options.print_plan_warnings) {
    for (const auto& warning : plan.warnings) std::fprintf(stderr, "%s\n", warning.c_str());
  }

  auto state = std::make_shared<detail::PagerState>();
  state->layers = std::move(layers);
  state->names = std::move(names);
  state->options = options;
  state->device = device ? std::move(device) : make_cuda_pager_device(options.device);
  state->load.requested = options.host;

  {  // The host copies from the weights (uploads, staging fills): device memory crashes it.
    std::vector<PagerDevice::HostRange> all;
    all.reserve(state->layers.size());
    for (const auto& layer : state->layers) all.push_back({layer.host, layer.bytes});
    if (const std::size_t i = state->device->first_device_range(all); i < all.size()) {
      throw InvalidArgument("vram::WeightPager: layer " + std::to_string(i) + " ('" +
                            state->layers[i].name +
                            "') points at device memory, not host memory. Fix: pass the "
                            "weights' host copy (the pager copies them to the device itself).");
    }
  }

  // From here on a throw destroys `state`, whose destructor frees what was made so far.
  bool staged = options.host == HostWeights::pageable;
  if (!staged && plan.slot_count > 0) {
    std::vector<PagerDevice::HostRange> streamed;  // resident layers are copied once: no pin
    for (std::size_t i = 0; i < state->layers.size(); ++i) {
      if (!plan.resident[i]) streamed.push_back({state->layers[i].host, state->layers[i].bytes});
    }
    const std::string failure =
        state->device->pin_host(streamed, options.register_chunk_bytes, state->load);
    if (!failure.empty()) {
      if (options.host == HostWeights::pinned) {
        throw PinningError("vram::WeightPager: pinning the host weights failed: " + failure +
                           ". Fix: free host memory or raise the container's (cgroup) memory "
                           "limit, which page-locked memory counts against; or use "
                           "HostWeights::automatic / pageable to stage the weights instead.");
      }
      staged = true;
      state->load.fallback_reason = failure;
      std::fprintf(stderr,
                   "vram::WeightPager: WARNING: pinning the host weights failed (%s); paging them "
                   "through pinned staging buffers instead, which is slower. Fix: free host "
                   "memory or raise the container's memory limit; pass HostWeights::pageable "
                   "to stage without trying to pin.\n",
                   failure.c_str());
    }
  }
  state->load.pinned = !staged && plan.slot_count > 0;

  state->arena = static_cast<std::byte*>(state->device->allocate_arena(plan.arena_bytes));
  state->arena_bytes = plan.arena_bytes;
  const auto upload_start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < state->layers.size(); ++i) {
    if (plan.resident[i]) {
      state->device->upload(state->arena + plan.offset[i], state->layers[i].host,
                            state->layers[i].bytes);
    }
  }
  state->load.upload_seconds = seconds_since(upload_start);
  state->device->configure(plan.slot_count, staged, options);
  state->schedule.emplace(std::move(plan), options.eviction);
  state_ = std::move(state);
}

WeightPager& WeightPager::operator=(WeightPager&& other) noexcept {
  state_ = std::move(other.state_);
  return *this;
}

WeightPager::~WeightPager() = default;

namespace {
detail::PagerState& usable(const std::shared_ptr<detail::PagerState>& state) {
  if (!state) throw InvalidArgument("vram::WeightPager: use of a moved-from pager.");
  return *state;
}
}  // namespace

void* WeightPager::acquire(std::size_t layer, cudaStream_t stream) {
  return usable(state_).acquire(layer, stream);
}
void* WeightPager::acquire(std::string_view name, cudaStream_t stream) {
  auto& state = usable(state_);
  return state.acquire(state.index_of(name), stream);
}
void WeightPager::release(std::size_t layer, cudaStream_t stream) {
  usable(state_).release(layer, stream);
}
void WeightPager::release(std::string_view name, cudaStream_t stream) {
  auto& state = usable(state_);
  state.release(state.index_of(name), stream);
}
std::size_t WeightPager::index_of(std::string_view name) const {
  return usable(state_).index_of(name);
}
std::size_t WeightPager::layer_count() const { return usable(state_).layers.size(); }
const PagerPlan& WeightPager::plan() const { return usable(state_).schedule->plan(); }
const WeightPagerLoad& WeightPager::load() const { return usable(state_).load; }

WeightPagerStats WeightPager::stats() const {
  auto& state = usable(state_);
  std::lock_guard lock(state.mutex);
  state.device->collect(state.counters);
  WeightPagerStats stats = state.counters;
  stats.effective_gbps = stats.timed_copy_ms > 0
                             ? static_cast<double>(stats.timed_bytes) / stats.timed_copy_ms / 1e6
                             : 0;
  return stats;
}

void WeightPager::reset_counters() {
  auto& state = usable(state_);
  std::lock_guard lock(state.mutex);
  state.device->collect(state.counters);  // drops the samples read so far with the rest
  state.counters = WeightPagerStats{};
}

void WeightPager::synchronize() {
  auto& state = usable(state_);
  std::lock_guard lock(state.mutex);
  state.device->synchronize();
}

WeightPager::Handle WeightPager::handle() const { return Handle(state_); }

namespace {
std::shared_ptr<detail::PagerState> lock_alive(const std::weak_ptr<detail::PagerState>& state,
                                               const char* call) {
  auto alive = state.lock();
  if (!alive) {
    throw InvalidArgument(std::string("vram::WeightPager::Handle::") + call +
                          ": pager destroyed. Fix: keep the WeightPager alive while its "
                          "handles are used.");
  }
  return alive;
}
}  // namespace

void* WeightPager::Handle::acquire(std::size_t layer, cudaStream_t stream) const {
  return lock_alive(state_, "acquire")->acquire(layer, stream);
}
void WeightPager::Handle::release(std::size_t layer, cudaStream_t stream) const {
  lock_alive(state_, "release")->release(layer, stream);
}
bool WeightPager::Handle::alive() const noexcept { return !state_.expired(); }

}  // namespace vram
