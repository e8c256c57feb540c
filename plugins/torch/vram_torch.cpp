// vram_torch.cpp: libvram_torch.so, one vram::DevicePool per device behind PyTorch's
// pluggable-allocator ABI (see vram_torch.h for the contract).
//
// Invariants
//   - A pool, once published in g_devices[d], is never destroyed or replaced (leaked at
//     exit on purpose: PyTorch frees tensors during interpreter shutdown, after static
//     destructors may have run).
//   - Every block handed out is either live (owned by PyTorch), held back (freed, waiting
//     for events on recorded streams; in DeviceState::held_back), or back in the pool.
//   - A block with recorded streams reaches the pool only after an event recorded at its
//     free on each of those streams has completed; then it is released with its
//     allocation stream, so the pool's own stream-ordered rule covers that stream.
//   - The warm path (no record_stream in flight on the device) takes no lock: one relaxed
//     load of `recorded`/`held_count`, the pool call and a few relaxed counter updates.
#include "vram_torch.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "cuda/event_pool.hpp"
#include "cuda/memory.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/error.hpp"
#include "vram/device_pool.hpp"
#ifdef VRAM_TORCH_WITH_C10
// Built where Torch is found: an out-of-memory in the allocator mode (vram_torch.enable())
// throws c10::OutOfMemoryError, which PyTorch turns into torch.OutOfMemoryError. PyTorch's
// CUDAPluggableAllocator wraps a null pointer into a tensor instead of raising, so
// returning nullptr is not enough there.
#include <c10/util/Exception.h>
#endif

static_assert(std::is_same_v<vram_torch_stream_t, cudaStream_t>,
              "vram_torch_stream_t must be cudaStream_t");

#define VRAM_TORCH_API extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kMaxDevices = 64;

