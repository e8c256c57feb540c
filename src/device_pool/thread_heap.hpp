// src/device_pool/thread_heap.hpp: one thread's blocks of any size from one tier, placed by
// best fit in chunks the thread takes from that tier, under a mutex of its own.
//
// Why: a request that misses the thread's caches (its bins, the rings, its cache of exact
// large sizes, large_block_cache.hpp) takes the tier's mutex. When sizes change from request
// to request (variable sequence lengths, dynamic shapes) those caches rarely hit, and threads
// convoy on the tier's one mutex: 16 threads got less done than one. A heap gives each thread
// its own best-fit ranges (FreeRanges, the tier's own structure: split, coalesce, a free
// index per stream tag) over chunks of the tier, so a request and a deallocation on the
// thread that made them take only the heap's mutex, which no other thread takes but for a
// deallocation of the heap's block on another thread, a flush, trim(), a quiesce and
// destruction. Its lock is one compare-exchange when uncontended and no cache line of the
// tier moves. (mimalloc's thread-local heaps over segments, snmalloc's per-thread
// allocators, here with a mutex in place of a message queue for the rare deallocation from
// another thread.) A thread has one heap over the large tier (chunks of up to chunk_bytes,
// DevicePool::Options::thread_cache.large_chunk_bytes) and one over the small tier (chunks
// of 2 MiB, twice the class for the largest, for the small classes its bins and the rings
// do not serve).
//
// When: a thread gets its heaps once it has met other threads on a tier's mutex (its cache of
// exact sizes turns on, or the small tier's count of contended locks moved between two of its
// calls): a thread alone places its blocks in the tiers exactly as without heaps, so
// single-threaded workloads (the recorded traces) reserve what they reserved. A heap serves a
// request without a stream, or on the stream the thread asked on 16 times in a row
// (DevicePoolCore::heap_serves); the others go to the tier. In front of the large heap the
// cache of exact sizes keeps the heap's blocks while sizes repeat (large_block_cache.hpp).
// Only requests up to max_block() go to a heap; larger ones go to the tier.
//
// Chunks: a chunk is one block of the tier, of twice the request, or as many bytes as the heap
// has handed out, at most chunk_bytes (rounded to 2 MiB), taken with the request's stream;
// when the tier cut it from that stream's own free range, its bytes start tagged with the
// stream. Its first guard() bytes (the tier's granularity) are never handed out, so no heap
// block starts where its chunk starts: a deallocation the tier is asked about never mistakes a
// heap's block for the chunk it lies in. A chunk goes back to the tier only wholly free (no
// block of it handed out), as pieces that keep their tags (SegmentTier::free_pieces): at once
// when it holds another stream's free ranges than the deallocating one's (they wait for their
// stream's marker there, stream_tags.hpp) or when the heap's wholly free chunks pass keep_idle
// bytes; before a new chunk, the wholly free ones the request's stream cannot use; otherwise
// kept for the thread's next requests until a flush (before any tier grows,
// DevicePoolCore::flush_large_caches: of another thread's heap only a chunk the growing
// request can use; after a quiesce also those whose ranges it untagged; one it cannot use is
// asked back, asked()), trim(), or the thread's exit takes it. A chunk that a deallocate_async
// on stream S sends back carries a marker recorded on S by that call, when the caller holds
// its thread's cache (DevicePoolCore::return_chunk; the marker's recorder): its largest range
// of S waits in the tier for the marker instead of for a want on S, which with many threads
// trading chunks meant a want, a marker and often a device-wide quiesce per chunk. Memory in a
// chunk that still holds a block stays with the heap: that is the cost of a heap, bounded by
// the thread's own fragmentation.
//
// Reuse rule: a free range tagged with stream S (freed on S, or a chunk cut from S's range)
// serves only requests on S; an untagged one any request (completed work only); as in the
// tiers. After a device-wide quiesce every range freed on a stream before it began is
// untagged (mark_frees, forget_streams: the Quiescer's, as for the tiers).
//
// Double deallocations: as in the large tier (lease_owner.hpp), a block handed to a thread's
// cache of exact sizes carries that cache as its owner; a deallocation by anyone else is
// refused while the owner holds it cached, and otherwise revokes the owner's record.
//
// Finding a block's heap without a lock: each heap publishes its chunks' address ranges in
// kMaxChunks slots of atomics, read by contains(). A slot may be read torn while it changes,
// so contains() is a hint: deallocate() checks the block under the mutex and answers
// foreign for a block it does not hold. A block's chunk is published before the block is
// handed out and unpublished only when no block of it is, so a deallocation of a block still
// handed out always finds its heap.
//
// Lock order: the heap's mutex is a leaf. No call into a tier, a fence or the upstream is
// made under it: chunks leave a heap as a Returned record, given to the tier by the caller
// after the heap's mutex is unlocked. (A revoke() into an owner's mailbox, a spin flag of its
// own, is the one thing done under it.)
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "tier/free_ranges.hpp"
#include "tier/segment_tier.hpp"
#include "vram/detail/pointer_map.hpp"
#include "vram/detail/tier_mutex.hpp"

