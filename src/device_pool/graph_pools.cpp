#include "graph_pools.hpp"

#include <algorithm>

namespace vram::detail {

void GraphPools::retain(Id id, Use use) {
  std::lock_guard lock(mutex_);
  auto [it, made] = by_id_.try_emplace(id);
  ++it->second.uses;
  if (use == Use::scope) ++it->second.scope_uses;
  if (made) note_pools();
}

void GraphPools::retain_once(Id id) {
  std::lock_guard lock(mutex_);
  if (closed_.load(std::memory_order_relaxed)) return;
  auto [it, made] = by_id_.try_emplace(id);
  if (it->second.uses == 0) ++it->second.uses;
  if (made) note_pools();
}

bool GraphPools::release(Id id, Use use) {
  std::lock_guard lock(mutex_);
  auto it = by_id_.find(id);
  const bool scope = use == Use::scope;
  if (it == by_id_.end() ||
      (scope ? it->second.scope_uses == 0 : it->second.uses == it->second.scope_uses)) {
    ++double_frees_;
    return false;
  }
  --it->second.uses;
  if (scope) --it->second.scope_uses;
  retire_if_unused(id);
  return true;
}

GraphPools::Block GraphPools::take(Id id, std::size_t bytes,
                                   const std::function<bool(const void*)>& accept) {
  std::lock_guard lock(mutex_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.uses == 0) return {};
  Pool& pool = it->second;
  auto fit = pool.free.lower_bound(bytes);
  if (accept) {
    while (fit != pool.free.end() && fit->first - bytes <= bytes / 4 && !accept(fit->second)) ++fit;
  }
  if (fit == pool.free.end() || fit->first - bytes > bytes / 4) return {};
  const Block block{fit->second, fit->first};
  pool.free.erase(fit);
  Owner& owner = owner_.at(block.pointer);
  owner.live = true;
  ++pool.live_blocks;
  pool.live_bytes += block.bytes;
  return block;
}

bool GraphPools::adopt(Id id, Block block) {
  std::lock_guard lock(mutex_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.uses == 0) return false;
  if (!owner_.try_emplace(block.pointer, Owner{id, block.bytes, true}).second) return false;
  filter_[slot_of(block.pointer)].fetch_add(1, std::memory_order_relaxed);
  Pool& pool = it->second;
  ++pool.live_blocks;
  pool.held_bytes += block.bytes;
  pool.live_bytes += block.bytes;
  return true;
}

GraphPools::Deallocation GraphPools::deallocate(void* pointer) {
  std::lock_guard lock(mutex_);
  auto found = owner_.find(pointer);
  if (found == owner_.end()) return Deallocation::not_ours;
  Owner& owner = found->second;
  if (!owner.live) {
    ++double_frees_;
    return Deallocation::double_free;
  }
  Pool& pool = by_id_.at(owner.pool);
  pool.free.emplace(owner.bytes, pointer);  // first: it may throw, and nothing changed yet
  owner.live = false;
  --pool.live_blocks;
  pool.live_bytes -= owner.bytes;
  retire_if_unused(owner.pool);
  return Deallocation::returned;
}

std::size_t GraphPools::claim(Id id, const void* pointer) {
  std::lock_guard lock(mutex_);
  const auto found = owner_.find(pointer);
  if (found == owner_.end() || found->second.live || found->second.pool != id) return 0;
  Owner& owner = found->second;
  Pool& pool = by_id_.at(id);
  auto [first, last] = pool.free.equal_range(owner.bytes);
  const auto it =
      std::find_if(first, last, [&](const auto& entry) { return entry.second == pointer; });
  if (it == last) return 0;
  pool.free.erase(it);
  owner.live = true;
  ++pool.live_blocks;
  pool.live_bytes += owner.bytes;
  return owner.bytes;
}

std::vector<GraphPools::Block> GraphPools::free_blocks(Id id) const {
  std::vector<Block> blocks;
  std::lock_guard lock(mutex_);
  const auto found = by_id_.find(id);
  if (found == by_id_.end()) return blocks;
  blocks.reserve(found->second.free.size());
  for (const auto& [bytes, pointer] : found->second.free) blocks.push_back({pointer, bytes});
  std::sort(blocks.begin(), blocks.end(),
            [](const Block& a, const Block& b) { return std::less<>{}(a.pointer, b.pointer); });
  return blocks;
}

void GraphPools::restore_pending(std::vector<Block> blocks) noexcept {
  std::lock_guard lock(mutex_);
  try {
    pending_.reserve(pending_.size() + blocks.size());
  } catch (...) {
    return;  // leaked, which is safe: a launch of the graph may still use them
  }
  for (const Block& block : blocks) {
    try {
      owner_.try_emplace(block.pointer, Owner{kPending, block.bytes, false});
    } catch (...) {
      continue;  // leaked, which is safe (as above)
    }
    filter_[slot_of(block.pointer)].fetch_add(1, std::memory_order_relaxed);
    pending_.push_back(block);
    pending_bytes_ += block.bytes;
  }
}

std::vector<GraphPools::Block> GraphPools::take_pending() {
  std::lock_guard lock(mutex_);
  pending_bytes_ = 0;
  std::vector<Block> taken = std::exchange(pending_, {});
  for (const Block& block : taken) {
    owner_.erase(block.pointer);
    filter_[slot_of(block.pointer)].fetch_sub(1, std::memory_order_relaxed);
  }
  return taken;
}

void GraphPools::close() {
  std::lock_guard lock(mutex_);
  closed_.store(true, std::memory_order_release);
  std::vector<Id> ids;
  ids.reserve(by_id_.size());
  for (auto& [id, pool] : by_id_) {
    pool.uses = 0;
    pool.scope_uses = 0;
    ids.push_back(id);
  }
  for (const Id id : ids) {
    free_to_pending(by_id_.at(id));
    retire_if_unused(id);
  }
}

std::size_t GraphPools::live_bytes_of(const void* pointer) const {
  std::lock_guard lock(mutex_);
  const auto found = owner_.find(pointer);
  return found != owner_.end() && found->second.live ? found->second.bytes : 0;
}

void GraphPools::retire_if_unused(Id id) {
  auto it = by_id_.find(id);
  Pool& pool = it->second;
  if (pool.uses != 0 || pool.live_blocks != 0) return;
  free_to_pending(pool);
  by_id_.erase(it);
  note_pools();
}

void GraphPools::free_to_pending(Pool& pool) {
  pending_.reserve(pending_.size() + pool.free.size());
  for (const auto& [bytes, pointer] : pool.free) {
    pending_.push_back({pointer, bytes});
    pending_bytes_ += bytes;
    pool.held_bytes -= bytes;
    // Known until taken: a free of a pending block is a double free, never a block of the
    // tiers (take_pending forgets it).
    Owner& owner = owner_.at(pointer);
    owner.pool = kPending;
    owner.live = false;
  }
  pool.free.clear();
}

void GraphPools::note_pools() noexcept {
  const std::size_t before = std::exchange(counted_pools_, by_id_.size());
  if (routing_ != nullptr && before != by_id_.size()) {
    routing_->add(static_cast<std::ptrdiff_t>(by_id_.size()) - static_cast<std::ptrdiff_t>(before));
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
  s.held_bytes += pending_bytes_;
  s.blocks = owner_.size();  // pending ones included
  s.double_frees = double_frees_;
  return s;
}

}  // namespace vram::detail