void raise_to(std::atomic<std::uint64_t>& peak, std::uint64_t value) noexcept {
  std::uint64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// A freed block still used by other streams: reusable once every event has completed.
struct HeldBack {
  void* ptr;
  std::size_t size;
  cudaStream_t alloc_stream;
  std::vector<cudaEvent_t> events;
};

struct DeviceState {
  DeviceState(int device, vram::DevicePool::Options options)
      : ordinal(device), pool(device, options), events(device) {}

  const int ordinal;
  vram::DevicePool pool;

  // Counters (relaxed; summed views are exact when no allocation or free runs at the same
  // moment).
  std::atomic<std::uint64_t> class_allocated{0}, class_freed{0}, class_peak{0};
  std::atomic<std::uint64_t> requested_allocated{0}, requested_freed{0}, requested_peak{0};
  std::atomic<std::uint64_t> count_allocated{0}, count_freed{0}, count_peak{0};
  std::atomic<std::uint64_t> ooms{0}, retries{0}, record_calls{0};

  // record_stream bookkeeping, under `mutex`. `recorded` and `held_count` mirror the sizes
  // of the containers so the warm path can skip the lock.
  std::mutex mutex;
  std::unordered_map<void*, std::vector<cudaStream_t>> streams_of;  // live blocks only
  std::vector<HeldBack> held_back;
  vram::cuda::EventPool events;  // recycled; observed in relaxed capture mode
  std::atomic<std::size_t> recorded{0};
  std::atomic<std::size_t> held_count{0};
  std::atomic<std::uint64_t> held_bytes{0};
};

std::array<std::atomic<DeviceState*>, kMaxDevices> g_devices{};
std::mutex g_create_mutex;
std::size_t g_max_cached_bytes = 0;  // 0: default / environment; under g_create_mutex

std::mutex g_error_mutex;
std::string g_last_error;
std::atomic<bool> g_oom_printed{false};

void note_error(const std::string& message, bool is_oom) noexcept {
  try {
    {
      std::lock_guard<std::mutex> lock(g_error_mutex);
      g_last_error = message;
    }
    if (!is_oom) {
      std::fprintf(stderr, "vram_torch: %s\n", message.c_str());
      return;
    }
    if (!g_oom_printed.exchange(true)) {
      std::fprintf(stderr,
                   "vram_torch: out of device memory; PyTorch will raise its error.\n"
                   "  vram: %s\n"
                   "  (printed once per process; vram_torch.last_error() has the latest)\n",
                   message.c_str());
    }
  } catch (...) {
  }
}

std::size_t parse_bytes(const char* text) noexcept {
  if (text == nullptr || *text == '\0') return 0;
  errno = 0;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (errno != 0 || end == text) return 0;
  std::size_t scale = 1;
  switch (*end) {
    case 'k':
    case 'K':
      scale = std::size_t{1} << 10;
      break;
    case 'm':
    case 'M':
      scale = std::size_t{1} << 20;
      break;
    case 'g':
    case 'G':
      scale = std::size_t{1} << 30;
      break;
    default:
      break;
  }
  return static_cast<std::size_t>(value) * scale;
}

DeviceState* find_state(int device) noexcept {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return g_devices[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
}

// Throws (vram::CudaError for a bad device, std::bad_alloc) when the pool cannot be made.
DeviceState& state_for(int device) {
  if (DeviceState* state = find_state(device)) return *state;
  if (device < 0 || device >= kMaxDevices) {
    throw std::invalid_argument("device " + std::to_string(device) + " is out of range");
  }
  std::lock_guard<std::mutex> lock(g_create_mutex);
  auto& slot = g_devices[static_cast<std::size_t>(device)];
  if (DeviceState* state = slot.load(std::memory_order_acquire)) return *state;
  vram::DevicePool::Options options;
  // As PyTorch's caching allocator: keep freed memory until empty_cache() or an
  // out-of-memory retry. A bound makes the pool give memory back during the run, and each
  // cudaFree synchronizes the device.
  options.max_cached_bytes = SIZE_MAX;
  std::size_t max_cached = g_max_cached_bytes;
  if (max_cached == 0) max_cached = parse_bytes(std::getenv("VRAM_TORCH_MAX_CACHED_BYTES"));
  if (max_cached != 0) options.max_cached_bytes = max_cached;
  // The pool's default: large blocks over one virtual address range mapped in runs of 2 MiB
  // granules where the device supports it (else cudaMalloc segments): free ranges merge
  // across what would be segment boundaries, so a new shape fits in memory already mapped
  // instead of a new segment, and nothing is given back during the run (no cudaFree, no
  // device synchronize). PyTorch cannot share this memory through CUDA IPC, as with its
  // own expandable segments. VRAM_TORCH_VIRTUAL_MEMORY=0 selects cudaMalloc segments.
  if (const char* text = std::getenv("VRAM_TORCH_VIRTUAL_MEMORY")) {
    const std::string value(text);
    if (value == "0" || value == "false" || value == "off" || value == "no") {
      options.large_tier_memory = vram::LargeTierMemory::segments;
    } else if (!(value == "1" || value == "true" || value == "on" || value == "yes")) {
      std::fprintf(stderr,
                   "vram_torch: VRAM_TORCH_VIRTUAL_MEMORY=%s is not 0/1 (false/true, off/on, "
                   "no/yes): the default (virtual memory where supported) is used\n",
                   text);
    }
  }
  // Segments: reserved may pass each tier's peak in use by this fraction before growing
  // gives wholly free segments back (vram::DevicePool::Options::growth_headroom).
  if (const char* text = std::getenv("VRAM_TORCH_GROWTH_HEADROOM")) {
    char* end = nullptr;
    const double value = std::strtod(text, &end);
    if (end != text && *end == '\0' && value >= 0) {  // NaN fails value >= 0
      options.growth_headroom = value;
    } else {
      std::fprintf(stderr,
                   "vram_torch: VRAM_TORCH_GROWTH_HEADROOM=%s is not a number >= 0 (e.g. "
                   "0.0625 or 0.5): the default 1/16 is used\n",
                   text);
    }
  }
  auto* state = new DeviceState(device, options);  // never deleted (see invariants)
  slot.store(state, std::memory_order_release);
  return *state;
}

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

// Hands every held-back block whose events have all completed to the pool. `wait`: waits
// for the events instead (memory is short, or empty_cache). Returns blocks released.
std::size_t release_held_back(DeviceState& state, bool wait) noexcept {
  std::vector<HeldBack> ready;
  {
    std::unique_lock<std::mutex> lock(state.mutex, std::defer_lock);
    if (wait) {
      lock.lock();
    } else if (!lock.try_lock()) {
      return 0;  // another thread is at it; the next allocation looks again
    }
    auto& held = state.held_back;
    for (std::size_t i = 0; i < held.size();) {
      if (!completed(held[i].events, wait)) {
        ++i;
        continue;
      }
      for (cudaEvent_t event : held[i].events) state.events.give_back(event);
      ready.push_back(std::move(held[i]));
      held[i] = std::move(held.back());
      held.pop_back();
    }
    state.held_count.store(held.size(), std::memory_order_relaxed);
  }
  for (const HeldBack& block : ready) {
    state.held_bytes.fetch_sub(state.pool.block_bytes(block.size), std::memory_order_relaxed);
    state.pool.deallocate_async(block.ptr, block.size, block.alloc_stream);
  }
  return ready.size();
}

void count_allocation(DeviceState& state, std::size_t size) noexcept {
  const std::uint64_t cls = state.pool.block_bytes(size);
  const std::uint64_t cls_now = state.class_allocated.fetch_add(cls, std::memory_order_relaxed) +
                                cls - state.class_freed.load(std::memory_order_relaxed);
  raise_to(state.class_peak, cls_now);
  const std::uint64_t req_now =
      state.requested_allocated.fetch_add(size, std::memory_order_relaxed) + size -
      state.requested_freed.load(std::memory_order_relaxed);
  raise_to(state.requested_peak, req_now);
  const std::uint64_t count_now = state.count_allocated.fetch_add(1, std::memory_order_relaxed) +
                                  1 - state.count_freed.load(std::memory_order_relaxed);
  raise_to(state.count_peak, count_now);
}

void count_free(DeviceState& state, std::size_t size) noexcept {
  state.class_freed.fetch_add(state.pool.block_bytes(size), std::memory_order_relaxed);
  state.requested_freed.fetch_add(size, std::memory_order_relaxed);
  state.count_freed.fetch_add(1, std::memory_order_relaxed);
}

std::uint64_t difference(const std::atomic<std::uint64_t>& added,
                         const std::atomic<std::uint64_t>& removed) noexcept {
  const std::uint64_t a = added.load(std::memory_order_relaxed);
  const std::uint64_t r = removed.load(std::memory_order_relaxed);
  return a > r ? a - r : 0;
}

// The device argument of the "one device or all" entry points: `device` >= 0 runs `fn` on
// that device's state, -1 on every device that has one; a device without a pool is skipped.
// Returns -1 (and runs nothing) for a device out of range, else 0.
template <typename Fn>
int for_each_state(int device, Fn&& fn) {
  if (device >= kMaxDevices || device < -1) return -1;
  const int first = device < 0 ? 0 : device;
  const int last = device < 0 ? kMaxDevices - 1 : device;
  for (int d = first; d <= last; ++d) {
    if (DeviceState* state = find_state(d)) fn(*state);
  }
  return 0;
}

}  // namespace

namespace {
// 1 after vram_torch_set_oom_throws(1) (vram_torch.enable()): PyTorch calls the allocator
// directly and needs an exception; 0 (MemPool form, CuPy): nullptr, which PyTorch's caching
// allocator and CuPy's wrapper turn into their own out-of-memory errors.
std::atomic<int> g_oom_throws{0};

void* out_of_memory(const std::string& message) {
#ifdef VRAM_TORCH_WITH_C10
  if (g_oom_throws.load(std::memory_order_relaxed) != 0) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory (vram): ", message);
  }
#endif
  (void)message;
  return nullptr;
}
}  // namespace

