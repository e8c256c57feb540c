// vram/weight_pager.hpp: run a layer stack larger than the VRAM budget at the speed of the link.
//
// The weights live in host memory; one device allocation of at most `plan.budget_bytes` holds
// the layers that fit for good (resident) and a ring of slots the others stream through.
// The schedule (the layer order of one step, repeated every step) drives everything:
// which layers stay resident, which to prefetch, which slot to reuse (Belady: the layer
// needed furthest in the future). See pager_plan.hpp for the decisions themselves.
//
//   std::vector<vram::WeightLayer> layers;            // name, host pointer, bytes
//   for (...) layers.push_back({"block." + std::to_string(i), weights[i], bytes});
//   vram::WeightPager pager(layers, {.plan = {.budget_bytes = 4_GiB, .prefetch_depth = 2}});
//   for (int step = 0; step < steps; ++step) {
//     for (std::size_t i = 0; i < layers.size(); ++i) {
//       const void* w = pager.acquire(i, stream);      // ordered before what follows on stream
//       launch_layer(w, activations, stream);
//       pager.release(i, stream);                      // evictable once that compute ran
//     }
//   }
//
// Ordering (never a host synchronisation on the warm path)
//   A page-in runs on the pager's own copy stream, after every release event recorded for
//   its slot since the slot's previous page-in (cudaStreamWaitEvent), and records the
//   slot's ready event. acquire() makes `stream` wait for that event; release() records a
//   release event on `stream`. The pointer acquire() returns is valid for work queued on
//   `stream` until the matching release(); another stream must acquire for itself.
//   Warm path per page-in: no allocation, no pin, no host sync (pinned host weights);
//   staged (pageable) weights are filled by the pager's threads, and acquire() waits on
//   the host only until the copy of the layer it needs has been issued.
//
// Host weights (HostWeights)
//   pinned     registered in place at load (cudaHostRegister, chunks <= 2 GiB, exactly the
//              layers' pages: no rounding up to powers of two); a failure throws
//              vram::PinningError. The cost is reported in load().
//   pageable   never pinned: copied through a PinnedStagingPool (staging_buffers buffers
//              of staging_chunk_bytes, pinned once at load), filled by fill_threads threads
//              in 1 MiB pieces, several chunks at once and across consecutive page-ins;
//              each chunk's copy is queued as soon as it is filled, and a buffer is
//              reused only with the witness that its previous copy completed.
//   automatic  pinned; if pinning fails, pageable with ONE warning on stderr naming why.
//   Weights already page-locked (cudaHostAlloc) are used as they are and never unpinned.
//
// Counters (stats()): acquires, hits, page-ins (prefetched or on demand), bytes paged in;
// every stall_sample_period-th page-in is timed with CUDA events: its copy time (the
// effective GB/s) and, if it is acquired, how long the compute stream waited for it (the
// stall). Timed events are read only once complete (cudaEventQuery), never waited for.
//
// Bad input: no layers, a null or zero-byte layer, a layer larger than the budget, budget
// 0, duplicate names: vram::InvalidArgument from the constructor, nothing allocated or
// pinned. Releasing a layer not acquired: vram::InvalidArgument, nothing changes.
// A Handle (handle()) outlives the pager safely: its calls then throw InvalidArgument
// ("pager destroyed"). A Handle may be used from any thread at any moment: a call racing
// the pager's destruction either completes on the live pager (the destructor waits for it)
// or throws, and never touches freed memory; what an acquire returned is valid only while
// the pager lives. Destroying the pager waits for its copies and for the release
// events recorded, warns about layers still acquired, then frees the arena, the staging
// buffers and unregisters the host weights. A CUDA error inside acquire/release is thrown
// (vram::CudaError) and leaves the pager broken: later acquire/release calls throw
// vram::InvalidArgument quoting that first failure.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "vram/pager_plan.hpp"

