#include "memory_history.hpp"

#include <algorithm>
#include <exception>
#include <string>
#include <string_view>
#include <utility>

#include "errors.hpp"

namespace vram_torch {

namespace {

using c10::CachingDeviceAllocator::RecordContext;

std::string_view action_name(MemoryHistory::TraceEntry::Action action) noexcept {
  using Action = MemoryHistory::TraceEntry::Action;
  switch (action) {
    case Action::ALLOC:
      return "alloc";
    case Action::FREE_REQUESTED:
      return "free_requested";
    case Action::FREE_COMPLETED:
      return "free_completed";
    case Action::SEGMENT_ALLOC:
      return "segment_alloc";
    case Action::SEGMENT_FREE:
      return "segment_free";
    case Action::SEGMENT_MAP:
      return "segment_map";
    case Action::SEGMENT_UNMAP:
      return "segment_unmap";
    case Action::SNAPSHOT:
      return "snapshot";
    case Action::OOM:
      return "oom";
  }
  return "";
}

}  // namespace

template <typename Fn>
void MemoryHistory::Callbacks<Fn>::add(Fn fn) {
  const std::size_t n = count.load(std::memory_order_relaxed);
  TORCH_CHECK(n < kMax, "vram: at most ", kMax, " allocator callbacks of one kind can be attached");
  fns[n] = std::move(fn);
  count.store(n + 1, std::memory_order_release);
}

void MemoryHistory::record_history(bool enabled,
                                   c10::CachingDeviceAllocator::CreateContextFn recorder,
                                   std::size_t max_entries, RecordContext when, bool clear,
                                   const std::vector<std::string>& skip_actions) {
  std::lock_guard lock(mutex_);
  recorder_ = enabled ? recorder : nullptr;
  when_ = enabled ? when : RecordContext::NEVER;
  skip_actions_ = skip_actions;
  clear = clear || !enabled;  // as PyTorch: turning history off empties the trace
  if (clear || max_entries != max_entries_) {
    for (Ring& ring : rings_) {
      if (clear) {
        ring.entries.clear();
      } else {  // oldest first again, then the newest max_entries kept
        std::rotate(ring.entries.begin(),
                    ring.entries.begin() + static_cast<std::ptrdiff_t>(ring.next),
                    ring.entries.end());
        if (ring.entries.size() > max_entries) {
          ring.entries.erase(ring.entries.begin(),
                             ring.entries.end() - static_cast<std::ptrdiff_t>(max_entries));
        }
      }
      ring.next = 0;
    }
    if (clear) annotations_.clear();
  }
  max_entries_ = max_entries;
  enabled_.store(enabled, std::memory_order_relaxed);
  update_wanted();
}

void MemoryHistory::update_wanted() noexcept {
  wanted_.store(enabled_.load(std::memory_order_relaxed) ||
                    trackers_.count.load(std::memory_order_relaxed) != 0,
                std::memory_order_relaxed);
}

MemoryHistory::Context MemoryHistory::context_for_allocation() const {
  c10::CachingDeviceAllocator::CreateContextFn recorder = nullptr;
  {
    std::lock_guard lock(mutex_);
    if (when_ == RecordContext::NEVER) return nullptr;
    recorder = recorder_;
  }
  return recorder != nullptr ? recorder() : nullptr;
}

MemoryHistory::Context MemoryHistory::context_for_free() const {
  c10::CachingDeviceAllocator::CreateContextFn recorder = nullptr;
  {
    std::lock_guard lock(mutex_);
    if (when_ != RecordContext::ALL) return nullptr;
    recorder = recorder_;
  }
  return recorder != nullptr ? recorder() : nullptr;
}

void MemoryHistory::record(TraceEntry entry) {
  const std::size_t trackers = trackers_.count.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < trackers; ++i) trackers_.fns[i](entry);
  append(std::move(entry));
}

