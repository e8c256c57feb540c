#include "replay/replay.hpp"

#include <algorithm>
#include <chrono>
#include <deque>
#include <exception>
#include <memory>
#include <optional>
#include <vector>

#include "vram/cuda/error.hpp"
#include "vram/cuda/stream.hpp"

namespace vram::replay {
namespace {

// A free the driver holds back until its stream's work at the free has completed.
struct HeldFree {
  std::uint32_t slot;
  std::size_t bytes;
  ReplayStream stream;
  std::size_t ready_at;  // host-only: event index of the emulated completion
  cudaEvent_t event;     // device: recorded on the stream at the free
};

class Driver {
 public:
  Driver(const Trace& trace, ReplayAllocator& allocator, const ReplayOptions& options)
      : trace_(trace), allocator_(allocator), options_(options), blocks_(trace.slots, nullptr) {
    if (options.device) {
      for (std::size_t i = 0; i < trace.streams.size(); ++i) {
        streams_.push_back(std::make_unique<cuda::Stream>());
      }
    }
    hold_back_ = !allocator.stream_ordered() && trace.streams.size() > 1;
  }

  ~Driver() {
    // Untimed cleanup; never throws (a failed allocator may be in a bad state).
    try {
      drain(0, true);
      for (std::size_t slot = 0; slot < blocks_.size(); ++slot) {
        if (blocks_[slot] != nullptr) {
          allocator_.deallocate(blocks_[slot], sizes_of_live_[slot], stream_of_live_[slot]);
        }
      }
      allocator_.synchronize();
    } catch (const std::exception&) {
    }
    for (cudaEvent_t event : spare_events_) (void)cudaEventDestroy(event);
  }

  ReplayResult run() {
    ReplayResult result;
    result.trace = trace_.name;
    result.peak_live_bytes = trace_.peak_live_bytes;
    sizes_of_live_.assign(trace_.slots, 0);
    stream_of_live_.assign(trace_.slots, ReplayStream{});
    const std::size_t passes = std::max<std::size_t>(options_.passes, 1);
    for (std::size_t pass = 1; pass <= passes; ++pass) {
      const std::optional<std::uint64_t> upstream_before = allocator_.upstream_allocations();
      // One pass keeps the replay as it always was: leftovers are freed untimed (~Driver).
      const bool free_leftovers = passes > 1;
      const auto start = std::chrono::steady_clock::now();
      const std::size_t done = run_pass(result, free_leftovers, pass == 1);
      allocator_.synchronize();
      const double elapsed =
          std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start)
              .count();
      const std::optional<std::uint64_t> upstream_after = allocator_.upstream_allocations();
      result.pass_ns_per_op.push_back(done == 0 ? 0.0 : elapsed / static_cast<double>(done));
      result.pass_operations.push_back(done);
      result.pass_upstream_allocations.push_back(
          upstream_before && upstream_after
              ? std::optional<std::uint64_t>(*upstream_after - *upstream_before)
              : std::nullopt);
      result.operations += done;
      if (result.failed_at) {
        result.failed_pass = pass;
        break;
      }
    }
    result.ns_per_op = result.pass_ns_per_op.front();
    // Warm figures from the passes after the first that completed (a failing pass is cut
    // short and timed with its retry: not a warm figure).
    const std::size_t complete =
        result.failed_pass ? *result.failed_pass - 1 : result.pass_ns_per_op.size();
    if (complete >= 2) {
      std::vector<double> warm(
          result.pass_ns_per_op.begin() + 1,
          result.pass_ns_per_op.begin() + static_cast<std::ptrdiff_t>(complete));
      std::sort(warm.begin(), warm.end());
      result.warm_ns_per_op = warm[warm.size() / 2];
      std::uint64_t upstream = 0;
      bool known = true;
      for (std::size_t p = 1; p < complete; ++p) {
        const auto& delta = result.pass_upstream_allocations[p];
        known = known && delta.has_value();
        if (delta) upstream += *delta;
      }
      if (known) result.warm_upstream_allocations = upstream;
    }
    result.peak_reserved_bytes = allocator_.peak_reserved_bytes();
    result.upstream_allocations = allocator_.upstream_allocations();
    result.device_synchronizes = allocator_.device_synchronizes();
    result.held_back_frees = held_total_;
    result.held_back_peak = held_peak_;
    return result;
  }

 private:
  // One pass over the trace; returns the operations it ran. Starts with no live block and
  // nothing held back; when `free_leftovers`, ends the same way (every block the trace
  // left live freed in slot order on its stream, every held-back free deallocated).
  std::size_t run_pass(ReplayResult& result, bool free_leftovers, bool first_pass) {
    std::size_t done = 0;
    const std::size_t count = trace_.events.size();
    const std::size_t sample_every =
        first_pass && options_.samples > 0 ? std::max<std::size_t>(1, count / options_.samples) : 0;
    std::size_t live = 0;
    for (; done < count; ++done) {
      const TraceEvent& event = trace_.events[done];
      if (sample_every != 0) {
        live = event.allocate ? live + event.bytes : live - sizes_of_live_[event.slot];
      }
      const ReplayStream stream = stream_for(event.stream_index);
      if (event.allocate) {
        if (hold_back_) drain(done, false);
        void* block = nullptr;
        try {
          block = allocator_.allocate(event.bytes, stream);
        } catch (const std::exception& first) {
          if (!held_.empty()) {
            drain(done, true);  // wait for the held-back frees, then try once more
            try {
              block = allocator_.allocate(event.bytes, stream);
            } catch (const std::exception& second) {
              fail(result, event, second.what());
              return done;
            }
          } else {
            fail(result, event, first.what());
            return done;
          }
        }
        blocks_[event.slot] = block;
        sizes_of_live_[event.slot] = event.bytes;
        stream_of_live_[event.slot] = stream;
      } else {
        free_slot(event.slot, stream, done);
      }
      if (sample_every != 0 && (done % sample_every == 0 || done + 1 == count)) {
        result.samples.push_back({done, live, allocator_.reserved_bytes()});
      }
    }
    if (free_leftovers) {
      for (std::uint32_t slot = 0; slot < blocks_.size(); ++slot) {
        if (blocks_[slot] == nullptr) continue;
        free_slot(slot, stream_of_live_[slot], done);
        ++done;
      }
      drain(done, true);  // the next pass starts with nothing held back (its index restarts)
    }
    return done;
  }

