// src/device_pool/large_block_cache.hpp: one thread's cache of large blocks (above
// small_tier.max_block_bytes) for one pool, by exact block size, and its record of the large blocks
// the tier handed to this thread.
//
// Why a per-thread cache and not a faster shared lock: a large request that misses it takes
// the large tier's mutex (best fit, split, merge); under many threads every hand-off of
// that mutex moves its cache lines and the tier's between cores, so no lock lets one tier
// serve more calls than one core can. Training and inference loops ask for the same large
// sizes step after step, so a freed block is usually wanted again, at the same size, by
// the thread that freed it: cached here it costs no lock and no shared cache line (a
// thread cache, as jemalloc's tcache and mimalloc's thread-local heaps keep small blocks,
// but by exact size). Address-sharded arenas (RMM's arena_memory_resource) were the
// other way: each arena places blocks only among its own free ranges, so one thread's
// placement, and the memory the pool holds, would change with the arena it lands in; a
// cache in front of the one tier leaves placement as it is (see "Only where threads
// meet"). What
// bounds the memory it holds back (the blocks stay carved out of the tier, in use from the
// tier's view): a byte cap per thread (DevicePool::Options::thread_cache.large_bytes), a
// block count (kMaxCached), and flushes: before any tier grows, before an out-of-memory
// retry, on trim() and at thread exit every thread's cached large blocks go back to the
// tier (DevicePoolCore::flush_large_caches), so a cached block never makes the pool grow
// where it would not have grown without the cache.
//
// Only where threads meet: a cache starts keeping blocks once its thread has seen the large
// tier's mutex contended (its count of contended locks moved between two of the thread's
// calls into the tier; see note_contentions()), and keeps them from then on. A thread alone
// on the tier (one thread, or threads that take turns) caches nothing, so the pool places
// its blocks, and holds memory, exactly as without the cache.
//
// Sizes drawn afresh: a cache of exact sizes rarely hits them. A thread that met others on a
// tier also has a heap over the large tier (thread_heap.hpp), which places any size by best
// fit without the tier's mutex; this cache sits in front of it and keeps the heap's blocks
// only while sizes come back (keeps()), the tier's blocks as always.
//
// Reuse rule: a block is cached with the stream it was freed on (kUntagged: completed
// work, any stream) and handed out only for that stream's requests, or any request when
// untagged; it goes back to the tier under that tag.
//
// Validation without the tier's mutex (release builds, no validate_deallocations): the record
// (`leases_`) holds the blocks this thread got from the tier, with their rounded size and
// whether they are cached now. A deallocation on this thread is cached only when the record
// says the block is leased at that size; a block recorded as cached is a double deallocation
// (rejected); a size that differs, or a block not recorded, goes to the tier, which
// decides as before. The tier files this cache as the owner of each block it hands out
// here (lease_owner.hpp): a deallocation of such a block on any other path is checked against
// the cached blocks (a double deallocation there is refused too) and revokes that block's
// record, so a record is never trusted after its block left by another path. When the record is
// full the leased entries are forgotten (their deallocations then go through the tier); cached
// ones stay.
//
// Not thread-safe: touched only under the owning ThreadCache's handshake
// (thread_cache.hpp), by its owner or one stealer; the tier reads the slots and revokes
// (LeaseOwner) from any thread.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "tier/contention_watch.hpp"
#include "tier/lease_owner.hpp"
#include "tier/stream_key.hpp"

namespace vram::detail {

class LargeBlockCache : public LeaseOwner {
 public:
  static constexpr std::size_t kMaxCached = kCachedSlots;
  struct Cached {
    void* block = nullptr;
    std::size_t bytes = 0;  // the tier's rounded size
    StreamKey tag = kUntagged;
  };
  enum class Put { cached, double_deallocate, to_tier, no_room };