namespace vram::detail {

class ThreadHeap {
 public:
  static constexpr std::size_t kMaxChunks = 16;  // chunks published at once
  static constexpr std::size_t kChunkRounding = std::size_t{2} << 20;

  struct Options {
    std::size_t chunk_bytes = std::size_t{64} << 20;  // a chunk's largest size when grown
    std::size_t keep_idle = std::size_t{256} << 20;   // wholly free chunks kept
    std::size_t granularity = 512;  // the tier's: every range a multiple of it; the guard
  };
  // A chunk leaving the heap, for SegmentTier::free_pieces (the caller's, after the heap's
  // mutex is unlocked).
  struct Returned {
    void* block = nullptr;  // the chunk as the tier handed it out
    std::size_t bytes = 0;
    std::vector<SegmentTier::Piece> pieces;  // the guard, then the chunk's free ranges
  };

  explicit ThreadHeap(Options options) noexcept
      : options_(options), guard_(options.granularity), ranges_(options.granularity) {}
  // Bytes at the front of every chunk never handed out (the tier's granularity).
  std::size_t guard() const noexcept { return guard_; }
  ~ThreadHeap();
  ThreadHeap(const ThreadHeap&) = delete;
  ThreadHeap& operator=(const ThreadHeap&) = delete;

  // Requests of at most this many (rounded) bytes are the heap's.
  std::size_t max_block() const noexcept { return options_.keep_idle / 4; }
  // The chunk a request of `need` bytes takes when nothing free fits: twice the request,
  // else as many bytes as the heap's chunks hold already (a heap's chunks grow
  // geometrically with what its thread uses), at most chunk_bytes (rounded to 2 MiB).
  std::size_t chunk_bytes_for(std::size_t need) const noexcept {
    // Bytes handed out (and guards): read without the mutex, a hint for the size only.
    const std::size_t held = chunk_total_.load(std::memory_order_relaxed);
    const std::size_t free = free_bytes_.load(std::memory_order_relaxed);
    const std::size_t used = held > free ? held - free : 0;
    // At most chunk_bytes, and no more than the heap keeps idle (a chunk it could not keep
    // once wholly free would go back and come again with every batch).
    const std::size_t cap = std::min(options_.chunk_bytes, options_.keep_idle);
    const std::size_t grown = used < cap ? used : cap;
    const std::size_t twice = 2 * need + guard_;
    const std::size_t bytes = twice > grown ? twice : grown;
    return (bytes + kChunkRounding - 1) & ~(kChunkRounding - 1);
  }

