// c_interface.cpp: the exported C functions of libvram_torch.so (vram_torch.h has the
// contract); every other symbol of the plug-in is hidden.
//
// Rules:
// - No exception leaves an entry point, except the out-of-memory error of the allocator
//   mode (errors.hpp).
// - The warm path (no record_stream in flight on the device) takes no lock: one load of
//   the device's state, one of its stream tracking, the pool's allocate or deallocate and
//   a few relaxed counter updates.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <type_traits>

#include "cuda/memory.hpp"
#include "device_registry.hpp"
#include "errors.hpp"
#include "graph_hooks.hpp"
#include "sleep_regions.hpp"
#ifdef VRAM_TORCH_WITH_C10
#include <torch/headeronly/version.h>

#include "native_allocator.hpp"
#endif
#include "stats.hpp"
#include "vram/cuda/error.hpp"
#include "vram/size_classes.hpp"
#include "vram_torch.h"

static_assert(std::is_same_v<vram_torch_stream_t, cudaStream_t>,
              "vram_torch_stream_t must be cudaStream_t");

#define VRAM_TORCH_API extern "C" __attribute__((visibility("default")))

using vram_torch::DeviceState;
using vram_torch::find_state;
using vram_torch::note_error;
using vram_torch::note_error_built;

VRAM_TORCH_API int vram_torch_set_oom_throws(int throws) {
  return vram_torch::set_oom_throws(throws);
}

namespace {
// Whether some block of the pool has `size` bytes: 1 .. the largest size class (1 TiB).
// Outside it the pool's rounding means nothing (it may wrap), so nothing is counted for it.
bool is_block_size(size_t size) noexcept {
  return size != 0 && size <= vram::SizeClasses::kMaxBytes;
}
}  // namespace

VRAM_TORCH_API size_t vram_torch_block_bytes(int device, size_t size) {
  if (!is_block_size(size)) return 0;
  DeviceState* state = find_state(device);
  return state == nullptr ? 0 : state->pool.block_bytes(size);
}

namespace {

// A freed block (`bytes`: its block_bytes) on its way: to a capture's route or held back
// for its recorded streams, else to the pool. vram_torch_free's end, and the way back of a
// block vram_torch_alloc could not file (no host memory for the entry).
void pass_on(DeviceState& state, void* ptr, size_t size, std::size_t bytes,
             vram_torch_stream_t stream) noexcept {
  if (vram_torch::graph_hooks_installed() && state.graphs.active()) {
    if (state.route_or_hold_back(ptr, size, bytes, stream)) return;
  } else if (state.streams.hold_back(ptr, size, bytes, stream)) {
    return;  // the pool gets it later
  }
  state.pool.deallocate_async(ptr, size, stream);
}

}  // namespace

VRAM_TORCH_API void* vram_torch_alloc(size_t size, int device, vram_torch_stream_t stream) {
  if (size == 0) return nullptr;  // PyTorch keeps a null data pointer for empty storage
  DeviceState* state = nullptr;
  try {
    state = &vram_torch::state_for(device);
  } catch (const std::exception& e) {
    note_error_built(
        [&] {
          return "cannot create the pool of device " + std::to_string(device) + ": " + e.what();
        },
        false);
    return nullptr;
  }
  if (state->streams.held_blocks() != 0) state->streams.release(false);
  // While PyTorch captures a graph through the pluggable route's hooks (graph_routes.hpp):
  // two relaxed loads otherwise. Under the native allocator, PyTorch routes its own
  // requests; a call here is a foreign user's (CuPy, a MemPool whose allocator is this
  // interface) and takes no route, which could lead back here.
  const bool capturing = vram_torch::graph_hooks_installed() && state->graphs.active();
  for (int attempt = 0;; ++attempt) {
    void* ptr = nullptr;
    try {
      ptr = capturing ? state->graphs.allocate(size, stream).ptr : nullptr;
      if (ptr == nullptr) ptr = state->pool.allocate_async(size, stream);
      state->handed_out.insert(ptr, {size});
      state->counters.count_allocation(state->pool.block_bytes(size), size);
      return ptr;
    } catch (const vram::OutOfMemory& e) {
      if (attempt == 0 && state->reclaim_held_back(capturing)) continue;
      state->counters.ooms.fetch_add(1, std::memory_order_relaxed);
      note_error(e.what(), true);
      return vram_torch::out_of_memory(e.what());
    } catch (const std::bad_alloc& e) {
      // The host ran out: for the pool's bookkeeping (nothing handed out), or for the
      // block's entry (the block goes back).
      if (ptr != nullptr) pass_on(*state, ptr, size, state->pool.block_bytes(size), stream);
      state->counters.ooms.fetch_add(1, std::memory_order_relaxed);
      note_error(e.what(), true);
      return vram_torch::out_of_memory(e.what());
    } catch (const std::exception& e) {
      state->counters.ooms.fetch_add(1, std::memory_order_relaxed);
      note_error_built(
          [&] {
            return "allocation of " + std::to_string(size) + " bytes on device " +
                   std::to_string(device) + " failed: " + e.what();
          },
          false);
      return nullptr;
    }
  }
}

