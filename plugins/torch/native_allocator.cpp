#include "native_allocator.hpp"

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cuda/capture.hpp"
#include "cuda/ipc.hpp"
#include "cuda/memory.hpp"
#include "device_registry.hpp"
#include "errors.hpp"
#include "freed_requests.hpp"
#include "ipc.hpp"
#include "live_blocks.hpp"
#include "memory_history.hpp"
#include "vram/cuda/error.hpp"
#include "vram/size_classes.hpp"

namespace vram_torch {

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;
using TraceAction = cda::TraceEntry::Action;

// The allocator PyTorch names for a pool (MemPool(allocator=...)): where a ForeignPool's
// segments come from.
class ForeignPoolAllocator final : public PoolAllocator {
 public:
  explicit ForeignPoolAllocator(std::shared_ptr<cca::CUDAAllocator> allocator) noexcept
      : allocator_(std::move(allocator)) {}
  void* allocate(std::size_t size, cudaStream_t stream) override {
    // A segment made during a capture: its cudaMalloc (or the like) must not invalidate the
    // capture (PyTorch relaxes the mode the same way); the pool never frees it while in use.
    const vram::cuda::RelaxedCaptureMode relaxed;
    return allocator_->raw_alloc_with_stream(size, stream);
  }
  void deallocate(void* ptr) noexcept override {
    try {
      allocator_->raw_delete(ptr);
    } catch (const std::exception& e) {
      note_error_built(
          [&] { return std::string("free through a MemPool's allocator failed: ") + e.what(); },
          false);
    }
  }

 private:
  std::shared_ptr<cca::CUDAAllocator> allocator_;
};

// A pool's live blocks at getCheckpointState, restored by setCheckpointPoolState.
struct PoolCheckpoint final : cca::AllocatorState {
  struct Entry {
    void* ptr;
    LiveBlock block;
  };
  int device = 0;
  LiveBlock::PoolId pool{0, 0};
  std::vector<Entry> live;
};

LiveBlock::PoolId pool_key(const c10::MempoolId_t& id) noexcept {
  return {static_cast<std::uint64_t>(id.first), static_cast<std::uint64_t>(id.second)};
}

// PyTorch's own size format (bytes up to 1024, then KiB, MiB, GiB with two decimals, never
// TiB): tools and tests match its out-of-memory message.
std::string format_bytes(std::uint64_t bytes) {
  char text[48];
  if (bytes <= 1024) {
    std::snprintf(text, sizeof text, "%llu bytes", static_cast<unsigned long long>(bytes));
  } else if (bytes <= (std::uint64_t{1} << 20)) {
    std::snprintf(text, sizeof text, "%.2f KiB", static_cast<double>(bytes) / 1024.0);
  } else if (bytes <= (std::uint64_t{1} << 30)) {
    std::snprintf(text, sizeof text, "%.2f MiB", static_cast<double>(bytes) / 1048576.0);
  } else {
    std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / 1073741824.0);
  }
  return text;
}

void copy_stat(const Tally& from, cda::Stat& to) noexcept {
  to.current = static_cast<int64_t>(from.current());
  to.peak = static_cast<int64_t>(from.peak());
  to.allocated = static_cast<int64_t>(from.added());
  to.freed = static_cast<int64_t>(from.removed());
}

void copy_stat(SplitTally& from, cda::StatArray& to) noexcept {
  copy_stat(from.all, to[static_cast<std::size_t>(cda::StatType::AGGREGATE)]);
  copy_stat(from.by_kind[0], to[static_cast<std::size_t>(cda::StatType::SMALL_POOL)]);
  copy_stat(from.by_kind[1], to[static_cast<std::size_t>(cda::StatType::LARGE_POOL)]);
}

void delete_block(void* ptr);

// What the calling thread is doing while trace events are wanted: the stream and stack of
// the request it serves (a SEGMENT_ALLOC its growth makes carries them, as PyTorch's does;
// so does a SEGMENT_FREE of growth past the budget), or the stack of the empty_cache it
// runs (a SEGMENT_FREE carries it, with RecordContext::ALL, as PyTorch's does).
struct RequestTrace {
  cudaStream_t stream = nullptr;
  const std::shared_ptr<c10::GatheredContext>* context = nullptr;
};
thread_local RequestTrace t_request;

class RequestScope {
 public:
  RequestScope(bool tracing, cudaStream_t stream,
               const std::shared_ptr<c10::GatheredContext>* context) noexcept
      : set_(tracing) {
    if (!set_) return;  // no thread-local access on the warm path
    saved_ = t_request;
    t_request = {stream, context};
  }
  ~RequestScope() {
    if (set_) t_request = saved_;
  }
  RequestScope(const RequestScope&) = delete;
  RequestScope& operator=(const RequestScope&) = delete;

 private:
  RequestTrace saved_;
  bool set_ = false;
};

class NativeAllocator final : public cca::CUDAAllocator {
 public:
  c10::DataPtr allocate(std::size_t size) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    void* ptr = size == 0 ? nullptr : malloc_block(size, device, stream);
    return {ptr, ptr, &delete_block, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    vram::cuda::copy(dest, src, count, "cudaMemcpy (copy_data)");
  }