  // Whether this cache keeps blocks (see above).
  bool active() const noexcept { return active_; }
  // With a thread heap (thread_heap.hpp) behind it, the cache keeps the heap's blocks by exact
  // size only while sizes come back: of every kWindow requests the heap would serve, at least
  // one in kMinHits must find its size here, else it stops keeping them (its blocks go back, to
  // the heap). While it does not keep, it remembers the sizes of the blocks that went past it
  // (about the last kShadow), and starts keeping again once a window's requests would have found
  // their size among them as often. Sizes that repeat (training and inference steps) keep the
  // cache's speed; sizes drawn afresh skip a cache that would only pin chunks with blocks the
  // heap could place (the tier's blocks are kept as always).
  static constexpr std::uint32_t kWindow = 64;
  static constexpr std::uint32_t kMinHits = 8;
  static constexpr std::size_t kShadow = 64;  // a power of two
  static std::size_t shadow_slot(std::size_t bytes) noexcept {
    return static_cast<std::size_t>(((bytes >> 9) * 0x9E3779B97F4A7C15ULL) >> 58);  // 6 bits
  }
  bool keeps() const noexcept { return keeps_; }
  // While not keeping: a block of `bytes` went past the cache (to its heap). The shadow is
  // direct-mapped by size: one load to ask, a later size in the same slot forgets the earlier.
  // Its record, if any, goes: the block is no longer this thread's.
  void note_passed(const void* block, std::size_t bytes) noexcept {
    shadow_[shadow_slot(bytes)] = bytes;
    if (block == nullptr) return;
    if (Lease* lease = find(block); lease != nullptr && !lease->cached) erase(lease);
  }
  // While not keeping: whether a request of `bytes` would have found its size here.
  bool would_hit(std::size_t bytes) const noexcept { return shadow_[shadow_slot(bytes)] == bytes; }
  // Turns the cache on: the thread met others on a tier (its heaps started).
  void activate() noexcept { active_ = true; }
  // A request the heap would serve: `hit`, it was served here (while keeping) or would have
  // been (would_hit, while not). True when the cache just stopped keeping (the caller drains
  // it).
  bool note_request(bool hit) noexcept {
    hits_ += hit ? 1 : 0;
    if (++window_ < kWindow) return false;
    const bool enough = hits_ * kMinHits >= kWindow;
    window_ = hits_ = 0;
    const bool stop = keeps_ && !enough;
    keeps_ = enough;
    if (keeps_) shadow_.fill(0);
    return stop;
  }
  // For a thread that adopts the cache (empty) of an exited one: it starts as a new
  // thread's, `active` or not, having seen no contention of its own.
  // Its records are the exited thread's: forgotten.
  void restart(bool active) noexcept {
    active_ = active;
    keeps_ = true;
    window_ = hits_ = 0;
    shadow_.fill(0);
    contentions_.reset();
    forget_leased();
  }
  // The large tier's count of contended locks, read by this thread after a call into the
  // tier: a change since its last call turns the cache on.
  void note_contentions(std::uint32_t count) noexcept {
    if (contentions_.moved(count)) active_ = true;
  }
  // A cached block of exactly `bytes` usable on `key` (recorded as leased again), else null.
  void* take(std::size_t bytes, StreamKey key) noexcept {
    for (std::size_t i = count_; i-- > 0;) {
      const Meta& m = meta_[i];
      if (m.bytes != bytes || (m.tag != kUntagged && m.tag != key)) continue;
      void* block = slots_[i].load(std::memory_order_relaxed);
      cached_bytes_.store(cached_bytes_.load(std::memory_order_relaxed) - m.bytes,
                          std::memory_order_relaxed);
      --count_;
      if (i != count_) set(i, entry(count_));  // the last moves down, then its slot clears
      slots_[count_].store(nullptr, std::memory_order_release);
      if (Lease* lease = find(block)) lease->cached = false;
      return block;
    }
    return nullptr;
  }
  // Records a block of `bytes` the tier just handed to this thread.
  void note_leased(void* block, std::size_t bytes) noexcept {
    if (leases_used_ >= kMaxLeases) forget_leased();
    if (Lease* lease = find(block)) {  // a stale record at this address
      *lease = Lease{block, bytes, false};
      return;
    }
    std::size_t i = home(block);
    while (leases_[i].block != nullptr) i = (i + 1) & kMask;
    leases_[i] = Lease{block, bytes, false};
    ++leases_used_;
  }
  // A deallocation on this thread of `block` (rounded size `bytes`, at most `cap`) on `key`:
  // cached; a double deallocation; for the tier (then no longer recorded here); or no room
  // (nothing changed: make room with free_oldest() and put it again).
  Put put(void* block, std::size_t bytes, StreamKey key, std::size_t cap) noexcept {
    read_revocations();
    Lease* lease = find(block);
    if (lease == nullptr) return Put::to_tier;
    if (lease->cached) return Put::double_deallocate;
    if (lease->bytes != bytes) {
      erase(lease);
      return Put::to_tier;
    }
    if (!has_room(bytes, cap)) return Put::no_room;
    lease->cached = true;
    set(count_++, Cached{block, bytes, key});
    cached_bytes_.store(cached_bytes_.load(std::memory_order_relaxed) + bytes,
                        std::memory_order_relaxed);
    return Put::cached;
  }
  // A deallocation on this thread of `block` that is not to be cached (a young stream's,
  // stream_ages.hpp): false for a double deallocation (the block is cached here); else its
  // record, if any, goes (the block leaves this thread) and the tier decides.
  bool leaves(const void* block) noexcept {
    read_revocations();
    Lease* lease = find(block);
    if (lease == nullptr) return true;
    if (lease->cached) return false;
    erase(lease);
    return true;
  }
  bool has_room(std::size_t bytes, std::size_t cap) const noexcept {
    return count_ < kMaxCached && cached_bytes_.load(std::memory_order_relaxed) + bytes <= cap;
  }
  // The oldest cached block to `to_tier(const Cached&)` (the tier's free), then out of the
  // cache (its record dropped; its slot cleared only now: lease_owner.hpp); false when none
  // is cached.
  template <class ToTier>
  bool free_oldest(ToTier to_tier) noexcept {
    if (count_ == 0) return false;
    const Cached out = entry(0);
    to_tier(out);
    for (std::size_t i = 1; i < count_; ++i) set(i - 1, entry(i));  // downwards (LeaseOwner)
    --count_;
    slots_[count_].store(nullptr, std::memory_order_release);
    cached_bytes_.store(cached_bytes_.load(std::memory_order_relaxed) - out.bytes,
                        std::memory_order_relaxed);
    if (Lease* lease = find(out.block)) erase(lease);
    return true;
  }
  // Every cached block to `to_tier`, oldest first.
  template <class ToTier>
  void drain(ToTier to_tier) noexcept {
    while (free_oldest(to_tier)) {
    }
  }
  std::size_t cached_count() const noexcept { return count_; }
  // Read by stats() and by flushers deciding whether a cache is worth a steal (relaxed).
  std::size_t cached_bytes() const noexcept {
    return cached_bytes_.load(std::memory_order_relaxed);
  }

