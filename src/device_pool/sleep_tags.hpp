// src/device_pool/sleep_tags.hpp: the sleep tags of one DevicePool (vram/sleep_tag.hpp): which
// tag a request goes to, which tag a block belongs to, and sleep and wake.
//
// Rules:
//   - A tag, once created, lives as long as the pool (its index is its slot, never reused);
//     tags_[i] is written once, before count_ is raised past it: a lookup reads count_ and
//     the slots below it without a lock.
//   - Each tag's mutex guards its arena, backup and state; sleep and wake hold it across
//     their copies, so a request or release of that tag waits for them.
//   - While any tag exists the pool's graph flag stays raised (GraphRouting), so every
//     call leaves the warm path and asks route() / owner_of() first.
//   - A thread's tag scopes are a thread-local stack of TagScopeEntry (below); its route
//     into a pool is the innermost open entry naming that pool, matched by the pool's uid
//     (never reused: an entry cannot route into a later pool at the same address).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "graph_routing.hpp"
#include "sleep_copier.hpp"
#include "tag_arena.hpp"
#include "tag_backup.hpp"
#include "vram/sleep_tag.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::detail {

// One open DevicePool::TagScope, an entry of the stack of the thread that opened it.
//   - Two references, the scope's and the opener's stack's; the last release deletes it.
//   - pool_uid and index never change; `open` is the only field another thread touches (a
//     scope ended on another thread only clears it and drops the scope's reference).
//   - `below` and the stack are the opener's alone: it unlinks entries no longer open when it
//     opens or ends a scope or looks up a route, and releases the rest at thread exit.
struct TagScopeEntry {
  TagScopeEntry(std::uint64_t pool, std::uint32_t tag) noexcept : pool_uid(pool), index(tag) {}
  const std::uint64_t pool_uid;
  const std::uint32_t index;
  std::atomic<bool> open{true};
  std::atomic<std::uint32_t> refs{2};
  TagScopeEntry* below = nullptr;
  void release() noexcept {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }
};
// The calling thread's scopes, innermost first; null: none. Trivially destructible, so a
// look-up during thread-local teardown reads null or live entries.
inline constinit thread_local TagScopeEntry* tl_tag_scopes = nullptr;
// A new entry for tag `index` of the pool with uid `pool_uid`, pushed onto the calling
// thread's stack; throws std::bad_alloc.
TagScopeEntry* open_tag_scope(std::uint64_t pool_uid, std::uint32_t index);
// Ends the scope's `entry` on any thread: clears `open`, unlinks it if the calling thread's
// stack holds it (no other thread's route changes here: the opener unlinks it lazily), and
// releases the scope's reference.
void end_tag_scope(TagScopeEntry* entry) noexcept;

struct Tag {
  Tag(std::string name_in, const SleepTagOptions& options_in, VirtualMemory& memory,
      ReservedGauge& gauge, std::size_t reservation_bytes, std::size_t max_run_bytes,
      std::shared_ptr<Upstream> backup_upstream);
  std::string name;
  SleepTagOptions options;
  std::mutex mutex;
  TagArena arena;
  TagBackup backup;
  SleepState state = SleepState::awake;
  bool closed = false;  // the pool was destroyed: releases are taken, nothing else
  struct Saved {        // one live range of the last sleep and where the backup holds it
    std::size_t offset;
    std::size_t bytes;
    std::size_t backup_offset;
  };
  std::vector<Saved> saved;
  std::size_t backed_up_bytes = 0;
  std::size_t copied_ranges = 0;  // of the last sleep
  std::uint64_t sleeps = 0;
  std::uint64_t wakes = 0;
};

class SleepTags {
 public:
  static constexpr std::size_t kMaxTags = 64;
  // Neighbouring live blocks closer than this are copied as one range.
  static constexpr std::size_t kMaxCopyGap = std::size_t{256} << 10;

