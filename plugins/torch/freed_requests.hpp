// freed_requests.hpp: the requested bytes of blocks freed while memory history is on, so a
// snapshot names the last request of free memory as PyTorch's does.
//
// PyTorch's snapshot keeps a freed block's requested_size on the free block it leaves (also
// once merged with free neighbours); PyTorch's tests search the snapshot for it. vram's free
// memory is ranges of its pool, not blocks: this keeps, per device, each freed block's
// address, bytes and requested bytes, and a free range of a snapshot is named by the newest
// record that overlaps it, its request cut to what lies in the range (0: none).
// Rules:
// - A record names memory only while it may still be what was freed there: a free drops the
//   records that begin inside the block it frees (newer memory over them), forget() drops
//   those of memory given back to the device, clear() all of them (history turned off or
//   cleared: frees while it is off are not recorded, so older records could be stale).
// - At most kMaxEntries records per device; past that the oldest go first (about 8 MiB of
//   host memory per device at most).
// Thread safety: one mutex, taken with no other lock of the plug-in held and calling out to
// nothing (a leaf).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace vram_torch {

class FreedRequests {
 public:
  static constexpr std::size_t kMaxEntries = std::size_t{1} << 16;

  // A block of `bytes` at `address` freed, `requested` of them asked for. No host memory:
  // the free is not named (the snapshot shows 0 there).
  void note(int device, std::uintptr_t address, std::size_t bytes, std::size_t requested) noexcept;
  // The requested bytes of the newest record overlapping [begin, end) of `device`, cut to
  // what lies in the range from where the record meets it.
  std::size_t last_in(int device, std::uintptr_t begin, std::uintptr_t end) const;
  // Memory [begin, end) of `device` went back to the device: the records beginning there go.
  void forget(int device, std::uintptr_t begin, std::uintptr_t end) noexcept;
  void clear() noexcept;
  std::size_t size(int device) const;  // records kept (tests)

 private:
  struct Entry {
    std::uint64_t order;
    std::size_t bytes;
    std::size_t requested;
  };
  struct Device {
    std::map<std::uintptr_t, Entry> by_address;
    // (order, address) oldest first; an element whose address's entry has another order is
    // stale (that entry was replaced or dropped) and skipped.
    std::deque<std::pair<std::uint64_t, std::uintptr_t>> by_age;
  };
  void drop_oldest(Device& device) noexcept;

  mutable std::mutex mutex_;
  std::uint64_t next_order_ = 0;
  std::vector<Device> devices_;
};

}  // namespace vram_torch