void MemoryHistory::append(TraceEntry entry) {
  if (!enabled()) return;
  std::lock_guard lock(mutex_);
  if (max_entries_ == 0 || entry.device_ < 0) return;
  // RecordContext::STATE keeps an allocation's stack with its block, not in the trace.
  if (when_ == RecordContext::STATE) entry.context_.reset();
  const std::string_view name = action_name(entry.action_);
  if (std::find(skip_actions_.begin(), skip_actions_.end(), name) != skip_actions_.end()) return;
  entry.compile_context_ = compile_contexts_.empty() ? "N/A" : compile_contexts_.back();
  if (!user_metadata_.empty()) entry.user_metadata_ = user_metadata_;
  const auto device = static_cast<std::size_t>(entry.device_);
  if (rings_.size() <= device) rings_.resize(device + 1);
  Ring& ring = rings_[device];
  if (ring.entries.size() < max_entries_) {
    ring.entries.push_back(std::move(entry));
  } else {
    ring.entries[ring.next] = std::move(entry);
    ring.next = (ring.next + 1) % max_entries_;
  }
}

void MemoryHistory::record_noexcept(TraceEntry entry) noexcept {
  const std::size_t trackers = trackers_.count.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < trackers; ++i) {
    try {
      trackers_.fns[i](entry);
    } catch (const std::exception& e) {
      note_error_built(
          [&] {
            return std::string("an allocator trace tracker failed on a segment event: ") + e.what();
          },
          false);
    } catch (...) {
      note_error("an allocator trace tracker failed on a segment event", false);
    }
  }
  try {
    append(std::move(entry));
  } catch (...) {
    note_error("memory history: a segment event could not be recorded", false);
  }
}

void MemoryHistory::attach_tracker(c10::CachingDeviceAllocator::AllocatorTraceTracker tracker) {
  std::lock_guard lock(mutex_);
  trackers_.add(std::move(tracker));
  update_wanted();
}

void MemoryHistory::attach_oom_observer(
    c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) {
  std::lock_guard lock(mutex_);
  observers_.add(std::move(observer));
}

void MemoryHistory::notify_oom(int device, std::size_t allocated, std::size_t total,
                               std::size_t free) const {
  const std::size_t n = observers_.count.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < n; ++i) observers_.fns[i](device, allocated, total, free);
}

std::vector<std::vector<MemoryHistory::TraceEntry>> MemoryHistory::traces() const {
  std::lock_guard lock(mutex_);
  std::vector<std::vector<TraceEntry>> out(rings_.size());
  for (std::size_t d = 0; d < rings_.size(); ++d) {
    const Ring& ring = rings_[d];
    out[d].reserve(ring.entries.size());
    for (std::size_t i = 0; i < ring.entries.size(); ++i) {
      out[d].push_back(ring.entries[(ring.next + i) % ring.entries.size()]);
    }
  }
  return out;
}

void MemoryHistory::annotate(const std::vector<std::pair<std::string, std::string>>& metadata,
                             int device) {
  if (!enabled()) return;
  c10::CachingDeviceAllocator::AnnotationEntry entry(static_cast<c10::DeviceIndex>(device),
                                                     c10::getApproximateTime());
  for (const auto& [name, value] : metadata) entry.recordUserMetadata(name, value);
  std::lock_guard lock(mutex_);
  annotations_.push_back(std::move(entry));
}

std::vector<c10::CachingDeviceAllocator::AnnotationEntry> MemoryHistory::annotations() const {
  std::lock_guard lock(mutex_);
  return annotations_;
}

void MemoryHistory::push_compile_context(std::string context) {
  std::lock_guard lock(mutex_);
  compile_contexts_.push_back(std::move(context));
}

void MemoryHistory::pop_compile_context() {
  std::lock_guard lock(mutex_);
  if (!compile_contexts_.empty()) compile_contexts_.pop_back();
}

std::string MemoryHistory::compile_context() const {
  std::lock_guard lock(mutex_);
  return compile_contexts_.empty() ? std::string() : compile_contexts_.back();
}

void MemoryHistory::set_user_metadata(std::string metadata) {
  std::lock_guard lock(mutex_);
  user_metadata_ = std::move(metadata);
}

std::string MemoryHistory::user_metadata() const {
  std::lock_guard lock(mutex_);
  return user_metadata_;
}

}  // namespace vram_torch