  // Frees the live block of `slot` on `stream` (the trace's free's stream; a leftover's
  // own) at operation `index`: at once, or held back for stream order (stream-unaware
  // allocator on a multi-stream trace). The size is the allocation's (the trace's free
  // carries the same).
  void free_slot(std::uint32_t slot, ReplayStream stream, std::size_t index) {
    void* block = blocks_[slot];
    blocks_[slot] = nullptr;
    if (hold_back_) {
      hold(slot, block, stream, index);
    } else {
      allocator_.deallocate(block, sizes_of_live_[slot], stream);
    }
  }

  ReplayStream stream_for(std::uint32_t index) const {
    return ReplayStream{index, streams_.empty() ? nullptr : streams_[index]->get()};
  }

  void fail(ReplayResult& result, const TraceEvent& event, const char* what) {
    result.failed_at = event.row;
    result.failed_line = event.line;
    result.failure = what;
  }

  void hold(std::uint32_t slot, void* block, ReplayStream stream, std::size_t index) {
    HeldFree held{slot, sizes_of_live_[slot], stream, index + options_.stream_lag, nullptr};
    if (options_.device) {
      if (spare_events_.empty()) {
        cudaEvent_t created = nullptr;
        cuda::check(cudaEventCreateWithFlags(&created, cudaEventDisableTiming),
                    "cudaEventCreateWithFlags");
        spare_events_.push_back(created);
      }
      held.event = spare_events_.back();
      spare_events_.pop_back();
      cuda::check(cudaEventRecord(held.event, stream.handle), "cudaEventRecord");
    }
    held_blocks_.push_back(block);
    held_.push_back(held);
    ++held_total_;
    held_peak_ = std::max(held_peak_, held_.size());
  }

  // Deallocates held-back frees whose stream work has completed, oldest first; all of
  // them (waiting on the device) when `force`.
  void drain(std::size_t index, bool force) {
    while (!held_.empty()) {
      HeldFree& front = held_.front();
      if (options_.device) {
        if (force) {
          cuda::check(cudaEventSynchronize(front.event), "cudaEventSynchronize");
        } else {
          const cudaError_t state = cudaEventQuery(front.event);
          if (state == cudaErrorNotReady) break;
          cuda::check(state, "cudaEventQuery");
        }
        spare_events_.push_back(front.event);
      } else if (!force && front.ready_at > index) {
        break;
      }
      allocator_.deallocate(held_blocks_.front(), front.bytes, front.stream);
      held_.pop_front();
      held_blocks_.pop_front();
    }
  }

  const Trace& trace_;
  ReplayAllocator& allocator_;
  const ReplayOptions& options_;
  std::vector<void*> blocks_;  // by slot: the live block of that allocation, or null
  std::vector<std::size_t> sizes_of_live_;
  std::vector<ReplayStream> stream_of_live_;
  std::vector<std::unique_ptr<cuda::Stream>> streams_;
  bool hold_back_ = false;
  std::deque<HeldFree> held_;
  std::deque<void*> held_blocks_;
  std::vector<cudaEvent_t> spare_events_;
  std::size_t held_total_ = 0;
  std::size_t held_peak_ = 0;
};

}  // namespace

ReplayResult replay_trace(const Trace& trace, const AllocatorSpec& spec,
                          const ReplayOptions& options) {
  ReplayContext context;
  context.device = options.device;
  context.device_id = options.device_id;
  context.capacity_bytes = options.capacity_bytes;
  std::unique_ptr<ReplayAllocator> allocator = spec.make(context);
  ReplayResult result;
  {
    Driver driver(trace, *allocator, options);
    result = driver.run();
  }
  result.allocator = spec.name;
  return result;
}

std::optional<std::size_t> min_capacity(const Trace& trace, const AllocatorSpec& spec,
                                        const ReplayOptions& options,
                                        std::size_t unbounded_peak_reserved) {
  auto survives = [&](std::size_t capacity) {
    ReplayOptions bounded = options;
    bounded.capacity_bytes = capacity;
    bounded.passes = 1;
    return !replay_trace(trace, spec, bounded).failed_at.has_value();
  };
  constexpr std::size_t kStep = 256;
  auto round_up = [](std::size_t bytes) { return (bytes + kStep - 1) / kStep * kStep; };
  // Below the trace's peak live bytes nothing can survive: that is the failing bound.
  std::size_t fails = trace.peak_live_bytes == 0 ? 0 : trace.peak_live_bytes - 1;
  std::size_t holds = round_up(std::max(unbounded_peak_reserved, trace.peak_live_bytes));
  int widen = 0;
  while (!survives(holds)) {
    if (++widen > 4 || holds > SIZE_MAX / 4) return std::nullopt;
    fails = holds;
    holds *= 2;
  }
  while (holds - fails > std::max<std::size_t>(4096, holds / 1000)) {
    const std::size_t mid = round_up(fails + (holds - fails) / 2);
    if (mid >= holds) break;
    if (survives(mid)) {
      holds = mid;
    } else {
      fails = mid;
    }
  }
  return holds;
}

}  // namespace vram::replay
