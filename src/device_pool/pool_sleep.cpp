// DevicePool's sleep and wake (vram/sleep_tag.hpp): the public calls, tag scopes, and the
// core's tagged requests and deallocations.
#include <string>
#include <utility>

#include "pool_core.hpp"
#include "pool_options.hpp"
#include "vram/cuda/error.hpp"

namespace vram {
namespace detail {

void* DevicePoolCore::tag_allocate(Tag& tag, std::size_t bytes, std::size_t alignment,
                                   StreamKey key) {
  if (bytes == 0 || bytes > SizeClasses::kMaxBytes || alignment == 0 || alignment > kMaxAlignment ||
      (alignment & (alignment - 1)) != 0) {
    reject_request(bytes, alignment);
  }
  {
    std::lock_guard lock(slow_path);
    if (orphan.active()) {
      throw InvalidArgument(
          "vram::DevicePool::allocate: the pool was destroyed. Fix: keep the DevicePool alive "
          "while it is used.");
    }
  }
  void* block = sleep_tags.allocate(tag, bytes, key);
  const std::size_t block_bytes = TagArena::round(bytes);
  std::lock_guard lock(slow_path);
  slow_path.count_acquire(block_bytes);
  if (options.track_peak_in_use) note_in_use(static_cast<std::int64_t>(block_bytes));
  return block;
}

void DevicePoolCore::tag_deallocate(Tag& tag, void* block, std::size_t bytes,
                                    StreamKey key) noexcept {
  std::size_t block_bytes = 0;
  switch (SleepTags::free(tag, block, bytes, key, block_bytes)) {
    case SleepTags::Release::not_live:
      return reject_deallocate(block, bytes,
                               "no live block of its sleep tag at that address and size");
    case SleepTags::Release::asleep:
      return reject_deallocate(block, bytes,
                               "its sleep tag is asleep (the block stays live and is restored at "
                               "wake; release it after wake())");
    case SleepTags::Release::taken:
      break;
  }
  count_tag_deallocation(block_bytes);
}

void DevicePoolCore::count_tag_deallocation(std::size_t block_bytes) noexcept {
  std::shared_ptr<DevicePoolCore> last;  // destroyed after the lock: may destroy *this
  std::lock_guard lock(slow_path);
  slow_path.count_deallocation(block_bytes);
  if (options.track_peak_in_use) note_in_use(-static_cast<std::int64_t>(block_bytes));
  if (orphan.active()) last = orphan.block_returned();
}

void* DevicePoolCore::graph_tag_allocate(Tag& tag, std::size_t bytes, std::size_t alignment,
                                         StreamKey key, GraphPools::Id graph) {
  const bool valid = bytes != 0 && bytes <= SizeClasses::kMaxBytes && alignment != 0 &&
                     alignment <= kMaxAlignment && (alignment & (alignment - 1)) == 0;
  if (valid && !SleepTags::asleep(tag)) {
    // A free block of the pool that is this tag's (never another tag's or an untagged one).
    const GraphPools::Block reused =
        graph_pools.take(graph, TagArena::round(bytes),
                         [&](const void* p) { return sleep_tags.owner_of(p) == &tag; });
    if (reused.pointer != nullptr) return reused.pointer;
  }
  void* block = tag_allocate(tag, bytes, alignment, key);  // throws for bad requests, asleep
  try {
    if (graph_pools.adopt(graph, {block, TagArena::round(bytes)})) return block;
  } catch (...) {
    tag_deallocate(tag, block, bytes, key);
    throw;
  }
  return block;  // the pool lost its last use meanwhile: a plain tagged block
}

void DevicePoolCore::deallocate_tagged(Tag& tag, void* block, std::size_t bytes, StreamKey key,
                                       std::optional<GraphPools::Id> route) noexcept {
  if (graph_deallocate_owned(block)) return;  // a graph pool's block: back to its pool
  // Freed during a capture: captured work may use it at every launch, so it becomes a free
  // block of the capture's pool, if it is a live block of its tag of that size.
  if (route && sleep_tags.is_live(tag, block, bytes)) {
    try {
      if (is_unscoped_pool(*route)) retain_unscoped(*route);
    } catch (...) {
      return;  // no host memory for the bookkeeping: kept out of its tag (leaked), safe
    }
    if (graph_adopt_freed(*route, block, TagArena::round(bytes))) return;
  }
  tag_deallocate(tag, block, bytes, key);
}

bool DevicePoolCore::return_to_tag(Tag& tag, const GraphPools::Block& block) noexcept {
  std::size_t block_bytes = 0;
  switch (SleepTags::free(tag, block.pointer, block.bytes, kUntagged, block_bytes)) {
    case SleepTags::Release::asleep:
      return false;
    case SleepTags::Release::not_live:
      reject_deallocate(block.pointer, block.bytes, "a graph pool's block its tag does not know");
      return true;
    case SleepTags::Release::taken:
      break;
  }
  count_tag_deallocation(block_bytes);
  return true;
}

}  // namespace detail

DevicePool::TagScope::TagScope(TagScope&& other) noexcept
    : core_(std::move(other.core_)), entry_(std::exchange(other.entry_, nullptr)) {}

DevicePool::TagScope& DevicePool::TagScope::operator=(TagScope&& other) noexcept {
  if (this != &other) {
    end();
    core_ = std::move(other.core_);
    entry_ = std::exchange(other.entry_, nullptr);
  }
  return *this;
}

// Ending the entry reads no pool (routes name pools by uid): safe after the pool is gone.
void DevicePool::TagScope::end() noexcept {
  if (entry_ == nullptr) return;
  detail::end_tag_scope(std::exchange(entry_, nullptr));
  core_.reset();
}

SleepTag DevicePool::create_tag(std::string_view name, SleepTagOptions options) {
  detail::DevicePoolCore& core = live_core("create_tag");
  std::shared_ptr<VirtualMemory> memory = core.virtual_memory;
  if (!memory) memory = detail::make_tag_virtual_memory(*core.upstream);
  return core.sleep_tags.create(name, options, memory,
                                detail::reservation_for(core.options, *core.upstream),
                                core.options.large_tier.virtual_run_bytes, core.upstream->kind());
}

std::optional<SleepTag> DevicePool::find_tag(std::string_view name) const noexcept {
  if (!core_) return std::nullopt;
  return core_->sleep_tags.find(name);
}

std::vector<SleepTag> DevicePool::tags() const {
  if (!core_) return {};
  return core_->sleep_tags.all();
}

DevicePool::TagScope DevicePool::tag_scope(SleepTag tag) {
  detail::DevicePoolCore& core = live_core("tag_scope");
  (void)core.sleep_tags.tag_of(tag, "tag_scope");
  TagScope scope;
  scope.entry_ = detail::open_tag_scope(core.sleep_tags.pool_uid(), tag.index);
  scope.core_ = core_;
  return scope;
}

void* DevicePool::allocate_tagged(std::size_t bytes, SleepTag tag, cudaStream_t stream) {
  detail::DevicePoolCore& core = live_core("allocate_tagged");
  detail::Tag& target = core.sleep_tags.tag_of(tag, "allocate_tagged");
  const detail::StreamKey key = stream == nullptr ? detail::kUntagged : detail::stream_key(stream);
  return core.tag_allocate(target, bytes, kDefaultAlignment, key);
}

// A sleep first drains the graph pools' returns: blocks of graphs that are gone leave their
// tag before it is copied. A wake drains those that waited while their tag slept.
void DevicePool::sleep(SleepTag tag, cudaStream_t stream, SleepContents contents) {
  detail::DevicePoolCore& core = live_core("sleep");
  detail::Tag& target = core.sleep_tags.tag_of(tag, "sleep");
  core.drain_graph_returns();
  core.sleep_tags.sleep(target, stream, contents);
}

void DevicePool::wake(SleepTag tag, cudaStream_t stream) {
  detail::DevicePoolCore& core = live_core("wake");
  core.sleep_tags.wake(core.sleep_tags.tag_of(tag, "wake"), stream);
  core.drain_graph_returns();
}

void DevicePool::sleep(const std::vector<SleepTag>& tags, cudaStream_t stream,
                       SleepContents contents) {
  detail::DevicePoolCore& core = live_core("sleep");
  for (SleepTag tag : tags) (void)core.sleep_tags.tag_of(tag, "sleep");
  core.drain_graph_returns();
  for (SleepTag tag : tags) {
    core.sleep_tags.sleep(core.sleep_tags.tag_of(tag, "sleep"), stream, contents);
  }
}

void DevicePool::wake(const std::vector<SleepTag>& tags, cudaStream_t stream) {
  detail::DevicePoolCore& core = live_core("wake");
  for (SleepTag tag : tags) (void)core.sleep_tags.tag_of(tag, "wake");
  for (SleepTag tag : tags) core.sleep_tags.wake(core.sleep_tags.tag_of(tag, "wake"), stream);
  core.drain_graph_returns();
}

SleepTagStats DevicePool::tag_stats(SleepTag tag) const {
  detail::DevicePoolCore& core = live_core("tag_stats");
  return core.sleep_tags.stats(core.sleep_tags.tag_of(tag, "tag_stats"));
}

}  // namespace vram