 private:
  struct Lease {
    void* block = nullptr;  // null: empty slot
    std::size_t bytes = 0;
    bool cached = false;
  };
  static constexpr std::size_t kSlots = 128;  // a power of two
  static constexpr std::size_t kMask = kSlots - 1;
  static constexpr std::size_t kMaxLeases = kSlots * 3 / 4;  // linear probing stays short
  static_assert(kMaxCached < kMaxLeases);

  static std::size_t home(const void* block) noexcept {
    const auto key = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(block) >> 8);
    return static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ULL) >> 57);  // 7 bits: kSlots
  }
  // Records of blocks deallocated elsewhere since (lease_owner.hpp) go first: their blocks
  // may be another request's now.
  void read_revocations() noexcept {
    read_mail([this] { forget_leased(); },
              [this](const void* revoked) {
                if (Lease* stale = find(revoked); stale != nullptr && !stale->cached) erase(stale);
              });
  }
  Lease* find(const void* block) noexcept {
    for (std::size_t i = home(block);; i = (i + 1) & kMask) {
      if (leases_[i].block == block) return &leases_[i];
      if (leases_[i].block == nullptr) return nullptr;
    }
  }
  // Backward-shift deletion: every record stays reachable from its home slot.
  void erase(Lease* lease) noexcept {
    std::size_t hole = static_cast<std::size_t>(lease - leases_.data());
    for (std::size_t j = (hole + 1) & kMask; leases_[j].block != nullptr; j = (j + 1) & kMask) {
      const std::size_t k = home(leases_[j].block);
      // Slot j may move to the hole unless its home lies cyclically in (hole, j].
      const bool stays = hole < j ? (k > hole && k <= j) : (k > hole || k <= j);
      if (!stays) {
        leases_[hole] = leases_[j];
        hole = j;
      }
    }
    leases_[hole] = Lease{};
    --leases_used_;
  }
  // Drops every leased (not cached) record; their deallocations then go through the tier.
  void forget_leased() noexcept {
    std::array<Cached, kMaxCached> keep{};
    for (std::size_t i = 0; i < count_; ++i) keep[i] = entry(i);
    leases_.fill(Lease{});
    leases_used_ = 0;
    for (std::size_t i = 0; i < count_; ++i) {
      std::size_t slot = home(keep[i].block);
      while (leases_[slot].block != nullptr) slot = (slot + 1) & kMask;
      leases_[slot] = Lease{keep[i].block, keep[i].bytes, true};
      ++leases_used_;
    }
  }

  // Cached block i: slots_[i] (LeaseOwner) and meta_[i], for i < count_.
  struct Meta {
    std::size_t bytes = 0;
    StreamKey tag = kUntagged;
  };
  Cached entry(std::size_t i) const noexcept {
    return Cached{slots_[i].load(std::memory_order_relaxed), meta_[i].bytes, meta_[i].tag};
  }
  void set(std::size_t i, const Cached& c) noexcept {
    meta_[i] = Meta{c.bytes, c.tag};
    slots_[i].store(c.block, std::memory_order_release);
  }

  std::array<Meta, kMaxCached> meta_{};
  std::size_t count_ = 0;
  std::atomic<std::size_t> cached_bytes_{0};
  std::array<Lease, kSlots> leases_{};
  std::size_t leases_used_ = 0;
  bool active_ = false;
  bool keeps_ = true;
  std::uint32_t window_ = 0;
  std::uint32_t hits_ = 0;
  std::array<std::size_t, kShadow> shadow_{};
  ContentionWatch contentions_;
};

}  // namespace vram::detail