  void* raw_alloc(std::size_t size) override {
    if (size == 0) return nullptr;
    const c10::DeviceIndex device = c10::cuda::current_device();
    return malloc_block(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(std::size_t size, cudaStream_t stream) override {
    if (size == 0) return nullptr;
    return malloc_block(size, c10::cuda::current_device(), stream);
  }
  void raw_delete(void* ptr) override {
    if (ptr == nullptr) return;
    TORCH_CHECK(free_block(ptr), "vram: invalid device pointer: ", ptr,
                " (not a live block of this allocator, or freed twice)");
  }

  void init(int device_count) override {
    device_count_ = device_count;
    initialized_.store(true, std::memory_order_release);
  }
  bool initialized() override { return initialized_.load(std::memory_order_acquire); }

  double getMemoryFraction(c10::DeviceIndex device) override {
    check_device(device);
    return fraction_[static_cast<std::size_t>(device)].load(std::memory_order_relaxed);
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check_device(device);
    TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "invalid fraction:", fraction,
                ". Please set within [0, 1].");
    const auto total = vram::cuda::total_memory(device);
    TORCH_CHECK(total.has_value(), "vram: cannot read the memory of device ", int(device));
    const auto index = static_cast<std::size_t>(device);
    fraction_[index].store(fraction, std::memory_order_relaxed);
    limit_[index].store(fraction >= 1.0
                            ? kNoLimit
                            : static_cast<std::size_t>(fraction * static_cast<double>(*total)),
                        std::memory_order_relaxed);
  }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};  // vram's virtual-memory tier is not PyTorch's expandable segments
  }

  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {
    // The stack of this call for the SEGMENT_FREE events of the trim (RecordContext::ALL).
    const bool tracing = history_.wanted();
    MemoryHistory::Context context;
    if (tracing) context = history_.context_for_free();
    const RequestScope request(tracing, nullptr, &context);
    // A private pool's free blocks stay its own while it has a use; once released they are
    // among the memory any trim gives back.
    for_each_state(-1, [](DeviceState& state) {
      state.empty_cache();
      state.graphs.release_unused_foreign();
    });
  }
  // torch.cuda.caching_allocator_enable(False): new requests go to cudaMalloc one by one,
  // uncounted (PyTorch's meaning); blocks vram holds stay until freed.
  void enable(bool value) override { enabled_.store(value, std::memory_order_relaxed); }
  bool isEnabled() const override { return enabled_.load(std::memory_order_relaxed); }
  void cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) override {
    if (largest_block == nullptr) return;
    std::size_t largest = 0;
    if (DeviceState* state = find_state(device)) {
      for (const vram::DevicePoolSegment& segment : state->pool.memory_map()) {
        for (const auto& range : segment.ranges) {
          if (!range.used) largest = std::max(largest, range.bytes);
        }
      }
    }
    *largest_block = std::max(*largest_block, largest);
  }
  void* getBaseAllocation(void* ptr, std::size_t* size) override {
    // Each block is its own base: shareIpcHandle adds the block's offset in its segment.
    if (size != nullptr) *size = live_.size_of(ptr);
    return ptr;
  }

  void recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) override {
    void* ptr = data.get();
    if (ptr == nullptr || data.get_deleter() != &delete_block) return;  // not ours
    DeviceState* state = find_state(data.device().index());
    if (state == nullptr) return;
    state->counters.record_calls.fetch_add(1, std::memory_order_relaxed);
    try {
      state->streams.record(ptr, stream.stream());
    } catch (...) {
      note_error("record_stream: out of host memory; synchronizing the stream instead", false);
      (void)vram::cuda::try_synchronize_stream(stream.stream());
    }
  }

  cda::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    cda::DeviceStats stats;
    DeviceState* state = find_state(device);
    if (state == nullptr) return stats;
    Counters& c = state->counters;
    copy_stat(c.allocations, stats.allocation);
    copy_stat(c.allocations, stats.active);
    copy_stat(c.class_bytes, stats.allocated_bytes);
    copy_stat(c.class_bytes, stats.active_bytes);
    copy_stat(c.requested_bytes, stats.requested_bytes);
    // Blocks freed but held back for recorded streams are still active (PyTorch's meaning).
    const auto held_blocks = static_cast<int64_t>(state->streams.held_blocks());
    const auto held_bytes = static_cast<int64_t>(state->streams.held_bytes());
    auto& active = stats.active[static_cast<std::size_t>(cda::StatType::AGGREGATE)];
    auto& active_bytes = stats.active_bytes[static_cast<std::size_t>(cda::StatType::AGGREGATE)];
    active.current += held_blocks;
    active_bytes.current += held_bytes;
    active.peak = std::max(active.peak, active.current);
    active_bytes.peak = std::max(active_bytes.peak, active_bytes.current);

    const vram::DevicePoolStats pool = state->pool.stats();
    // Reserved bytes and device allocations as vram_torch.stats() has them (stats_of), so
    // the two views agree: MemPools' own allocators' segments included.
    const vram_torch_stats_t own = stats_of(*state);
    auto& reserved = stats.reserved_bytes[static_cast<std::size_t>(cda::StatType::AGGREGATE)];
    reserved.current = static_cast<int64_t>(own.reserved_bytes_current);
    reserved.peak = static_cast<int64_t>(own.reserved_bytes_peak);
    auto& segments = stats.segment[static_cast<std::size_t>(cda::StatType::AGGREGATE)];
    segments.current =
        static_cast<int64_t>(pool.segments + state->graphs.foreign_totals().segments);
    segments.allocated = static_cast<int64_t>(own.num_device_alloc);
    segments.freed = static_cast<int64_t>(own.num_device_free);
    stats.num_alloc_retries =
        static_cast<int64_t>(pool.oom_retries + c.retries.load(std::memory_order_relaxed));
    stats.num_ooms = static_cast<int64_t>(c.ooms.load(std::memory_order_relaxed));
    stats.num_sync_all_streams = static_cast<int64_t>(pool.quiesces);
    stats.num_device_alloc = static_cast<int64_t>(own.num_device_alloc);
    stats.num_device_free = static_cast<int64_t>(own.num_device_free);
    stats.max_split_size = -1;  // no limit: PyTorch reports its SIZE_MAX default as -1
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    if (DeviceState* state = find_state(device)) {
      state->counters.restart_totals();
      state->counters.retries.store(0, std::memory_order_relaxed);
      state->counters.ooms.store(0, std::memory_order_relaxed);
    }
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    if (DeviceState* state = find_state(device)) {
      state->counters.restart_peaks();
      state->pool.reset_peak();
    }
  }

  cca::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool include_traces) override;

  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    state_for(device).graphs.begin(pool_key(id), std::move(filter));
  }
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    if (DeviceState* state = find_state(device)) state->graphs.end(pool_key(id));
  }
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    if (DeviceState* state = find_state(device)) state->graphs.release(pool_key(id));
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t id) override {
    DeviceState* state = find_state(device);
    return state == nullptr ? 0 : state->graphs.use_count(pool_key(id));
  }
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    std::shared_ptr<ForeignPool> foreign;
    if (allocator != nullptr && allocator.get() != this) {
      const LiveBlock::PoolId key = pool_key(id);
      foreign = std::make_shared<ForeignPool>(
          key, std::make_shared<ForeignPoolAllocator>(std::move(allocator)),
          [this, device, key](std::uintptr_t address, std::size_t bytes, cudaStream_t stream,
                              bool made) {
            foreign_segment_event(device, key, address, bytes, stream, made);
          });
    }
    state_for(device).graphs.retain(pool_key(id), std::move(foreign));
  }
  // vram's private pools never lend their free blocks to other requests (use_on_oom asks
  // for that) and never split a block (no_split): both are accepted and change nothing.
  void setUseOnOOM(c10::DeviceIndex, c10::MempoolId_t, bool) override {}
  void setNoSplit(c10::DeviceIndex, c10::MempoolId_t) override {}

  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    const LiveBlock::PoolId key = pool_key(id);
    std::size_t found = 0;
    bool all_expected = true;
    live_.for_each([&](void* ptr, const LiveBlock& block) {
      if (block.device != device || block.pool != key) return;
      ++found;
      if (expected.count(ptr) == 0) all_expected = false;
    });
    return all_expected && found == expected.size();
  }

  cca::ShareableHandle shareIpcHandle(void* ptr) override {
    try {
      const vram::cuda::IpcExport exported = vram::cuda::export_ipc(ptr);
      return {static_cast<ptrdiff_t>(exported.offset),
              std::string(reinterpret_cast<const char*>(&exported.handle), sizeof exported.handle)};
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "vram: cannot share this CUDA tensor with another process: ", e.what());
    }
  }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    TORCH_CHECK(handle.size() == sizeof(cudaIpcMemHandle_t), "vram: a CUDA IPC handle of ",
                handle.size(), " bytes; vram shares ", sizeof(cudaIpcMemHandle_t),
                "-byte cudaIpcMemHandle_t handles");
    const int device = c10::cuda::current_device();
    void* base = open_shared_segment(handle, device);
    TORCH_CHECK(base != nullptr, "vram: cannot open a shared CUDA tensor: ", last_error_text());
    // The mapping stays for the life of the process (one per handle, as PyTorch caches).
    return std::shared_ptr<void>(base, [](void*) {});
  }

  bool isHistoryEnabled() override { return history_.enabled(); }
  void recordHistory(bool enabled, cda::CreateContextFn recorder, std::size_t max_entries,
                     cda::RecordContext when, bool clear,
                     const std::vector<std::string>& skip_actions) override {
    history_.record_history(enabled, recorder, max_entries, when, clear, skip_actions);
    // Frees while history is off are not recorded: turned off, the records go (stale later).
    freed_requests_.set_recording(enabled);
  }
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    history_.annotate(md, c10::cuda::current_device());
  }
  void pushCompileContext(std::string& md) override { history_.push_compile_context(md); }
  void popCompileContext() override { history_.pop_compile_context(); }
  void setUserMetadata(const std::string& metadata) override {
    history_.set_user_metadata(metadata);
  }
  std::string getUserMetadata() override { return history_.user_metadata(); }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    history_.attach_oom_observer(std::move(observer));
  }
  void attachAllocatorTraceTracker(cda::AllocatorTraceTracker tracker) override {
    history_.attach_tracker(std::move(tracker));
  }

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    vram::cuda::enable_peer_access(dev, dev_to_access);
  }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                          std::size_t count, cudaStream_t stream, bool p2p_enabled) override {
    return vram::cuda::try_copy_device_async(dst, dst_device, src, src_device, count, stream,
                                             p2p_enabled);
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          c10::MempoolId_t id) override {
    auto checkpoint = std::make_shared<PoolCheckpoint>();
    checkpoint->device = device;
    checkpoint->pool = pool_key(id);
    live_.for_each([&](void* ptr, const LiveBlock& block) {
      if (block.device == device && block.pool == checkpoint->pool) {
        checkpoint->live.push_back({ptr, block});
      }
    });
    return checkpoint;
  }
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> state) override;

  std::string name() override { return "vram"; }

  // The allocation path of every entry point. Throws c10::OutOfMemoryError (PyTorch's
  // torch.OutOfMemoryError) and c10::Error.
  void* malloc_block(std::size_t size, c10::DeviceIndex device, cudaStream_t stream);
  // The free path: false when `ptr` is no live block (nothing changed).
  bool free_block(void* ptr) noexcept;
  // A unit of `device`'s pool reserved or about to go back (SegmentUnits): SEGMENT_ALLOC or
  // SEGMENT_FREE to the trackers and the history.
  void segment_event(int device, const vram::ReservedSpan& span, bool reserved) noexcept;
  // A segment of a MemPool's own allocator made or about to go back (ForeignPool): the same
  // events, with the pool's id (PyTorch's for a private pool's segment).
  void foreign_segment_event(int device, LiveBlock::PoolId pool, std::uintptr_t address,
                             std::size_t bytes, cudaStream_t stream, bool made) noexcept;

 private:
  void check_device(c10::DeviceIndex device) const {
    TORCH_CHECK(device >= 0 && device < kMaxDevices, "vram: invalid device ", int(device));
  }
  void* malloc_uncached(std::size_t size, c10::DeviceIndex device, cudaStream_t stream);
  // The profiler's memory events (torch.profiler.profile(profile_memory=True)): `bytes` is
  // negative for a free.
  static void report_to_profiler(DeviceState& state, void* ptr, std::int64_t bytes, int device);
  [[noreturn]] void out_of_memory(DeviceState& state, int device, std::size_t size,
                                  cudaStream_t stream, const std::string& why);
  void trace(TraceAction action, int device, const void* ptr, std::size_t size, cudaStream_t stream,
             LiveBlock::PoolId pool, MemoryHistory::Context context);
  static std::string last_error_text() {
    std::string text(copy_last_error(nullptr, 0), '\0');
    copy_last_error(text.data(), text.size() + 1);
    return text;
  }
  static void* open_shared_segment(const std::string& handle, int device);

  LiveBlocks live_;
  MemoryHistory history_;
  FreedRequests freed_requests_;  // the last request of free memory, for snapshots
  std::array<std::atomic<double>, kMaxDevices> fraction_{};
  static constexpr std::size_t kNoLimit = std::numeric_limits<std::size_t>::max();
  std::array<std::atomic<std::size_t>, kMaxDevices> limit_{};  // bytes; kNoLimit: none
  std::atomic<bool> initialized_{false};
  int device_count_ = 0;
  std::atomic<bool> enabled_{true};

 public:
  NativeAllocator() {
    for (auto& f : fraction_) f.store(1.0, std::memory_order_relaxed);
    for (auto& l : limit_) l.store(kNoLimit, std::memory_order_relaxed);
  }
};

