// foreign_pool.hpp: the memory of a pool PyTorch made with its own allocator
// (torch.cuda.MemPool(allocator=...), NCCL's ncclMemAlloc for one), cached the way PyTorch's
// caching allocator caches a private pool's, so that code written against PyTorch's pools
// (NCCL's registerMemPool, snapshots, tests that count segments) sees the same segments.
//
// Rules:
// - A request is rounded up to a multiple of 512 bytes (512 at least). One of at most 1 MiB
//   is small and is cut from a 2 MiB segment; a larger one from a 20 MiB segment below
//   10 MiB, else from a segment of its own size rounded up to 2 MiB. Each segment is one call
//   of the allocator and goes back to it whole, never in parts.
// - A free block is reused only by a request of its kind (small or large) on the stream its
//   segment was made on: stream order makes the reuse safe without an event. Best fit by
//   size, then the lowest address. A block is cut when the rest is at least 512 bytes
//   (small) or more than 1 MiB (large); a freed block joins its free neighbours.
// - A segment goes back to the allocator only whole: at release_free() (PyTorch's empty_cache
//   once the pool has no use) and at the pool's destruction (the last reference: the
//   MemPool's use, every live block and every block held back for its recorded streams
//   hold one). Never while the pool is in use, not even
//   when the allocator fails a request (the failure reaches the caller): a captured graph of
//   the pool may hold a free segment's addresses. The listener hears of each segment made
//   before any block of it is handed out, and of each going back before the allocator frees
//   it.
// Thread safety: one mutex; the allocator and the listener are called outside it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

namespace vram_torch {

// Where a pool's segments come from (a MemPool's own allocator). Throws, or returns null,
// when it has no memory.
struct PoolAllocator {
  virtual ~PoolAllocator() = default;
  virtual void* allocate(std::size_t size, cudaStream_t stream) = 0;
  virtual void deallocate(void* ptr) noexcept = 0;
};

class ForeignPool {
 public:
  using Id = std::pair<std::uint64_t, std::uint64_t>;  // c10::MempoolId_t
  // A segment made (`made`) or about to go back to the allocator.
  using Listener = std::function<void(std::uintptr_t address, std::size_t bytes,
                                      cudaStream_t stream, bool made)>;

  static constexpr std::size_t kMinBlock = 512;
  static constexpr std::size_t kSmallRequest = std::size_t{1} << 20;
  static constexpr std::size_t kSmallSegment = std::size_t{2} << 20;
  static constexpr std::size_t kLargeSegment = std::size_t{20} << 20;
  static constexpr std::size_t kMinLargeAlone = std::size_t{10} << 20;
  static constexpr std::size_t kLargeRound = std::size_t{2} << 20;

  ForeignPool(Id id, std::shared_ptr<PoolAllocator> source, Listener listener = nullptr) noexcept
      : id_(id), source_(std::move(source)), listener_(std::move(listener)) {}
  ForeignPool(const ForeignPool&) = delete;
  ForeignPool& operator=(const ForeignPool&) = delete;
  // Gives every segment back (no block of it is live: each holds a reference).
  ~ForeignPool();

  Id id() const noexcept { return id_; }

  struct Given {
    void* ptr = nullptr;    // null: the allocator returned null
    std::size_t bytes = 0;  // the block's: `size` rounded, more when the rest was not cut off
  };
  // A block of at least `size` (> 0) bytes for work on `stream`. Throws what the allocator
  // throws, and std::bad_alloc; nothing changed then.
  Given allocate(std::size_t size, cudaStream_t stream);
  // Returns the live block at `ptr` to the cache; false when there is none (nothing changed).
  bool deallocate(void* ptr) noexcept;
  // Gives back every whole free segment; the bytes given back.
  std::size_t release_free() noexcept;

  struct BlockView {
    std::uintptr_t address = 0;
    std::size_t bytes = 0;
    // A live block's; a free block's: that of the block freed last into it (0: none), as
    // PyTorch's snapshot shows.
    std::size_t requested = 0;
    bool live = false;
  };
  struct SegmentView {
    std::uintptr_t address = 0;
    std::size_t bytes = 0;
    cudaStream_t stream = nullptr;
    bool large = false;
    std::uint64_t order = 0;        // made before every segment with a larger order
    std::vector<BlockView> blocks;  // by address, covering the segment
  };
  std::vector<SegmentView> segments() const;
  std::size_t reserved_bytes() const noexcept;
  std::size_t segment_count() const noexcept;

  // PyTorch's rounding of a request, and the bytes of the segment a rounded request is cut
  // from when no free block serves it.
  static std::size_t round(std::size_t size) noexcept;
  static std::size_t segment_bytes(std::size_t rounded) noexcept;

 private:
  struct Segment {
    std::size_t bytes = 0;
    cudaStream_t stream = nullptr;
    bool large = false;
    std::uint64_t order = 0;
  };
  struct Block {
    std::uintptr_t segment = 0;  // its segment's address
    std::size_t bytes = 0;
    std::size_t requested = 0;
    bool live = false;
  };
  // Free blocks by (stream, kind, bytes, address): best fit is the first at or after a key.
  using FreeKey = std::tuple<cudaStream_t, bool, std::size_t, std::uintptr_t>;

  // Under mutex_: the best free block for the request, cut and live; 0 when none.
  std::uintptr_t take_free(std::size_t rounded, std::size_t requested, cudaStream_t stream,
                           bool large);
  // Under mutex_: marks the block at `at` live with `rounded` bytes, the rest free.
  void carve(std::map<std::uintptr_t, Block>::iterator at, std::size_t rounded,
             std::size_t requested);
  // Under mutex_: moves the whole free segments out of the cache into `whole` (those moved
  // before a std::bad_alloc stay there).
  void take_whole_free(std::vector<std::pair<std::uintptr_t, Segment>>& whole);
  // Outside mutex_: tells the listener, then the allocator frees each segment.
  void give_back(const std::vector<std::pair<std::uintptr_t, Segment>>& segments) noexcept;
  void tell(std::uintptr_t address, std::size_t bytes, cudaStream_t stream,
            bool made) const noexcept;
  bool free_key(const Block& b, std::uintptr_t address, FreeKey& key) const noexcept;

  const Id id_;
  const std::shared_ptr<PoolAllocator> source_;
  const Listener listener_;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, Segment> segments_;
  std::map<std::uintptr_t, Block> blocks_;  // every block of every segment, by address
  std::set<FreeKey> free_;
  std::size_t reserved_ = 0;
  std::uint64_t next_order_ = 0;
};

}  // namespace vram_torch