VRAM_TORCH_API int vram_torch_set_oom_throws(int throws) {
#ifdef VRAM_TORCH_WITH_C10
  g_oom_throws.store(throws != 0 ? 1 : 0, std::memory_order_relaxed);
  return 1;
#else
  (void)throws;
  return 0;  // built without Torch: out of memory is always a null pointer
#endif
}

VRAM_TORCH_API size_t vram_torch_block_bytes(int device, size_t size) {
  DeviceState* state = find_state(device);
  return state == nullptr ? 0 : state->pool.block_bytes(size);
}

VRAM_TORCH_API void* vram_torch_alloc(size_t size, int device, vram_torch_stream_t stream) {
  if (size == 0) return nullptr;  // PyTorch keeps a null data pointer for empty storage
  DeviceState* state = nullptr;
  try {
    state = &state_for(device);
  } catch (const std::exception& e) {
    note_error(
        std::string("cannot create the pool of device ") + std::to_string(device) + ": " + e.what(),
        false);
    return nullptr;
  }
  if (state->held_count.load(std::memory_order_relaxed) != 0) release_held_back(*state, false);
  for (int attempt = 0;; ++attempt) {
    try {
      void* ptr = state->pool.allocate_async(size, stream);
      count_allocation(*state, size);
      return ptr;
    } catch (const vram::OutOfMemory& e) {
      // Blocks held back for recorded streams may be the memory that is missing: wait for
      // them once and retry (the pool already trimmed its own cache and retried).
      if (attempt == 0 && state->held_count.load(std::memory_order_relaxed) != 0 &&
          release_held_back(*state, true) != 0) {
        state->retries.fetch_add(1, std::memory_order_relaxed);
        state->pool.trim(0);
        continue;
      }
      state->ooms.fetch_add(1, std::memory_order_relaxed);
      note_error(e.what(), true);
      return out_of_memory(e.what());
    } catch (const std::bad_alloc& e) {
      state->ooms.fetch_add(1, std::memory_order_relaxed);
      note_error(e.what(), true);
      return out_of_memory(e.what());
    } catch (const std::exception& e) {
      state->ooms.fetch_add(1, std::memory_order_relaxed);
      note_error(std::string("allocation of ") + std::to_string(size) + " bytes on device " +
                     std::to_string(device) + " failed: " + e.what(),
                 false);
      return nullptr;
    }
  }
}

