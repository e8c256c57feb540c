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
  std::shared_ptr<DevicePoolCore> last;  // destroyed after the lock: may destroy *this
  std::lock_guard lock(slow_path);
  slow_path.count_deallocation(block_bytes);
  if (options.track_peak_in_use) note_in_use(-static_cast<std::int64_t>(block_bytes));
  if (orphan.active()) last = orphan.block_returned();
}

void* DevicePoolCore::graph_tag_allocate(Tag& tag, std::size_t bytes, std::size_t alignment,
                                         StreamKey key, std::optional<GraphPools::Id> graph) {
  void* block = tag_allocate(tag, bytes, alignment, key);
  if (!graph) return block;
  try {
    graph_holds.note(*graph, block);
  } catch (...) {
    tag_deallocate(tag, block, bytes, key);
    throw;
  }
  return block;
}

void DevicePoolCore::deallocate_tagged(Tag& tag, void* block, std::size_t bytes, StreamKey key,
                                       std::optional<GraphPools::Id> route) noexcept {
  switch (graph_holds.hold(route, block, bytes)) {
    case GraphHolds::Hold::held:
      return;
    case GraphHolds::Hold::double_free:
      return reject_deallocate(block, bytes,
                               "a tagged block held for its CUDA graph (until "
                               "release_graph_pool) was deallocated again");
    case GraphHolds::Hold::not_a_graphs:
    case GraphHolds::Hold::no_memory:  // given back: no host memory to hold it
      return tag_deallocate(tag, block, bytes, key);
  }
}

void DevicePoolCore::release_graph_holds(GraphPools::Id id) noexcept {
  const std::vector<GraphHolds::Held> released = graph_holds.take(id, graph_routing);
  if (released.empty()) return;
  quiescer.quiesce();  // the graph's last launch may still run
  for (const GraphHolds::Held& held : released) {
    if (Tag* tag = sleep_tags.owner_of(held.block)) {
      tag_deallocate(*tag, held.block, held.bytes, kUntagged);
    }
  }
}

}  // namespace detail

DevicePool::TagScope::TagScope(TagScope&& other) noexcept
    : core_(std::move(other.core_)),
      previous_tags_(other.previous_tags_),
      previous_index_(other.previous_index_) {}

DevicePool::TagScope& DevicePool::TagScope::operator=(TagScope&& other) noexcept {
  if (this != &other) {
    end();
    core_ = std::move(other.core_);
    previous_tags_ = other.previous_tags_;
    previous_index_ = other.previous_index_;
  }
  return *this;
}

void DevicePool::TagScope::end() noexcept {
  if (!core_) return;
  detail::tl_tag_route = {previous_tags_, previous_index_};
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
  scope.previous_tags_ = detail::tl_tag_route.tags;
  scope.previous_index_ = detail::tl_tag_route.index;
  scope.core_ = core_;
  detail::tl_tag_route = {&core.sleep_tags, tag.index};
  return scope;
}

void* DevicePool::allocate_tagged(std::size_t bytes, SleepTag tag, cudaStream_t stream) {
  detail::DevicePoolCore& core = live_core("allocate_tagged");
  detail::Tag& target = core.sleep_tags.tag_of(tag, "allocate_tagged");
  const detail::StreamKey key = stream == nullptr ? detail::kUntagged : detail::stream_key(stream);
  return core.tag_allocate(target, bytes, kDefaultAlignment, key);
}

void DevicePool::sleep(SleepTag tag, cudaStream_t stream, SleepContents contents) {
  detail::DevicePoolCore& core = live_core("sleep");
  core.sleep_tags.sleep(core.sleep_tags.tag_of(tag, "sleep"), stream, contents);
}

void DevicePool::wake(SleepTag tag, cudaStream_t stream) {
  detail::DevicePoolCore& core = live_core("wake");
  core.sleep_tags.wake(core.sleep_tags.tag_of(tag, "wake"), stream);
}

void DevicePool::sleep(const std::vector<SleepTag>& tags, cudaStream_t stream,
                       SleepContents contents) {
  detail::DevicePoolCore& core = live_core("sleep");
  for (SleepTag tag : tags) (void)core.sleep_tags.tag_of(tag, "sleep");
  for (SleepTag tag : tags) {
    core.sleep_tags.sleep(core.sleep_tags.tag_of(tag, "sleep"), stream, contents);
  }
}

void DevicePool::wake(const std::vector<SleepTag>& tags, cudaStream_t stream) {
  detail::DevicePoolCore& core = live_core("wake");
  for (SleepTag tag : tags) (void)core.sleep_tags.tag_of(tag, "wake");
  for (SleepTag tag : tags) core.sleep_tags.wake(core.sleep_tags.tag_of(tag, "wake"), stream);
}

SleepTagStats DevicePool::tag_stats(SleepTag tag) const {
  detail::DevicePoolCore& core = live_core("tag_stats");
  return core.sleep_tags.stats(core.sleep_tags.tag_of(tag, "tag_stats"));
}

}  // namespace vram