std::shared_ptr<NativeAllocator>& installed() {
  static auto* allocator = new std::shared_ptr<NativeAllocator>();  // never destroyed
  return *allocator;
}

void delete_block(void* ptr) {
  if (ptr == nullptr) return;
  if (!installed()->free_block(ptr)) {
    note_error("free of a pointer that is no live block of vram (ignored)", false);
  }
}

void on_segment(int device, const vram::ReservedSpan& span, bool reserved) noexcept {
  if (const auto& allocator = installed()) allocator->segment_event(device, span, reserved);
}

void NativeAllocator::segment_event(int device, const vram::ReservedSpan& span,
                                    bool reserved) noexcept {
  // Memory given back, or mapped afresh: no record names it any more.
  freed_requests_.forget(device, span.address, span.address + span.bytes);
  if (!history_.wanted()) return;
  try {
    // PyTorch's own: a segment's whole span, the stream and stack of the request that grew
    // it (a give-back: the stack of empty_cache under RecordContext::ALL), the shared pool (a unit
    // of vram's tiers may hold blocks of several private pools). Mapped runs of virtual memory are
    // reported as segments too: each is one physical allocation, mapped and unmapped whole, which
    // is what NCCL's registration hooks act on (they ignore SEGMENT_MAP and SEGMENT_UNMAP).
    history_.record_noexcept(
        cda::TraceEntry(reserved ? TraceAction::SEGMENT_ALLOC : TraceAction::SEGMENT_FREE,
                        static_cast<c10::DeviceIndex>(device), span.address, span.bytes,
                        reserved ? t_request.stream : nullptr, {0, 0}, c10::getApproximateTime(),
                        t_request.context != nullptr ? *t_request.context : nullptr));
  } catch (...) {
    note_error("memory history: a segment event could not be recorded", false);
  }
}