VRAM_TORCH_API void vram_torch_free(void* ptr, size_t size, int device,
                                    vram_torch_stream_t stream) {
  if (ptr == nullptr || size == 0) return;
  DeviceState* state = find_state(device);
  if (state == nullptr) {  // not ours: nothing was ever allocated on this device
    note_error("free of a pointer on device " + std::to_string(device) +
                   ", where vram_torch never allocated; ignored",
               false);
    return;
  }
  count_free(*state, size);
  if (state->recorded.load(std::memory_order_acquire) != 0) {
    std::vector<cudaStream_t> streams;
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      auto it = state->streams_of.find(ptr);
      if (it != state->streams_of.end()) {
        streams = std::move(it->second);
        state->streams_of.erase(it);
        state->recorded.store(state->streams_of.size(), std::memory_order_release);
      }
    }
    streams.erase(std::remove(streams.begin(), streams.end(), stream), streams.end());
    if (!streams.empty()) {
      HeldBack held{ptr, size, stream, {}};
      try {
        held.events.reserve(streams.size());
        // A null stream names the current device's legacy stream: the block's device here.
        vram::cuda::DeviceGuard guard(device);
        for (cudaStream_t other : streams) {
          cudaEvent_t event = state->events.try_take();
          if (event == nullptr || !vram::cuda::try_record(event, other)) {
            // Cannot order the reuse after that stream: wait for it here instead.
            state->events.give_back(event);
            (void)vram::cuda::try_synchronize_stream(other);
            continue;
          }
          held.events.push_back(event);
        }
        if (!held.events.empty()) {
          std::lock_guard<std::mutex> lock(state->mutex);
          state->held_back.push_back(std::move(held));
          state->held_count.store(state->held_back.size(), std::memory_order_relaxed);
          state->held_bytes.fetch_add(state->pool.block_bytes(size), std::memory_order_relaxed);
          return;  // the pool gets it from release_held_back
        }
        // Every recorded stream was waited for: fall through to the ordinary release.
      } catch (...) {
        // No memory for the bookkeeping: order the reuse by waiting for those streams.
        for (cudaStream_t other : streams) (void)vram::cuda::try_synchronize_stream(other);
        for (cudaEvent_t event : held.events) state->events.give_back(event);
      }
    }
  }
  state->pool.deallocate_async(ptr, size, stream);
}

VRAM_TORCH_API void vram_torch_record_stream(void* ptr, vram_torch_stream_t stream) {
  if (ptr == nullptr) return;
  // PyTorch passes no device: ask the runtime which device owns ptr (record_stream is rare;
  // the warm allocation path never gets here).
  DeviceState* state = find_state(vram::cuda::pointer_info(ptr).device);
  if (state == nullptr) return;  // not a block of this library
  state->record_calls.fetch_add(1, std::memory_order_relaxed);
  try {
    std::lock_guard<std::mutex> lock(state->mutex);
    auto& streams = state->streams_of[ptr];
    if (std::find(streams.begin(), streams.end(), stream) == streams.end()) {
      streams.push_back(stream);
    }
    state->recorded.store(state->streams_of.size(), std::memory_order_release);
  } catch (...) {
    note_error("record_stream: out of host memory; synchronizing the stream instead", false);
    (void)vram::cuda::try_synchronize_stream(stream);
  }
}

