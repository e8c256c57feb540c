#include "vram/weight_pager.hpp"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "vram/cuda/error.hpp"
#include "vram/upstream.hpp"

namespace vram {
namespace {

[[noreturn]] void throw_destroyed(const char* call) {
  throw InvalidArgument(std::string("vram::WeightPager::Handle::") + call +
                        ": pager destroyed. Fix: keep the WeightPager alive while its "
                        "handles are used.");
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

namespace detail {

// The pager's state, shared by the WeightPager (its owner) and its Handles (weak
// references). Every acquire and release runs under `mutex` for its whole duration, and a
// Handle's call holds a strong reference meanwhile, so the state outlives the calls in
// flight. The owner's other calls (stats, synchronize, plan, ...) are its own thread's.
// Invariants
//   - The owner closes the state (WeightPager's destructor or move-assignment; a failed
//     construction through the destructor): close() takes the mutex, so it waits for the
//     calls in flight, then shuts the device down and frees the arena. After it, every
//     call throws "pager destroyed" before touching the device, the arena or the weights.
//   - `broken` holds the first failure inside acquire/release; later calls throw it.
struct PagerState {
  std::mutex mutex;
  std::atomic<bool> closed{false};  // written under `mutex`; read without it by alive()
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

  ~PagerState() { close(); }

  void close() noexcept {
    std::lock_guard lock(mutex);
    if (closed.load(std::memory_order_relaxed)) return;
    closed.store(true, std::memory_order_release);
    if (schedule && schedule->layers_acquired() > 0) {
      std::fprintf(stderr,
                   "vram::WeightPager: destroyed with %zu layer(s) still acquired; their device "
                   "memory is freed now (after the release events recorded so far).\n",
                   schedule->layers_acquired());
    }
    if (device) {
      device->shutdown(arena, arena_bytes);
      device.reset();
    }
    arena = nullptr;
    arena_bytes = 0;
  }

  void check_usable(const char* call) const {
    if (closed.load(std::memory_order_relaxed)) throw_destroyed(call);
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
    check_usable("acquire");
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
    check_usable("release");
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
  PagerPlan plan = plan_residency(std::move(bytes), options.schedule, options.plan);
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
  if (this != &other) {
    if (state_) state_->close();
    state_ = std::move(other.state_);
  }
  return *this;
}

WeightPager::~WeightPager() {
  if (state_) state_->close();
}

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
// A strong reference for the duration of one call: the state cannot be freed under it,
// and a closed state throws inside the call (check_usable).
std::shared_ptr<detail::PagerState> lock_alive(const std::weak_ptr<detail::PagerState>& state,
                                               const char* call) {
  auto alive = state.lock();
  if (!alive) throw_destroyed(call);
  return alive;
}
}  // namespace

void* WeightPager::Handle::acquire(std::size_t layer, cudaStream_t stream) const {
  return lock_alive(state_, "acquire")->acquire(layer, stream);
}
void WeightPager::Handle::release(std::size_t layer, cudaStream_t stream) const {
  lock_alive(state_, "release")->release(layer, stream);
}
bool WeightPager::Handle::alive() const noexcept {
  const auto state = state_.lock();
  return state && !state->closed.load(std::memory_order_acquire);
}

}  // namespace vram
