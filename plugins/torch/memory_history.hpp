// memory_history.hpp: torch.cuda.memory._record_memory_history over vram: the trace of
// allocation events in PyTorch's TraceEntry form, the stacks PyTorch's own recorder
// gathers, and the trace trackers and out-of-memory observers PyTorch attaches.
//
// Rules:
// - Nothing is recorded (and no stack gathered) unless history is on or a tracker is
//   attached; the warm path then pays one relaxed load (wanted()).
// - Stacks follow PyTorch's RecordContext: STATE keeps the allocation's stack with the live
//   block; ALLOC also puts it in the trace's alloc entries; ALL also gathers one at frees.
// - The trace of each device keeps the last `max_entries` events (a ring); clearing the
//   history empties it.
// - Trackers and observers run on the allocating thread, outside this file's mutex, in the
//   order they were attached; they are never detached (as in PyTorch). Segment events run
//   them on the thread that grows or gives back, inside the pool (record_noexcept).
// Thread safety: one mutex for the trace and the settings; wanted() is a relaxed load.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace vram_torch {

class MemoryHistory {
 public:
  using TraceEntry = c10::CachingDeviceAllocator::TraceEntry;
  using Context = std::shared_ptr<c10::GatheredContext>;

  void record_history(bool enabled, c10::CachingDeviceAllocator::CreateContextFn recorder,
                      std::size_t max_entries, c10::CachingDeviceAllocator::RecordContext when,
                      bool clear, const std::vector<std::string>& skip_actions);
  bool enabled() const noexcept { return enabled_.load(std::memory_order_relaxed); }
  // History on or a tracker attached: events must be built.
  bool wanted() const noexcept { return wanted_.load(std::memory_order_relaxed); }

  // The stack to keep with a new block (null unless history keeps stacks).
  Context context_for_allocation() const;
  // The stack of a free for the trace (null unless RecordContext::ALL).
  Context context_for_free() const;

  // Appends `entry` to its device's trace (when history is on) and gives it to the trackers.
  void record(TraceEntry entry);
  // record() for the pool's segment events, which run where nothing may throw: an exception
  // of one tracker (NCCL's deregistration hook checks its own books) is noted and the
  // trackers after it still run.
  void record_noexcept(TraceEntry entry) noexcept;

  void attach_tracker(c10::CachingDeviceAllocator::AllocatorTraceTracker tracker);
  void attach_oom_observer(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer);
  void notify_oom(int device, std::size_t allocated, std::size_t total, std::size_t free) const;

  // The traces, oldest event first, one vector per device (up to the highest device seen).
  std::vector<std::vector<TraceEntry>> traces() const;
  void annotate(const std::vector<std::pair<std::string, std::string>>& metadata, int device);
  std::vector<c10::CachingDeviceAllocator::AnnotationEntry> annotations() const;
  void push_compile_context(std::string context);
  void pop_compile_context();
  std::string compile_context() const;
  void set_user_metadata(std::string metadata);
  std::string user_metadata() const;

 private:
  struct Ring {
    std::vector<TraceEntry> entries;
    std::size_t next = 0;  // where the next entry goes once the ring is full
  };
  void update_wanted() noexcept;  // under mutex_
  void append(TraceEntry entry);  // to the device's ring, when history is on

  mutable std::mutex mutex_;
  std::atomic<bool> enabled_{false};
  std::atomic<bool> wanted_{false};
  c10::CachingDeviceAllocator::CreateContextFn recorder_ = nullptr;
  c10::CachingDeviceAllocator::RecordContext when_ =
      c10::CachingDeviceAllocator::RecordContext::NEVER;
  std::size_t max_entries_ = 0;
  std::vector<std::string> skip_actions_;
  std::vector<Ring> rings_;  // by device
  std::vector<c10::CachingDeviceAllocator::AnnotationEntry> annotations_;
  std::vector<std::string> compile_contexts_;
  std::string user_metadata_;
  // Attached once, never detached: read without the mutex below `count`.
  template <typename Fn>
  struct Callbacks {
    static constexpr std::size_t kMax = 16;
    std::array<Fn, kMax> fns;
    std::atomic<std::size_t> count{0};
    void add(Fn fn);  // under mutex_
  };
  Callbacks<c10::CachingDeviceAllocator::AllocatorTraceTracker> trackers_;
  Callbacks<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> observers_;
};

}  // namespace vram_torch
