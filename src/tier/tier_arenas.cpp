#include "tier_arenas.hpp"

#include <algorithm>
#include <bit>
#include <thread>

namespace vram::detail {
namespace {

std::atomic<std::size_t> next_thread_slot{0};

}  // namespace

TierArenas::TierArenas(Upstream& upstream, StreamFence& fence, ReservedGauge& gauge,
                       SegmentTier::Options options, std::size_t count)
    : upstream_(upstream),
      fence_(fence),
      gauge_(gauge),
      options_(options),
      count_(std::bit_floor(std::clamp<std::size_t>(count, 1, kMaxArenas))) {
  arenas_[0].store(new SegmentTier(upstream_, fence_, gauge_, options_), std::memory_order_release);
  made_.store(1, std::memory_order_release);
}

TierArenas::~TierArenas() {
  for (auto& slot : arenas_) delete slot.load(std::memory_order_relaxed);
}

std::size_t TierArenas::count_for(std::size_t asked) noexcept {
  const std::size_t wanted = asked != 0 ? asked : std::thread::hardware_concurrency();
  return std::bit_floor(std::clamp<std::size_t>(wanted, 1, kMaxArenas));
}

std::size_t TierArenas::next_slot() noexcept {
  return next_thread_slot.fetch_add(1, std::memory_order_relaxed);
}

std::size_t TierArenas::first_home_index() const noexcept {
  const std::size_t slot = thread_slot();
  std::size_t first = kNoSlot;
  if (first_slot_.compare_exchange_strong(first, slot, std::memory_order_relaxed)) first = slot;
  return (slot - first) & (count_ - 1);
}

SegmentTier& TierArenas::make(std::size_t i) {
  std::lock_guard lock(make_mutex_);
  if (SegmentTier* tier = arenas_[i].load(std::memory_order_acquire)) return *tier;
  auto* tier = new SegmentTier(upstream_, fence_, gauge_, options_);
  arenas_[i].store(tier, std::memory_order_release);
  made_.fetch_add(1, std::memory_order_acq_rel);
  return *tier;
}

void* TierArenas::borrow(std::size_t bytes, StreamKey stream, LeaseOwner* owner, SegmentTier& own) {
  if (made() == 1) return nullptr;
  // From the next arena on, so that threads that borrow do not all knock at arena 0.
  const std::size_t start = home_index();
  for (std::size_t k = 1; k < count_; ++k) {
    SegmentTier* other = arena((start + k) & (count_ - 1));
    if (other == nullptr || other == &own) continue;
    if (void* block = other->try_allocate(bytes, stream, owner)) return block;
  }
  return nullptr;
}

void* TierArenas::allocate_anywhere(std::size_t bytes, StreamKey stream, LeaseOwner* owner) {
  SegmentTier& own = home();
  if (void* block = own.allocate(bytes, stream, /*may_grow=*/false, nullptr, owner)) return block;
  for (std::size_t i = 0; i < count_; ++i) {
    SegmentTier* other = arena(i);
    if (other == nullptr || other == &own) continue;
    if (void* block = other->allocate(bytes, stream, /*may_grow=*/false, nullptr, owner)) {
      return block;
    }
  }
  return nullptr;
}

SegmentTier::Freed TierArenas::free_keeping(void* block, StreamKey tag, std::size_t bytes,
                                            const LeaseOwner* by, SegmentTier*& holder) noexcept {
  holder = nullptr;
  // The home arena first: most blocks go back to the arena of the thread that freed them.
  SegmentTier* first = arena(0);
  if (made() > 1) {
    try {
      first = &home();
    } catch (...) {  // no host memory for a new home arena: every arena is asked below
    }
  }
  SegmentTier::Freed freed = first->free_keeping(block, tag, bytes, by);
  if (freed != SegmentTier::Freed::foreign) {
    holder = first;
    return freed;
  }
  for (std::size_t i = 0; i < count_; ++i) {
    SegmentTier* other = arena(i);
    if (other == nullptr || other == first) continue;
    freed = other->free_keeping(block, tag, bytes, by);
    if (freed != SegmentTier::Freed::foreign) {
      holder = other;
      return freed;
    }
  }
  return SegmentTier::Freed::foreign;
}

void TierArenas::trim(std::size_t keep_free, bool wait) noexcept {
  for_each([&keep_free, wait](SegmentTier& tier) {
    const std::size_t keep = std::min(keep_free, tier.counters().free_bytes);
    tier.trim(keep, wait);
    keep_free -= keep;
  });
}

TierArenas::Marks TierArenas::mark_frees() noexcept {
  Marks marks{};
  for (std::size_t i = 0; i < count_; ++i) {
    if (SegmentTier* tier = arena(i)) marks[i] = tier->mark_frees();
  }
  return marks;
}

void TierArenas::forget_streams(const Marks& marks) noexcept {
  // An arena made after the marks were taken holds no free made before them.
  for (std::size_t i = 0; i < count_; ++i) {
    if (SegmentTier* tier = arena(i)) tier->forget_streams(marks[i]);
  }
}

void TierArenas::restart_peak() noexcept {
  for_each([](SegmentTier& tier) { tier.restart_peak(); });
}

void TierArenas::reset_peak() noexcept {
  for_each([](SegmentTier& tier) { tier.reset_peak(); });
}

bool TierArenas::stranded_segments() const noexcept {
  bool any = false;
  for_each([&any](SegmentTier& tier) { any = any || tier.stranded_segments(); });
  return any;
}

std::size_t TierArenas::release_empty_for(std::size_t bytes, const SegmentTier* except) noexcept {
  std::size_t given = 0;
  for_each([&](SegmentTier& tier) {
    if (&tier == except || given >= bytes) return;
    given += tier.release_empty_for(bytes - given);
  });
  return given;
}

bool TierArenas::owns(void* block) const noexcept {
  bool any = false;
  for_each([&any, block](SegmentTier& tier) { any = any || tier.owns(block); });
  return any;
}

std::uint32_t TierArenas::contentions() const noexcept {
  SegmentTier* own = arena(home_index());
  return (own != nullptr ? own : arena(0))->contentions();
}

SegmentTier::Counters TierArenas::counters() const noexcept {
  SegmentTier::Counters sum;
  for_each([&sum](SegmentTier& tier) {
    const SegmentTier::Counters c = tier.counters();
    sum.reserved += c.reserved;
    sum.peak_reserved += c.peak_reserved;
    sum.free_bytes += c.free_bytes;
    sum.upstream_allocations += c.upstream_allocations;
    sum.upstream_frees += c.upstream_frees;
    sum.failed_upstream_allocations += c.failed_upstream_allocations;
    sum.segments += c.segments;
    sum.maps += c.maps;
  });
  return sum;
}

void TierArenas::describe(bool large, std::vector<DevicePoolSegment>& out) const {
  for_each([&out, large](SegmentTier& tier) { tier.describe(large, out); });
}

}  // namespace vram::detail