VRAM_TORCH_API size_t vram_torch_stats_size(void) { return sizeof(vram_torch_stats_t); }

VRAM_TORCH_API int vram_torch_stats(int device, vram_torch_stats_t* out, size_t out_size) {
  if (out == nullptr) return -1;
  vram_torch_stats_t s{};
  DeviceState* state = find_state(device);
  if (state != nullptr) {
    s.allocated_bytes_current = difference(state->class_allocated, state->class_freed);
    s.allocated_bytes_peak = state->class_peak.load(std::memory_order_relaxed);
    s.allocated_bytes_allocated = state->class_allocated.load(std::memory_order_relaxed);
    s.allocated_bytes_freed = state->class_freed.load(std::memory_order_relaxed);
    s.requested_bytes_current = difference(state->requested_allocated, state->requested_freed);
    s.requested_bytes_peak = state->requested_peak.load(std::memory_order_relaxed);
    s.allocation_current = difference(state->count_allocated, state->count_freed);
    s.allocation_peak = state->count_peak.load(std::memory_order_relaxed);
    s.allocation_allocated = state->count_allocated.load(std::memory_order_relaxed);
    s.allocation_freed = state->count_freed.load(std::memory_order_relaxed);
    const vram::DevicePoolStats pool = state->pool.stats();
    s.reserved_bytes_current = pool.bytes_reserved;
    s.reserved_bytes_peak = pool.peak_bytes_reserved;
    s.cached_bytes = pool.bytes_cached;
    s.num_device_alloc = pool.upstream_allocations;
    s.num_device_free = pool.upstream_frees;
    s.num_alloc_retries = pool.oom_retries + state->retries.load(std::memory_order_relaxed);
    s.num_ooms = state->ooms.load(std::memory_order_relaxed);
    s.record_stream_calls = state->record_calls.load(std::memory_order_relaxed);
    s.held_back_blocks = state->held_count.load(std::memory_order_relaxed);
    s.held_back_bytes = state->held_bytes.load(std::memory_order_relaxed);
  }
  std::memcpy(out, &s, std::min(out_size, sizeof s));
  return state != nullptr ? 0 : 1;
}

VRAM_TORCH_API int vram_torch_empty_cache(int device) {
  return for_each_state(device, [](DeviceState& state) {
    release_held_back(state, true);
    try {
      state.pool.trim(0);
    } catch (const std::exception& e) {
      note_error(std::string("empty_cache: ") + e.what(), false);
    }
  });
}

VRAM_TORCH_API void vram_torch_empty_cache_all(void) { (void)vram_torch_empty_cache(-1); }

VRAM_TORCH_API int vram_torch_reset_peak(int device) {
  return for_each_state(device, [](DeviceState& state) {
    state.class_peak.store(difference(state.class_allocated, state.class_freed),
                           std::memory_order_relaxed);
    state.requested_peak.store(difference(state.requested_allocated, state.requested_freed),
                               std::memory_order_relaxed);
    state.count_peak.store(difference(state.count_allocated, state.count_freed),
                           std::memory_order_relaxed);
    state.pool.reset_peak();
  });
}

VRAM_TORCH_API int vram_torch_configure(size_t max_cached_bytes) {
  std::lock_guard<std::mutex> lock(g_create_mutex);
  g_max_cached_bytes = max_cached_bytes;
  for (const auto& slot : g_devices) {
    if (slot.load(std::memory_order_acquire) != nullptr) return 1;
  }
  return 0;
}

VRAM_TORCH_API size_t vram_torch_last_error(char* buffer, size_t size) {
  std::lock_guard<std::mutex> lock(g_error_mutex);
  if (buffer != nullptr && size > 0) {
    const std::size_t n = std::min(size - 1, g_last_error.size());
    std::memcpy(buffer, g_last_error.data(), n);
    buffer[n] = '\0';
  }
  return g_last_error.size();
}
