// freed_requests.hpp: the requested bytes of blocks freed while memory history is on, so a
// snapshot names the last request of free memory as PyTorch's does.
//
// PyTorch's snapshot keeps a freed block's requested_size on the free block it leaves (also
// once merged with free neighbours), and memory_viz and PyTorch's tests read it there after
// the trace of that free is filtered out. vram's free memory is ranges of its pool, not
// blocks; this keeps, per device, the address and requested bytes of each block freed while
// history is wanted, and a snapshot gives a free range the request of the block freed last
// at an address inside it (0: none).
// Rules: a later free at the same address replaces the earlier one; at most kMaxEntries are
// kept per device (past that the lowest addresses go first); a record inside memory that is
// handed out again is simply not asked for (only free ranges ask). Nothing is recorded while
// history is off, so the free path then pays nothing here.
// Thread safety: one mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace vram_torch {

class FreedRequests {
 public:
  static constexpr std::size_t kMaxEntries = std::size_t{1} << 16;

  // Records the free; no host memory: the record is dropped (the snapshot shows 0).
  void note(int device, std::uintptr_t address, std::size_t requested) noexcept;
  // The requested bytes of the block freed last at an address in [begin, end) of `device`,
  // at most what lies in the range from that address.
  std::size_t last_in(int device, std::uintptr_t begin, std::uintptr_t end) const;

 private:
  struct Entry {
    std::uint64_t order;
    std::size_t requested;
  };
  mutable std::mutex mutex_;
  std::uint64_t next_order_ = 0;
  std::vector<std::map<std::uintptr_t, Entry>> by_device_;
};

}  // namespace vram_torch