void NativeAllocator::foreign_segment_event(int device, LiveBlock::PoolId pool,
                                            std::uintptr_t address, std::size_t bytes,
                                            cudaStream_t stream, bool made) noexcept {
  if (DeviceState* state = find_state(device)) {
    (made ? state->counters.foreign_segments_made : state->counters.foreign_segments_freed)
        .fetch_add(1, std::memory_order_relaxed);
  }
  if (!history_.wanted()) return;
  try {
    // As segment_event: every tracker hears it even when one throws (NCCL's registration).
    history_.record_noexcept(cda::TraceEntry(
        made ? TraceAction::SEGMENT_ALLOC : TraceAction::SEGMENT_FREE,
        static_cast<c10::DeviceIndex>(device), address, bytes, stream,
        {static_cast<c10::CaptureId_t>(pool.first), static_cast<c10::CaptureId_t>(pool.second)},
        c10::getApproximateTime(), t_request.context != nullptr ? *t_request.context : nullptr));
  } catch (...) {
    note_error("memory history: a segment event could not be recorded", false);
  }
}

void NativeAllocator::trace(TraceAction action, int device, const void* ptr, std::size_t size,
                            cudaStream_t stream, LiveBlock::PoolId pool,
                            MemoryHistory::Context context) {
  history_.record(cda::TraceEntry(
      action, static_cast<c10::DeviceIndex>(device), reinterpret_cast<std::uintptr_t>(ptr), size,
      stream,
      {static_cast<c10::CaptureId_t>(pool.first), static_cast<c10::CaptureId_t>(pool.second)},
      c10::getApproximateTime(), std::move(context)));
}

void NativeAllocator::out_of_memory(DeviceState& state, int device, std::size_t size,
                                    cudaStream_t stream, const std::string& why) {
  state.counters.ooms.fetch_add(1, std::memory_order_relaxed);
  const auto info = vram::cuda::memory_info(device);
  const std::size_t total = info ? info->total_bytes : 0;
  const std::size_t free = info ? info->free_bytes : 0;
  const std::uint64_t allocated = state.counters.class_bytes.all.current();
  const vram::DevicePoolStats pool = state.pool.stats();
  history_.notify_oom(device, allocated, total, free);
  if (history_.wanted()) {
    history_.record(cda::TraceEntry(TraceAction::OOM, static_cast<c10::DeviceIndex>(device), free,
                                    size, stream, {0, 0}, c10::getApproximateTime()));
  }
  note_error(why, true);
  // PyTorch's words for a request of an exabyte or more.
  TORCH_CHECK_WITH(OutOfMemoryError, size < (std::size_t{1} << 60),
                   "CUDA out of memory. Tried to allocate more than 1EB memory.");
  TORCH_CHECK_WITH(
      OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ", format_bytes(size),
      ". GPU ", device, " has a total capacity of ", format_bytes(total), " of which ",
      format_bytes(free), " is free. Of the allocated memory ", format_bytes(allocated),
      " is allocated by PyTorch (vram), and ",
      format_bytes(pool.bytes_reserved > allocated ? pool.bytes_reserved - allocated : 0),
      " is reserved by vram but unallocated. vram: ", why);
}

