#include "graph_pools.hpp"

namespace vram::detail {

void GraphPools::retain(Id id) {
  std::lock_guard lock(mutex_);
  auto [it, made] = by_id_.try_emplace(id);
  ++it->second.uses;
  if (made) note_pools();
}

std::vector<GraphPools::Block> GraphPools::release(Id id, bool* refused) {
  std::vector<Block> to_shared;
  std::lock_guard lock(mutex_);
  auto it = by_id_.find(id);
  if (refused != nullptr) *refused = false;
  if (it == by_id_.end() || it->second.uses == 0) {
    ++double_frees_;
    if (refused != nullptr) *refused = true;
    return to_shared;
  }
  --it->second.uses;
  retire_if_unused(id, to_shared);
  return to_shared;
}

GraphPools::Block GraphPools::take(Id id, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.uses == 0) return {};
  Pool& pool = it->second;
  const auto fit = pool.free.lower_bound(bytes);
  if (fit == pool.free.end() || fit->first - bytes > bytes / 4) return {};
  const Block block{fit->second, fit->first};
  pool.free.erase(fit);
  Owner& owner = owner_.at(block.pointer);
  owner.live = true;
  ++pool.live_blocks;
  pool.live_bytes += block.bytes;
  return block;
}

void GraphPools::adopt(Id id, Block block) {
  std::lock_guard lock(mutex_);
  auto [it, made] = by_id_.try_emplace(id);
  if (made) note_pools();
  const bool fresh = owner_.insert_or_assign(block.pointer, Owner{id, block.bytes, true}).second;
  if (fresh) filter_[slot_of(block.pointer)].fetch_add(1, std::memory_order_relaxed);
  Pool& pool = it->second;
  ++pool.live_blocks;
  pool.held_bytes += block.bytes;
  pool.live_bytes += block.bytes;
}

GraphPools::Release GraphPools::give_back(void* pointer, std::vector<Block>& to_shared) {
  if (empty()) return Release::not_ours;
  std::lock_guard lock(mutex_);
  auto found = owner_.find(pointer);
  if (found == owner_.end()) return Release::not_ours;
  Owner& owner = found->second;
  if (!owner.live) {
    ++double_frees_;
    return Release::double_free;
  }
  owner.live = false;
  Pool& pool = by_id_.at(owner.pool);
  --pool.live_blocks;
  pool.live_bytes -= owner.bytes;
  pool.free.emplace(owner.bytes, pointer);
  retire_if_unused(owner.pool, to_shared);
  return Release::returned;
}

std::size_t GraphPools::live_bytes_of(const void* pointer) const {
  if (empty()) return 0;
  std::lock_guard lock(mutex_);
  const auto found = owner_.find(pointer);
  return found != owner_.end() && found->second.live ? found->second.bytes : 0;
}

void GraphPools::retire_if_unused(Id id, std::vector<Block>& to_shared) {
  auto it = by_id_.find(id);
  Pool& pool = it->second;
  if (pool.uses != 0 || pool.live_blocks != 0) return;
  for (const auto& [bytes, pointer] : pool.free) {
    to_shared.push_back({pointer, bytes});
    owner_.erase(pointer);
    filter_[slot_of(pointer)].fetch_sub(1, std::memory_order_relaxed);
  }
  by_id_.erase(it);
  note_pools();
}

void GraphPools::note_pools() noexcept {
  const std::size_t before = pools_.exchange(by_id_.size(), std::memory_order_relaxed);
  if (activity_ != nullptr && before != by_id_.size()) {
    activity_->add(static_cast<std::ptrdiff_t>(by_id_.size()) -
                   static_cast<std::ptrdiff_t>(before));
  }
}

GraphPools::Stats GraphPools::stats() const {
  std::lock_guard lock(mutex_);
  Stats s;
  s.pools = by_id_.size();
  for (const auto& [id, pool] : by_id_) {
    s.held_bytes += pool.held_bytes;
    s.live_bytes += pool.live_bytes;
  }
  s.blocks = owner_.size();
  s.double_frees = double_frees_;
  return s;
}

std::vector<GraphPools::Block> GraphPools::take_all() {
  std::lock_guard lock(mutex_);
  std::vector<Block> all;
  all.reserve(owner_.size());
  for (const auto& [pointer, owner] : owner_) {
    all.push_back({const_cast<void*>(pointer), owner.bytes});
    filter_[slot_of(pointer)].fetch_sub(1, std::memory_order_relaxed);
  }
  owner_.clear();
  by_id_.clear();
  note_pools();
  return all;
}

}  // namespace vram::detail