VRAM_TORCH_API void vram_torch_free(void* ptr, size_t size, int device,
                                    vram_torch_stream_t stream) {
  if (ptr == nullptr) return;
  DeviceState* state = find_state(device);
  // Only a block this route handed out on `device` and not freed since goes on: a second
  // free, another allocator's pointer or another device's block changes nothing.
  const std::optional<vram_torch::HandedOut> held =
      state != nullptr ? state->handed_out.take(ptr) : std::nullopt;
  if (!held) {
    note_error_built(
        [&] {
          return "free of " + vram_torch::pointer_text(ptr) + " on device " +
                 std::to_string(device) +
                 ": not a block vram_torch handed out there and has not freed since (freed "
                 "twice, another allocator's, or another device's); ignored. Fix: free each block "
                 "once, on the device and with the size it was allocated with";
        },
        false);
    return;
  }
  if (held->size != size) {
    note_error_built(
        [&] {
          return "free of " + vram_torch::pointer_text(ptr) + " with " + std::to_string(size) +
                 " bytes: it was allocated with " + std::to_string(held->size) +
                 "; freed as allocated. Fix: pass the size given to vram_torch_alloc";
        },
        false);
    size = held->size;
  }
  const std::size_t bytes = state->pool.block_bytes(size);
  state->counters.count_free(bytes, size);
  pass_on(*state, ptr, size, bytes, stream);
}

VRAM_TORCH_API void vram_torch_record_stream(void* ptr, vram_torch_stream_t stream) {
  if (ptr == nullptr) return;
  // PyTorch passes no device: ask the runtime which device owns ptr (record_stream is rare;
  // the warm allocation path never gets here).
  DeviceState* state = find_state(vram::cuda::pointer_info(ptr).device);
  // Not the base of a live block of this route (an offset into one, a freed one, another
  // allocator's): nothing to hold back at its free.
  if (state == nullptr || state->handed_out.size_of(ptr) == 0) return;
  state->counters.record_calls.fetch_add(1, std::memory_order_relaxed);
  try {
    state->streams.record(ptr, stream);
  } catch (...) {
    note_error("record_stream: out of host memory; synchronizing the stream instead", false);
    (void)vram::cuda::try_synchronize_stream(stream);
  }
}

VRAM_TORCH_API int vram_torch_install_graph_hooks(void) {
  return vram_torch::install_graph_hooks();
}

VRAM_TORCH_API const char* vram_torch_torch_version(void) {
#ifdef VRAM_TORCH_WITH_C10
  return TORCH_VERSION;
#else
  return "";
#endif
}