  // A block of `need` bytes (rounded to 512) usable on `key` from the free ranges; null when
  // none fits.
  // `owner`: the large-block cache the block is handed to (lease_owner.hpp: a deallocation
  // by anyone else checks it and revokes its record), or null.
  void* allocate(std::size_t need, StreamKey key, LeaseOwner* owner = nullptr) noexcept;
  // Files `chunk` (a block of `chunk_bytes` the large tier handed out for a request on `key`,
  // cut from a range tagged `served`: `key`, or kUntagged) and serves `need` bytes from it;
  // null (the chunk not taken: the caller gives it back) when every slot is taken or no host
  // memory is left for the books.
  void* allocate_in_new_chunk(void* chunk, std::size_t chunk_bytes, std::size_t need, StreamKey key,
                              StreamKey served, LeaseOwner* owner = nullptr) noexcept;
  // Whether `block` may lie in one of this heap's chunks (a hint, see above).
  bool contains(const void* block) const noexcept {
    if (chunks_.load(std::memory_order_relaxed) == 0) return false;
    const auto at = reinterpret_cast<std::uintptr_t>(block);
    for (std::size_t i = 0; i < kMaxChunks; ++i) {
      const std::uintptr_t begin = slots_[i].begin.load(std::memory_order_acquire);
      if (at - begin < slots_[i].bytes.load(std::memory_order_acquire)) return true;
    }
    return false;
  }
  enum class Freed { foreign, kept };
  // A block this heap handed out, back on stream `tag` (kUntagged: completed work).
  // foreign (nothing changed): not a block of this heap handed out at that size (`need`: the
  // rounded size it was asked with), or one its owner holds cached while `by` (the cache it
  // comes back through, or null) is another: a double deallocation, as in the tier. A block
  // deallocated by another than its owner revokes the owner's record. When its chunk is then
  // wholly free and goes back (see above), it is detached into `out` (out.block null
  // otherwise).
  Freed deallocate(void* block, std::size_t need, StreamKey tag, Returned& out,
                   const LeaseOwner* by = nullptr) noexcept;
  // Which wholly free chunks take_idle() detaches: all of them; only those holding free
  // ranges of other streams than `key` (a request on `key` could not use them); only those
  // a request on `key` can use (every free range untagged or `key`'s), which asks the others
  // back; only asked ones that a request on `key` can use (an asked one it cannot use is no
  // longer asked: a heap serves one stream, and no free then scans for it again).
  enum class Idle { all, holding_others, usable, asked };
  // Detaches up to `most` wholly free chunks into `out` (flush, trim, thread exit), those
  // `which` names; returns how many.
  std::size_t take_idle(Returned* out, std::size_t most, Idle which = Idle::all,
                        StreamKey key = kUntagged) noexcept;
  // Asked back: a growth's flush (Idle::usable) left a wholly free chunk here that its request
  // could not use. The heap's thread sends such a chunk back (Idle::asked) at its next
  // deallocation into this heap on a stream whose ranges are the chunk's only tagged ones,
  // under a marker of that stream recorded by that call (DevicePoolCore::free_block), so the
  // memory serves other streams once the work before the marker ran. A chunk stops being
  // asked when a block of it is handed out again or it leaves the heap. One relaxed load.
  bool asked() const noexcept { return asked_slots_.load(std::memory_order_relaxed) != 0; }
  // The quiesce protocol, as the tiers' (SegmentTier::mark_frees, forget_streams): after
  // a device-wide quiesce that began after mark_frees() returned `mark`, every range freed
  // on a stream before the mark is free for every stream (its stream may be gone).
  std::uint64_t mark_frees() noexcept;
  void forget_streams(std::uint64_t mark) noexcept;
  // Free bytes of the heap's chunks (relaxed; stats()).
  std::size_t free_bytes() const noexcept { return free_bytes_.load(std::memory_order_relaxed); }
  std::size_t chunk_count() const noexcept { return chunks_.load(std::memory_order_relaxed); }
  // A hint (the holder's, without the mutex): allocate_in_new_chunk() may find a slot.
  bool has_free_slot() const noexcept { return chunk_count() < kMaxChunks; }

 private:
  using Range = FreeRanges::Range;
  using Segment = FreeRanges::Segment;
  using Lock = std::unique_lock<TierMutex>;
  struct Slot {
    std::atomic<std::uintptr_t> begin{0};
    std::atomic<std::size_t> bytes{0};
  };
  struct Chunk {
    Segment* segment = nullptr;  // its ranges start guard() bytes into the chunk
    std::size_t used = 0;        // blocks handed out; 0: wholly free
  };