namespace vram {

enum class HostWeights { automatic, pinned, pageable };

struct WeightLayer {
  std::string name;
  const void* host = nullptr;
  std::size_t bytes = 0;
};

// Configuration of a WeightPager. The plan's options (budget_bytes, prefetch_depth,
// alignment, copy_to_compute_ratio: vram/pager_plan.hpp) are the pager's own `plan`, handed
// to plan_residency() as they are: `{.plan = {.budget_bytes = 4_GiB, .prefetch_depth = 2}}`.
// The earlier top-level budget_bytes, prefetch_depth and copy_to_compute_ratio are
// plan.budget_bytes, plan.prefetch_depth and plan.copy_to_compute_ratio; plan.alignment
// (where each layer starts in the arena, 256 bytes by default) is new to the pager.
struct WeightPagerOptions {
  PagerPlanOptions plan;                // the budget, the prefetch depth, the arena's alignment
  std::vector<std::size_t> schedule{};  // one step's layer order; empty: 0, 1, ..., n-1
  HostWeights host = HostWeights::automatic;
  int device = 0;
  std::size_t register_chunk_bytes = std::size_t{2} << 30;  // clamped to 2 GiB
  std::size_t staging_chunk_bytes = std::size_t{32} << 20;
  std::size_t staging_buffers = 3;  // 2: double, 3: triple buffering; at most 64
  // Pageable fill: threads (0: the hardware threads, at most 16; at most 256; threads the
  // system cannot start are done without) and how they copy: memcpy, or non-temporal
  // stores, which is faster depends on the machine.
  unsigned fill_threads = 0;
  bool streaming_fill = false;        // true: non-temporal stores into staging (x86-64)
  unsigned stall_sample_period = 16;  // time every Nth page-in; 0: never
  bool print_plan_warnings = true;    // the plan check's warnings to stderr at construction
  EvictionPolicy eviction = EvictionPolicy::belady;
};

struct WeightPagerStats {
  std::uint64_t acquires = 0;
  std::uint64_t hits = 0;        // acquires that issued no page-in (resident or prefetched)
  std::uint64_t page_ins = 0;    // copies issued (prefetches + demand)
  std::uint64_t prefetches = 0;  // of page_ins: issued ahead of the acquire
  std::uint64_t bytes_paged_in = 0;
  std::uint64_t timed_page_ins = 0;  // page-ins whose copy time was measured (sampled)
  std::uint64_t timed_bytes = 0;
  double timed_copy_ms = 0;
  double effective_gbps = 0;            // timed_bytes / timed_copy_ms
  std::uint64_t stall_samples = 0;      // timed page-ins acquired (compute wait measured)
  std::uint64_t stalled = 0;            // of those: the compute waited
  double stall_ms_sampled = 0;          // sum of the measured waits
  double host_wait_ms = 0;              // pageable: acquire waited for the copy to be issued
  std::uint64_t staging_pin_calls = 0;  // pageable: pins by the staging pool (after load: 0)
};

struct WeightPagerLoad {
  HostWeights requested = HostWeights::automatic;
  bool pinned = false;             // the streamed layers are read from page-locked host memory
  std::size_t pinned_bytes = 0;    // registered by the pager (page-rounded, merged ranges)
  std::size_t register_calls = 0;  // cudaHostRegister calls (chunks <= register_chunk_bytes)
  std::size_t already_pinned_bytes = 0;  // found page-locked already; left as is
  double pin_seconds = 0;
  double upload_seconds = 0;    // resident layers copied in at construction
  std::string fallback_reason;  // automatic mode: why it stages instead (empty: pinned)
};

// The CUDA side of the pager, behind a seam: the production implementation lives in
// src/pager/pager_device.cpp; the CPU tests substitute a host-memory one. Calls come under
// the pager's lock, in the order documented for each, and none after shutdown().
class PagerDevice {
 public:
  struct HostRange {
    const void* data;
    std::size_t bytes;
  };
  virtual ~PagerDevice() = default;
  // 0. The index of the first range the host cannot read (device memory given as host
  // weights), ranges.size() when none. The default trusts the caller.
  virtual std::size_t first_device_range(std::span<const HostRange> ranges) {
    return ranges.size();
  }
  // 1. Page-locks the ranges in chunks of at most chunk_bytes; on failure undoes its own
  // registrations and returns the reason (empty on success). Fills the load report.
  virtual std::string pin_host(std::span<const HostRange> ranges, std::size_t chunk_bytes,
                               WeightPagerLoad& load) = 0;
  // 2. The arena, once. 3. Blocking copies of the resident layers.
  virtual void* allocate_arena(std::size_t bytes) = 0;
  virtual void upload(void* device, const void* host, std::size_t bytes) = 0;
  // 4. Slot events, the copy stream; with `staged`, the staging pool and fill threads.
  virtual void configure(std::size_t slot_count, bool staged, const WeightPagerOptions& o) = 0;
  // Warm path. page_in: after the slot's recorded releases, copy, then mark the slot ready.
  virtual void page_in(std::size_t slot, void* device, const void* host, std::size_t bytes) = 0;
  virtual void wait_ready(std::size_t slot, cudaStream_t stream) = 0;
  virtual void record_release(std::size_t slot, cudaStream_t stream) = 0;
  // Cold path: adds the timing samples that completed; waits for every page-in.
  virtual void collect(WeightPagerStats& stats) = 0;
  virtual void synchronize() = 0;
  // Destruction: waits for copies and releases (noexcept), then frees everything it made.
  virtual void shutdown(void* arena, std::size_t arena_bytes) noexcept = 0;
};

std::unique_ptr<PagerDevice> make_cuda_pager_device(int device);

namespace detail {
struct PagerState;
}

class WeightPager {
 public:
  class Handle;