  // Tags' mapped granules are charged to `gauge` (ReservedGauge::add_total).
  SleepTags(std::uint64_t pool_uid, GraphRouting& activity, ReservedGauge& gauge) noexcept
      : pool_uid_(pool_uid), activity_(activity), gauge_(gauge) {}
  ~SleepTags();

  bool any() const noexcept { return count_.load(std::memory_order_acquire) != 0; }
  // Throws vram::InvalidArgument (no virtual memory, a name taken, kMaxTags reached) and
  // what reserving the range throws.
  SleepTag create(std::string_view name, const SleepTagOptions& options,
                  const std::shared_ptr<VirtualMemory>& memory, std::size_t reservation_bytes,
                  std::size_t max_run_bytes, MemoryKind pool_kind);
  std::optional<SleepTag> find(std::string_view name) const noexcept;
  std::vector<SleepTag> all() const;
  // The tag `tag` names; throws vram::InvalidArgument for one never created here.
  Tag& tag_of(SleepTag tag, const char* call) const;
  // The tag whose range holds `block`, or null.
  Tag* owner_of(const void* block) const noexcept;
  // The tag of the calling thread's innermost open scope into this pool, or null.
  Tag* route() const noexcept { return tl_tag_scopes == nullptr ? nullptr : scoped_tag(); }
  SleepTag handle_of(std::uint32_t index) const noexcept { return {pool_uid_, index}; }
  std::uint64_t pool_uid() const noexcept { return pool_uid_; }

  // A block of `tag`; throws vram::InvalidArgument while it sleeps, vram::OutOfMemory. Maps
  // in relaxed capture mode (a global-mode capture on any thread stays valid).
  void* allocate(Tag& tag, std::size_t bytes, StreamKey key);
  // Whether `tag` sleeps now; whether `block` is a live block of `tag` requested with `bytes`.
  static bool asleep(Tag& tag) noexcept;
  static bool is_live(Tag& tag, const void* block, std::size_t bytes) noexcept;
  enum class Release { taken, asleep, not_live };
  // Frees `block` of `tag` (released with `bytes`); nothing changes unless taken.
  static Release free(Tag& tag, void* block, std::size_t bytes, StreamKey key,
                      std::size_t& block_bytes) noexcept;

  void sleep(Tag& tag, cudaStream_t stream, SleepContents contents);
  void wake(Tag& tag, cudaStream_t stream);
  SleepTagStats stats(Tag& tag) const;
  // Over every tag, in one walk (each tag's mutex taken once).
  struct Totals {
    std::size_t mapped_bytes = 0;
    std::uint64_t sleeping = 0;
  };
  Totals totals() const noexcept;
  // Unmaps the free runs of awake tags.
  void trim() noexcept;
  // At pool destruction: sleeping tags release their backup; says so on stderr.
  void close() noexcept;

 private:
  Tag* scoped_tag() const noexcept;  // route() with a scope open on this thread
  std::unique_ptr<SleepCopier> copier(cudaStream_t stream);
  // After a sleep's wait failed with the runs below `released` unmapped: maps them again and
  // copies their saved bytes back (said on stderr when that fails too).
  void restore_released(Tag& tag, const std::vector<Tag::Saved>& saved, std::size_t released,
                        cudaStream_t stream) noexcept;
  // Queues the copies of bytes [from, to) of the saved range `range` from the backup back to
  // the tag's range (wake, restore_released).
  static void copy_back(Tag& tag, SleepCopier& copies, const Tag::Saved& range, std::size_t from,
                        std::size_t to);

  std::uint64_t pool_uid_;
  GraphRouting& activity_;
  ReservedGauge& gauge_;
  std::mutex create_mutex_;
  std::atomic<std::uint32_t> count_{0};
  std::array<std::atomic<Tag*>, kMaxTags> tags_{};
  std::shared_ptr<VirtualMemory> memory_;  // the pool's; set by the first create()
  int device_ = -1;                        // -1: the host emulation
  std::mutex stream_mutex_;                // guards own_stream_ (sleep/wake without a stream)
  std::optional<cuda::Stream> own_stream_;
};

}  // namespace vram::detail