  // The smaller fit of `key`'s own ranges and the untagged ones (under the mutex).
  Range* fit(StreamKey key, std::size_t need) noexcept;
  // Hands out `need` bytes of the free range `r` to `owner` (under the mutex; spares kept).
  void* take(Range* r, std::size_t need, LeaseOwner* owner) noexcept;
  std::size_t slot_of(const Segment* segment) const noexcept;
  // Whether the wholly free chunk of `segment` has free ranges of another stream than `tag`.
  static bool holds_others(const Segment* segment, StreamKey tag) noexcept {
    for (const Range* p = segment->first; p != nullptr; p = p->next) {
      if (p->tag != kUntagged && p->tag != tag) return true;
    }
    return false;
  }
  void ask(std::size_t slot) noexcept {
    const std::uint32_t bit = std::uint32_t{1} << slot;
    if ((asked_slots_.load(std::memory_order_relaxed) & bit) == 0) {
      asked_slots_.fetch_or(bit, std::memory_order_relaxed);
    }
  }
  void unask(std::size_t slot) noexcept {
    const std::uint32_t bit = std::uint32_t{1} << slot;
    if ((asked_slots_.load(std::memory_order_relaxed) & bit) != 0) {
      asked_slots_.fetch_and(~bit, std::memory_order_relaxed);
    }
  }
  // A wholly free chunk's pieces into `out`, its ranges unfiled and deleted, its slot
  // cleared; false (nothing changed) when no host memory is left for the list of pieces.
  bool detach(std::size_t slot, Returned& out) noexcept;

  const Options options_;
  const std::size_t guard_;
  mutable TierMutex mutex_;
  FreeRanges ranges_;
  PointerMap<Range> live_;
  std::array<Chunk, kMaxChunks> chunk_books_{};  // by slot; segment null: free slot
  std::array<Slot, kMaxChunks> slots_{};
  std::size_t idle_bytes_ = 0;  // bytes of wholly free chunks (under the mutex)
  std::uint64_t epoch_ = 0;  // mark_frees() so far; a freed range keeps the epoch it was freed in
  std::atomic<std::size_t> free_bytes_{0};
  std::atomic<std::size_t> chunks_{0};
  std::atomic<std::size_t> chunk_total_{0};  // bytes of the chunks held
  // asked(): a bit per slot, written under the mutex only, read by asked() without it.
  std::atomic<std::uint32_t> asked_slots_{0};
  static_assert(kMaxChunks <= 32, "a bit of asked_slots_ per slot");
};

// Every heap of one pool, for a deallocation that is not its own thread's and for the
// flushes. Heaps are made once, kept for the life of the pool (a thread's heap goes with its
// cache to the thread that adopts it) and never removed, so a walk needs no lock.
class ThreadHeaps {
 public:
  static constexpr std::size_t kMaxHeaps = 256;

  explicit ThreadHeaps(ThreadHeap::Options options) noexcept : options_(options) {}
  // A new heap; null when kMaxHeaps exist or no host memory is left.
  ThreadHeap* make() noexcept;
  // Every heap's mark_frees() and forget_streams() (Quiescer: under its mutex).
  struct Marks {
    std::array<std::uint64_t, kMaxHeaps> mark{};
    std::size_t count = 0;
  };
  Marks mark_frees() noexcept;
  void forget_streams(const Marks& marks) noexcept;
  bool any() const noexcept { return count_.load(std::memory_order_acquire) != 0; }
  template <class Visit>
  void for_each(Visit visit) const noexcept {
    const std::size_t n = count_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < n; ++i) visit(*heaps_[i].load(std::memory_order_acquire));
  }

 private:
  const ThreadHeap::Options options_;
  std::mutex mutex_;  // make()'s
  std::vector<std::unique_ptr<ThreadHeap>> owned_;
  std::array<std::atomic<ThreadHeap*>, kMaxHeaps> heaps_{};
  std::atomic<std::size_t> count_{0};
};

}  // namespace vram::detail
