// device_registry.hpp: the plug-in's state of each device, made on its first allocation.
//
// Invariants:
// - A state, once published, is never destroyed or replaced: it is leaked at exit on
//   purpose, since PyTorch frees tensors during interpreter shutdown, after static
//   destructors may have run.
// - Every block handed out is either live (owned by PyTorch, and filed in handed_out when
//   the C route handed it out), held back (freed, waiting for events on recorded streams:
//   StreamTracking), or back in the pool.
// - find_state() is lock-free (one acquire load); only the creation of a state takes a lock.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "blocks_by_address.hpp"
#include "graph_routes.hpp"
#include "stats.hpp"
#include "stream_tracking.hpp"
#include "vram/device_pool.hpp"
#include "vram/reserve_observer.hpp"

namespace vram_torch {

inline constexpr int kMaxDevices = 64;

// Told of a unit of a device's pool: `reserved` after it joined the pool, else before it
// goes back (vram/reserve_observer.hpp). The native allocator's SEGMENT_ALLOC and
// SEGMENT_FREE trace events (native_allocator.hpp). Runs under the pool's locks: must not
// call the pool.
using SegmentListener = void (*)(int device, const vram::ReservedSpan& span,
                                 bool reserved) noexcept;
void set_segment_listener(SegmentListener listener) noexcept;

// The units of memory a device's pool holds (the pool's observer): what PyTorch is told of
// as segments, one segment per unit, so that a segment PyTorch saw (an event or a
// snapshot) is always one that a SEGMENT_FREE later names whole.
class SegmentUnits final : public vram::ReserveObserver {
 public:
  struct Unit {
    std::uintptr_t address = 0;
    std::size_t bytes = 0;
    bool virtual_memory = false;
    std::int32_t order = 0;  // counts the units of the device in the order they came
  };
  explicit SegmentUnits(int device) noexcept : device_(device) {}
  // Recorded first, then told: a snapshot taken meanwhile already lists the unit.
  void reserved(const vram::ReservedSpan& span) noexcept override;
  // Forgotten first, then told (the memory still valid): a snapshot taken meanwhile no
  // longer lists it, so nothing registers it after its SEGMENT_FREE.
  void giving_back(const vram::ReservedSpan& span) noexcept override;
  // The units held now, in address order. Throws std::bad_alloc.
  std::vector<Unit> units() const;

 private:
  const int device_;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, Unit> units_;  // by address
  std::int32_t next_order_ = 0;
};

// A block vram_torch_alloc handed out and vram_torch_free has not taken yet.
struct HandedOut {
  std::size_t size = 0;  // the bytes asked for
};

struct DeviceState {
  DeviceState(int device_index, vram::DevicePool::Options options)
      : device(device_index),
        units(std::make_shared<SegmentUnits>(device_index)),
        pool(device, observed(std::move(options), units)),
        streams(device, pool),
        graphs(pool) {}

  const int device;
  std::shared_ptr<SegmentUnits> units;  // the pool's observer, declared before the pool
  vram::DevicePool pool;
  Counters counters;
  StreamTracking streams;  // refers to `pool`, so declared after it
  GraphRoutes graphs;      // likewise
  // The C route's live blocks (c_interface.cpp): filed before vram_torch_alloc returns one,
  // taken before vram_torch_free passes one on; a free or record_stream of an address not
  // filed here reaches neither the pool nor the stream tracking.
  BlocksByAddress<HandedOut> handed_out;

  // empty_cache(): the blocks held back for recorded streams, once their streams' work is
  // done, then every cache of the pool; an error is noted (vram_torch_last_error), not thrown.
  void empty_cache() noexcept;

  // At the free of a block of the shared tiers while routes are open: a capture's route on
  // `stream` takes it at once (graph_routes.hpp; captured work may use it at every launch),
  // its recorded streams forgotten (stream_tracking.hpp says what that leaves open); else it
  // is held back for them, `shown` kept for snapshots. True when either took it.
  bool route_or_hold_back(void* ptr, std::size_t size, std::size_t bytes, cudaStream_t stream,
                          const StreamTracking::Shown& shown = {}) noexcept {
    std::vector<cudaStream_t> recorded = streams.take(ptr);
    if (graphs.deallocate(ptr, size, stream)) return true;
    return streams.hold_back_taken(ptr, size, bytes, stream, std::move(recorded), shown);
  }

  // After an allocation ran out of memory: blocks held back for recorded streams may be the
  // memory that is missing. Waits for them and trims the pool (which already trimmed its own
  // cache and retried); true when some came back and the allocation may be retried once.
  // Never while requests are routed to a private pool: waiting would synchronize the device
  // and end a capture.
  bool reclaim_held_back(bool routing) noexcept {
    if (routing || streams.held_blocks() == 0 || streams.release(true) == 0) return false;
    counters.retries.fetch_add(1, std::memory_order_relaxed);
    try {
      pool.trim(0);
    } catch (...) {  // the retry tells
    }
    return true;
  }

 private:
  static vram::DevicePool::Options observed(vram::DevicePool::Options options,
                                            std::shared_ptr<SegmentUnits> observer) {
    options.observer = std::move(observer);
    return options;
  }
};

// The published states, indexed by device ordinal; null where none was made yet.
extern std::array<std::atomic<DeviceState*>, kMaxDevices> g_devices;

// The state of `device`, null when it has none yet or `device` is out of range.
inline DeviceState* find_state(int device) noexcept {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return g_devices[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
}

// The state of `device`, made on first use with the options of configure_pools() and the
// environment (configuration.hpp). Throws std::invalid_argument for a device out of range,
// vram::CudaError when the pool cannot be made, std::bad_alloc.
DeviceState& state_for(int device);

// The max cached bytes of the pools made from now on (0: the default or the environment).
// Returns false when a pool already exists (it keeps its options).
bool configure_pools(std::size_t max_cached_bytes);

// The device argument of the "one device or all" entry points: `device` >= 0 runs `fn` on
// that device's state, -1 on every device that has one; a device without a state is
// skipped. Returns -1 (and runs nothing) for a device out of range, else 0.
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

}  // namespace vram_torch