  // Throws vram::InvalidArgument (bad input), vram::PinningError (HostWeights::pinned and
  // pinning failed), vram::OutOfMemory (the arena), vram::CudaError.
  WeightPager(std::vector<WeightLayer> layers, WeightPagerOptions options);
  WeightPager(std::vector<WeightLayer> layers, WeightPagerOptions options,
              std::unique_ptr<PagerDevice> device);
  WeightPager(WeightPager&&) noexcept = default;
  WeightPager& operator=(WeightPager&&) noexcept;
  WeightPager(const WeightPager&) = delete;
  WeightPager& operator=(const WeightPager&) = delete;
  ~WeightPager();

  // The layer's device memory, its bytes ordered before work queued on `stream` after this
  // call. Throws InvalidArgument (unknown layer), OutOfMemory (every slot acquired).
  [[nodiscard]] void* acquire(std::size_t layer, cudaStream_t stream);
  [[nodiscard]] void* acquire(std::string_view name, cudaStream_t stream);
  // The layer may be evicted once the work queued on `stream` so far has completed.
  void release(std::size_t layer, cudaStream_t stream);
  void release(std::string_view name, cudaStream_t stream);

  std::size_t index_of(std::string_view name) const;
  std::size_t layer_count() const;
  const PagerPlan& plan() const;
  const WeightPagerLoad& load() const;
  WeightPagerStats stats() const;
  void reset_counters();
  // Blocks until every page-in queued so far completed (cold path: tests, benchmarks).
  void synchronize();
  Handle handle() const;

 private:
  std::shared_ptr<detail::PagerState> state_;
};

// A non-owning reference to a pager that may be destroyed first, usable from any thread:
// a call made after (or racing) the pager's destruction either completes before the
// destructor's teardown or throws vram::InvalidArgument ("pager destroyed"); it never
// touches freed memory. alive() turns false when the destructor's teardown begins.
class WeightPager::Handle {
 public:
  [[nodiscard]] void* acquire(std::size_t layer, cudaStream_t stream) const;
  void release(std::size_t layer, cudaStream_t stream) const;
  bool alive() const noexcept;

 private:
  friend class WeightPager;
  explicit Handle(std::weak_ptr<detail::PagerState> state) : state_(std::move(state)) {}
  std::weak_ptr<detail::PagerState> state_;
};

}  // namespace vram