void* NativeAllocator::malloc_block(std::size_t size, c10::DeviceIndex device,
                                    cudaStream_t stream) {
  DeviceState* state = nullptr;
  try {
    state = &state_for(device);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "vram: cannot create the pool of device ", int(device), ": ", e.what());
  }
  if (size > vram::SizeClasses::kMaxBytes) {
    out_of_memory(*state, device, size, stream, "more than any block of vram (at most 1 TiB)");
  }
  if (!enabled_.load(std::memory_order_relaxed)) return malloc_uncached(size, device, stream);
  if (state->streams.held_blocks() != 0) state->streams.release(false);
  const std::size_t block_bytes = state->pool.block_bytes(size);
  if (const std::size_t limit =
          limit_[static_cast<std::size_t>(device)].load(std::memory_order_relaxed);
      limit != kNoLimit && state->counters.class_bytes.all.current() + block_bytes > limit) {
    out_of_memory(*state, device, size, stream,
                  "the allocation would exceed the allowed memory of this process (" +
                      format_bytes(limit) + ", set_per_process_memory_fraction)");
  }
  // While PyTorch routes requests to a private pool (graph_routes.hpp): one relaxed load
  // otherwise.
  const bool routing = state->graphs.active();
  GraphRoutes::Routed routed;
  // The stack is gathered before the pool is called: its growth's SEGMENT_ALLOC carries it.
  const bool tracing = history_.wanted();
  MemoryHistory::Context context;
  if (tracing) context = history_.context_for_allocation();
  const RequestScope request(tracing, stream, &context);
  for (int attempt = 0;; ++attempt) {
    try {
      if (routing) routed = state->graphs.allocate(size, stream);
      if (routed.foreign && routed.ptr == nullptr) {
        // The pool's own allocator said no: its blocks never come from vram. Blocks held back
        // for recorded streams are not waited for (PyTorch processes such events only while
        // no MemPool or capture is in use).
        out_of_memory(*state, device, size, stream,
                      "the allocator of the MemPool this request is routed to returned null");
      }
      if (routed.ptr == nullptr) routed.ptr = state->pool.allocate_async(size, stream);
      break;
    } catch (const std::bad_alloc& e) {
      if (attempt == 0 && state->reclaim_held_back(routing)) continue;
      out_of_memory(*state, device, size, stream, e.what());
    } catch (const c10::Error&) {
      throw;  // a MemPool's own allocator said no
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "vram: allocation of ", size, " bytes on device ", int(device),
                  " failed: ", e.what());
    }
  }
  LiveBlock block;
  block.size = size;
  block.block_bytes = routed.foreign ? routed.bytes : block_bytes;
  block.device = device;
  block.stream = stream;
  block.pool = routed.id;
  block.foreign = std::move(routed.foreign);
  try {
    if (tracing) block.context = context;
    live_.insert(routed.ptr, block);
  } catch (...) {
    if (block.foreign) {
      block.foreign->deallocate(routed.ptr);
    } else {
      state->pool.deallocate_async(routed.ptr, size, stream);
    }
    throw;
  }
  state->counters.count_allocation(block.block_bytes, size);
  if (tracing) {  // PyTorch's trace holds the requested size
    trace(TraceAction::ALLOC, device, routed.ptr, size, stream, block.pool,
          std::static_pointer_cast<c10::GatheredContext>(block.context));
  }
  if (c10::memoryProfilingEnabled()) {
    report_to_profiler(*state, routed.ptr, static_cast<std::int64_t>(block.block_bytes), device);
  }
  return routed.ptr;
}

void* NativeAllocator::malloc_uncached(std::size_t size, c10::DeviceIndex device,
                                       cudaStream_t stream) {
  void* ptr = nullptr;
  try {
    ptr = vram::cuda::allocate_device(size, device);
  } catch (const vram::OutOfMemory& e) {
    out_of_memory(state_for(device), device, size, stream,
                  std::string("cudaMalloc (caching allocator disabled): ") + e.what());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "vram: cudaMalloc of ", size, " bytes on device ", int(device),
                " failed: ", e.what());
  }
  LiveBlock block;
  block.size = size;
  block.block_bytes = size;
  block.device = device;
  block.stream = stream;
  block.uncached = true;
  try {
    live_.insert(ptr, block);
  } catch (...) {
    vram::cuda::free_device(ptr);
    throw;
  }
  return ptr;
}