VRAM_TORCH_API int vram_torch_install_native(void) {
#ifdef VRAM_TORCH_WITH_C10
  return vram_torch::install_native_allocator();
#else
  note_error(
      "this libvram_torch.so was built without Torch: vram can only be PyTorch's pluggable "
      "allocator, without torch.cuda's memory statistics, snapshots, MemPool and CUDA graph "
      "trees. Fix: build it with CMAKE_PREFIX_PATH set to torch.utils.cmake_prefix_path "
      "(README, PyTorch)",
      false);
  return 0;
#endif
}

VRAM_TORCH_API size_t vram_torch_stats_size(void) { return sizeof(vram_torch_stats_t); }

VRAM_TORCH_API int vram_torch_stats(int device, vram_torch_stats_t* out, size_t out_size) {
  if (out == nullptr || device < 0 || device >= vram_torch::kMaxDevices) return -1;
  vram_torch_stats_t s{};
  DeviceState* state = find_state(device);
  if (state != nullptr) s = vram_torch::stats_of(*state);
  std::memcpy(out, &s, std::min(out_size, sizeof s));
  return state != nullptr ? 0 : 1;
}

VRAM_TORCH_API int vram_torch_empty_cache(int device) {
  return vram_torch::for_each_state(device, [](DeviceState& state) { state.empty_cache(); });
}

VRAM_TORCH_API void vram_torch_empty_cache_all(void) { (void)vram_torch_empty_cache(-1); }

VRAM_TORCH_API int vram_torch_reset_peak(int device) {
  return vram_torch::for_each_state(device, [](DeviceState& state) {
    state.counters.restart_peaks();
    state.pool.reset_peak();
  });
}

VRAM_TORCH_API int vram_torch_configure(size_t max_cached_bytes) {
  return vram_torch::configure_pools(max_cached_bytes) ? 0 : 1;
}

VRAM_TORCH_API size_t vram_torch_last_error(char* buffer, size_t size) {
  return vram_torch::copy_last_error(buffer, size);
}

VRAM_TORCH_API int vram_torch_region_enter(const char* tag, int discardable, int device) {
  return vram_torch::region_enter(tag, discardable, device);
}

VRAM_TORCH_API int vram_torch_region_exit(void) { return vram_torch::region_exit(); }

VRAM_TORCH_API int vram_torch_sleep(const char* tag, int device, vram_torch_stream_t stream) {
  return vram_torch::sleep_tag(tag, device, stream, false);
}

VRAM_TORCH_API int vram_torch_sleep_discard(const char* tag, int device,
                                            vram_torch_stream_t stream) {
  return vram_torch::sleep_tag(tag, device, stream, true);
}

VRAM_TORCH_API int vram_torch_wake(const char* tag, int device, vram_torch_stream_t stream) {
  return vram_torch::wake_tag(tag, device, stream);
}

VRAM_TORCH_API int vram_torch_tag_stats(const char* tag, int device, vram_torch_tag_stats_t* out,
                                        size_t out_size) {
  if (out == nullptr || tag == nullptr || strnlen(tag, 257) > 256) return -1;
  DeviceState* state = find_state(device);
  if (state == nullptr) return 1;
  try {
    const auto handle = state->pool.find_tag(tag);
    if (!handle) return 1;
    const vram::SleepTagStats t = state->pool.tag_stats(*handle);
    vram_torch_tag_stats_t s{};
    s.asleep = t.state == vram::SleepState::asleep ? 1 : 0;
    s.discardable = t.discardable ? 1 : 0;
    s.live_blocks = t.live_blocks;
    s.live_bytes = t.live_bytes;
    s.mapped_bytes = t.mapped_bytes;
    s.backup_bytes = t.backup_bytes;
    s.backed_up_bytes = t.backed_up_bytes;
    s.copies = t.copies;
    s.sleeps = t.sleeps;
    s.wakes = t.wakes;
    std::memcpy(out, &s, std::min(out_size, sizeof s));
    return 0;
  } catch (const std::exception& e) {
    note_error_built([&] { return std::string("tag_stats: ") + e.what(); }, false);
    return -1;
  }
}