void NativeAllocator::report_to_profiler(DeviceState& state, void* ptr, std::int64_t bytes,
                                         int device) {
  const vram::DevicePoolStats pool = state.pool.stats();
  c10::reportMemoryUsageToProfiler(
      ptr, bytes, static_cast<std::size_t>(state.counters.class_bytes.all.current()),
      pool.bytes_reserved,
      c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}

bool NativeAllocator::free_block(void* ptr) noexcept {
  std::optional<LiveBlock> found = live_.take(ptr);
  if (!found) return false;
  LiveBlock& block = *found;
  if (block.uncached) {  // made while the caching allocator was disabled: never counted
    // cudaFree orders itself after all work: its recorded streams are only forgotten.
    if (DeviceState* state = find_state(block.device)) (void)state->streams.take(ptr);
    vram::cuda::free_device(ptr);
    return true;
  }
  DeviceState* state = find_state(block.device);
  if (state == nullptr) return true;  // cannot be: a block's state outlives it
  state->counters.count_free(block.block_bytes, block.size);
  if (history_.wanted()) {
    try {
      // Both entries carry the free's stack, else the allocation's (as PyTorch's do).
      MemoryHistory::Context context = history_.context_for_free();
      if (context == nullptr)
        context = std::static_pointer_cast<c10::GatheredContext>(block.context);
      trace(TraceAction::FREE_REQUESTED, block.device, ptr, block.size, block.stream, block.pool,
            context);
      trace(TraceAction::FREE_COMPLETED, block.device, ptr, block.size, block.stream, block.pool,
            std::move(context));
      // A MemPool's own allocator's blocks keep theirs in its ForeignPool.
      if (history_.enabled() && !block.foreign) {
        freed_requests_.note(block.device, reinterpret_cast<std::uintptr_t>(ptr), block.block_bytes,
                             block.size);
      }
    } catch (...) {
      note_error("memory history: a free could not be recorded", false);
    }
  }
  if (c10::memoryProfilingEnabled()) {
    try {
      report_to_profiler(*state, ptr, -static_cast<std::int64_t>(block.block_bytes), block.device);
    } catch (...) {
      note_error("profiler: a free could not be reported", false);
    }
  }
  // A private pool's block (a MemPool's, a capture's) that other streams used (record_stream)
  // is held back before its pool may hand it out again, within a capture too (the graph
  // would order nothing after those streams' work). Released, it goes back to its
  // ForeignPool, or through the pool to its graph pool.
  const bool pools_block = block.foreign || block.pool != LiveBlock::PoolId{0, 0};
  if (pools_block && !block.foreign) state->graphs.note_free(block.pool, ptr, block.stream);
  // The context moves (no count taken on the warm path): nothing reads it after this.
  const StreamTracking::Shown shown{block.pool, std::move(block.context)};
  if (pools_block || !state->graphs.active()) {
    if (state->streams.hold_back(ptr, block.size, block.block_bytes, block.stream, block.foreign,
                                 shown)) {
      return true;
    }
    if (block.foreign) {
      block.foreign->deallocate(ptr);
      return true;  // `block` goes: its pool gives its memory back if that was its last use
    }
    // Freed during a capture on a stream a route accepts: that pool's (graph_routes.hpp).
    if (state->graphs.active() && state->graphs.deallocate(ptr, block.size, block.stream)) {
      return true;
    }
  } else if (state->route_or_hold_back(ptr, block.size, block.block_bytes, block.stream, shown)) {
    return true;
  }
  state->pool.deallocate_async(ptr, block.size, block.stream);
  return true;
}

cca::CheckpointDelta NativeAllocator::setCheckpointPoolState(
    c10::DeviceIndex device, std::shared_ptr<cca::AllocatorState> state) {
  auto* checkpoint = dynamic_cast<PoolCheckpoint*>(state.get());
  TORCH_CHECK(checkpoint != nullptr, "vram: a checkpoint state that vram did not make");
  TORCH_CHECK(checkpoint->device == device, "vram: a checkpoint of device ", checkpoint->device,
              " restored on device ", int(device));
  DeviceState& device_state = state_for(device);
  cca::CheckpointDelta delta;
  // Every live block of the pool goes back to it...
  std::vector<void*> live;
  live_.for_each([&](void* ptr, const LiveBlock& block) {
    if (block.device == device && block.pool == checkpoint->pool) live.push_back(ptr);
  });
  for (void* ptr : live) {
    if (free_block(ptr)) delta.ptrs_freed.push_back(ptr);
  }
  // A block used on other streams was held back: waited for here, so that it is a free
  // block of the pool again (PyTorch requires such a block to have no pending event).
  if (device_state.streams.held_blocks() != 0) device_state.streams.release(true);
  // ...and the checkpoint's live blocks are taken again, at their addresses. A block of the
  // pool may be larger than its request (the pool reuses a block up to a quarter larger), so
  // any claimed size is accepted. All are claimed before any DataPtr exists: when one is no
  // longer a free block of the pool, the claimed ones go back and nothing was made.
  std::vector<const PoolCheckpoint::Entry*> claimed;
  claimed.reserve(checkpoint->live.size());
  for (const PoolCheckpoint::Entry& entry : checkpoint->live) {
    if (device_state.graphs.claim(checkpoint->pool, entry.ptr) == 0) {
      for (const PoolCheckpoint::Entry* back : claimed) {
        device_state.pool.deallocate_async(back->ptr, back->block.size, back->block.stream);
      }
      TORCH_CHECK(false, "vram: cannot restore the checkpoint of pool (", checkpoint->pool.first,
                  ", ", checkpoint->pool.second, "): the block at ", entry.ptr,
                  " is no longer a free block of that pool");
    }
    claimed.push_back(&entry);
  }
  delta.dataptrs_allocd.reserve(claimed.size());
  for (const PoolCheckpoint::Entry* entry : claimed) {
    live_.insert(entry->ptr, entry->block);
    device_state.counters.count_allocation(entry->block.block_bytes, entry->block.size);
    delta.dataptrs_allocd.emplace_back(entry->ptr, entry->ptr, &delete_block,
                                       c10::Device(c10::DeviceType::CUDA, device));
  }
  return delta;
}

cca::SnapshotInfo NativeAllocator::snapshot(c10::MempoolId_t mempool_id, bool include_traces) {
  cca::SnapshotInfo info;
  const LiveBlock::PoolId wanted = pool_key(mempool_id);
  struct Live {
    std::uintptr_t address;
    const void* ptr;
    LiveBlock block;
    bool pool_free = false;  // a private pool's free block (block.size: 0), not a tensor's
    bool held = false;       // freed, held back for its recorded streams (stream_tracking.hpp)
  };
  std::vector<Live> live;
  live_.for_each([&](void* ptr, const LiveBlock& block) {
    live.push_back({reinterpret_cast<std::uintptr_t>(ptr), ptr, block});
  });
  // Read in the order a block moves (a tensor's, held back, a private pool's free block), so
  // that a block moving while this reads is found twice (kept once below), never missed.
  for_each_state(-1, [&](DeviceState& state) {
    // Blocks freed and held back for their recorded streams: still their pool's, shown
    // active and not allocated (PyTorch's "active_pending_free").
    for (StreamTracking::HeldView& held : state.streams.held()) {
      LiveBlock block;
      block.size = held.size;
      block.block_bytes = held.bytes;
      block.device = state.device;
      block.stream = held.stream;
      block.pool = held.shown.pool;
      block.context = std::move(held.shown.context);
      live.push_back({held.address, nullptr, std::move(block), false, true});
    }
    // The free blocks private pools keep for their own next allocations: their pools' memory
    // (PyTorch lists a private pool's cached blocks in that pool's segments), not free to
    // anyone else.
    for (const GraphRoutes::FreeBlock& free : state.graphs.free_blocks()) {
      LiveBlock block;
      block.block_bytes = free.bytes;
      block.device = state.device;
      block.stream = free.stream;
      block.pool = free.id;
      live.push_back({free.address, nullptr, std::move(block), true});
    }
  });
  // By address, and at one address (a block that moved while this read) its earliest state
  // first: a tensor's, then held back, then a pool's free block. Each address is listed once.
  const auto stage = [](const Live& l) { return l.pool_free ? 2 : l.held ? 1 : 0; };
  std::sort(live.begin(), live.end(), [&stage](const Live& a, const Live& b) {
    return a.address != b.address ? a.address < b.address : stage(a) < stage(b);
  });
  live.erase(std::unique(live.begin(), live.end(),
                         [](const Live& a, const Live& b) { return a.address == b.address; }),
             live.end());
  auto block_info = [](const Live& l) {
    cda::BlockInfo b;
    b.size = l.block.block_bytes;
    b.requested_size = l.block.size;
    b.allocated = !l.pool_free && !l.held;
    b.active = !l.pool_free;
    b.context_when_allocated = std::static_pointer_cast<c10::GatheredContext>(l.block.context);
    return b;
  };
  // One segment per unit of the pool (a cudaMalloc segment, a mapped run of virtual memory,
  // a sleep tag's run: SegmentUnits), the units PyTorch's SEGMENT_ALLOC and SEGMENT_FREE
  // name, so that what NCCL registers from a snapshot is what a SEGMENT_FREE deregisters.
  // Cut further where the owner changes: a private pool's live blocks lie among the shared
  // tiers' ranges, and PyTorch reads a segment's pool (segment_pool_id) to find them. Free
  // ranges and blocks vram keeps cached are the shared pool's; a private pool's free blocks
  // are that pool's, each a segment of its own. A live block that spans two runs of virtual
  // memory is cut at the run's end; its part in the later run is the shared pool's (a graph
  // tree counts the block once, where it begins).
  for_each_state(-1, [&](DeviceState& state) {
    const int device = state.device;
    std::vector<vram::DevicePoolSegment> map = state.pool.memory_map();
    std::sort(map.begin(), map.end(),
              [](const vram::DevicePoolSegment& a, const vram::DevicePoolSegment& b) {
                return a.address < b.address;
              });
    // The large tier's units; a sleep tag's (in no segment of the map) count as large.
    auto is_large = [&map](std::uintptr_t address) {
      auto after = std::upper_bound(map.begin(), map.end(), address,
                                    [](std::uintptr_t a, const vram::DevicePoolSegment& segment) {
                                      return a < segment.address;
                                    });
      if (after == map.begin()) return true;
      const vram::DevicePoolSegment& segment = *std::prev(after);
      return address >= segment.address + segment.bytes || segment.large;
    };
    for (const SegmentUnits::Unit& unit : state.units->units()) {
      const std::uintptr_t end = unit.address + unit.bytes;
      const bool large = is_large(unit.address);
      cda::SegmentInfo* open = nullptr;
      bool open_free = false;  // `open` holds a private pool's free block
      auto add = [&](cda::BlockInfo block, std::uintptr_t address, LiveBlock::PoolId pool,
                     const Live* live_block, std::size_t requested) {
        const c10::MempoolId_t owner{static_cast<c10::CaptureId_t>(pool.first),
                                     static_cast<c10::CaptureId_t>(pool.second)};
        // A private pool's free block is a segment of its own: blocks freed or taken again
        // beside it leave the pool's other segments as they were (PyTorch's graph trees
        // compare a pool's segments before and after a checkpoint's restore).
        const bool pool_free = live_block != nullptr && live_block->pool_free;
        if (open == nullptr || open->owner_private_pool_id != owner || pool_free || open_free) {
          open_free = pool_free;
          open = &info.segments.emplace_back();
          open->device = static_cast<c10::DeviceIndex>(device);
          open->registration_counter = unit.order;
          open->address = address;
          open->is_large = large;
          open->is_expandable = unit.virtual_memory;
          open->owner_private_pool_id = owner;
        }
        open->total_size += block.size;
        if (live_block != nullptr) {
          open->stream = live_block->block.stream;  // the stream it was allocated on
          if (!pool_free) {
            if (!live_block->held) open->allocated_size += block.size;
            open->active_size += block.size;
            open->requested_size += requested;
          }
        }
        open->blocks.push_back(std::move(block));
      };
      auto next = std::lower_bound(
          live.begin(), live.end(), unit.address,
          [](const Live& l, std::uintptr_t address) { return l.address < address; });
      std::uintptr_t at = unit.address;
      if (next != live.begin()) {  // a block begun in the run before may reach into this one
        const Live& before = *std::prev(next);
        const std::uintptr_t before_end = before.address + before.block.block_bytes;
        if (before.block.device == device && !before.block.uncached && !before.block.foreign &&
            before_end > at) {
          const std::size_t bytes = std::min(before_end, end) - at;
          // The requested bytes that lie in this piece (memory_viz walks a block's
          // requested bytes inside its segment).
          const std::size_t offset = at - before.address;
          const std::size_t requested =
              before.block.size > offset ? std::min(before.block.size - offset, bytes) : 0;
          cda::BlockInfo part = block_info(before);
          part.size = bytes;
          part.requested_size =
              before.pool_free ? freed_requests_.last_in(device, at, at + bytes) : requested;
          // A live block's later piece is the shared pool's (counted once, where it begins);
          // a pool's free block stays its pool's.
          add(std::move(part), at, before.pool_free ? before.block.pool : LiveBlock::PoolId{0, 0},
              &before, requested);
          at += bytes;
        }
      }
      for (; next != live.end() && next->address < end; ++next) {
        // A MemPool's own allocator's block is listed in that pool's segment (below), also
        // when the allocator is vram's C interface and the segment lies in this unit.
        if (next->block.device != device || next->block.foreign || next->address < at) continue;
        if (next->address > at) {
          cda::BlockInfo gap;
          gap.size = next->address - at;
          gap.requested_size = freed_requests_.last_in(device, at, next->address);
          add(std::move(gap), at, {0, 0}, nullptr, 0);
        }
        const std::uintptr_t block_end = std::min(next->address + next->block.block_bytes, end);
        cda::BlockInfo block = block_info(*next);
        block.size = block_end - next->address;
        // Cut at the run's end: only the requested bytes of this piece (the rest: the tail's).
        const std::size_t requested = std::min(next->block.size, block.size);
        block.requested_size =
            next->pool_free ? freed_requests_.last_in(device, next->address, block_end) : requested;
        add(std::move(block), next->address, next->block.pool, &*next, requested);
        at = block_end;
      }
      if (at < end) {
        cda::BlockInfo rest;
        rest.size = end - at;
        rest.requested_size = freed_requests_.last_in(device, at, end);
        add(std::move(rest), at, {0, 0}, nullptr, 0);
      }
    }
    // The segments of MemPools' own allocators, each the pool's (PyTorch's private pools).
    for (const auto& foreign : state.graphs.foreign_pools()) {
      const c10::MempoolId_t owner{static_cast<c10::CaptureId_t>(foreign->id().first),
                                   static_cast<c10::CaptureId_t>(foreign->id().second)};
      for (const ForeignPool::SegmentView& view : foreign->segments()) {
        cda::SegmentInfo& segment = info.segments.emplace_back();
        segment.device = static_cast<c10::DeviceIndex>(device);
        segment.address = view.address;
        segment.total_size = view.bytes;
        segment.stream = view.stream;
        segment.is_large = view.large;
        segment.owner_private_pool_id = owner;
        segment.registration_counter =
            static_cast<decltype(segment.registration_counter)>(view.order);
        for (const ForeignPool::BlockView& b : view.blocks) {
          cda::BlockInfo block;
          block.size = b.bytes;
          block.requested_size = b.requested;
          if (b.live) {
            // A block of the pool that no tensor holds in the list read above: held back for
            // its recorded streams, or between its pool and its tensor as the two were read.
            // Shown active, not allocated (PyTorch's "active_pending_free").
            const auto found = std::lower_bound(
                live.begin(), live.end(), b.address,
                [](const Live& l, std::uintptr_t address) { return l.address < address; });
            const bool allocated = found != live.end() && found->address == b.address &&
                                   !found->pool_free && !found->held;
            block.allocated = allocated;
            block.active = true;
            segment.active_size += b.bytes;
            segment.requested_size += b.requested;
            if (allocated) {
              segment.allocated_size += b.bytes;
              block.context_when_allocated =
                  std::static_pointer_cast<c10::GatheredContext>(found->block.context);
            }
          }
          segment.blocks.push_back(std::move(block));
        }
      }
    }
  });
  std::sort(info.segments.begin(), info.segments.end(),
            [](const cda::SegmentInfo& a, const cda::SegmentInfo& b) {
              return a.device != b.device ? a.device < b.device : a.address < b.address;
            });
  if (wanted != LiveBlock::PoolId{0, 0}) {  // only that pool's segments
    std::erase_if(info.segments,
                  [&](const cda::SegmentInfo& s) { return s.owner_private_pool_id != mempool_id; });
  }
  if (include_traces) {
    info.device_traces = history_.traces();
    info.device_traces.resize(static_cast<std::size_t>(std::max(device_count_, 1)));
    info.external_annotations = history_.annotations();
  }
  info.config_metadata.last_allocator_settings = "vram";
  info.config_metadata.max_split_size = std::numeric_limits<std::size_t>::max();
  if (DeviceState* state = find_state(0)) {
    info.config_metadata.expandable_segments = state->pool.uses_virtual_memory();
  }
  return info;
}

void* NativeAllocator::open_shared_segment(const std::string& handle, int device) {
  return open_shared(handle.data(), device);
}

}  // namespace

int install_native_allocator() noexcept {
  // One installation at a time: two callers racing would both change PyTorch's allocator.
  static std::mutex installing;
  try {
    const std::lock_guard lock(installing);
    auto& allocator = installed();
    if (allocator) return 1;
    auto made = std::make_shared<NativeAllocator>();
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(made);
    // torch.accelerator's memory calls read the allocator registered for CUDA in c10's
    // table, which changeCurrentAllocator leaves at PyTorch's own.
    c10::SetAllocator(c10::DeviceType::CUDA, made.get());
    allocator = std::move(made);
    set_segment_listener(&on_segment);
    return 1;
  } catch (const std::exception& e) {
    note_error_built(
        [&] { return std::string("cannot install vram as PyTorch's CUDA allocator: ") + e.what(); },
        false);
    return -1;
  }
}

}  // namespace vram_torch
