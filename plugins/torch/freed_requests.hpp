// freed_requests.hpp: the requested bytes of blocks freed while memory history is on, so a
// snapshot names the last request of free memory as PyTorch's does.
//
// PyTorch's snapshot keeps a freed block's requested_size on the free block it leaves (also
// once merged with free neighbours); PyTorch's tests search the snapshot for it. vram's free
// memory is ranges of its pool, not blocks: this keeps, per device, records of freed blocks
// (address, bytes, requested bytes), and a free range of a snapshot is named by the newest
// record that overlaps it, its request cut to what lies in the range (0: none).
// Rules:
// - Records never overlap: a free drops the records that begin inside its block and cuts the
//   one before it to end where the block begins (the memory was handed out and freed again).
// - A record names memory only while it may still be what was freed there: forget() cuts or
//   drops the records of memory given back to the device, and turning recording off drops all
//   (frees while it is off are not recorded, so older records could go stale).
// - At most kMaxEntries records per device; past that the oldest go first (about 10 MiB of
//   host memory per device at most).
// Thread safety: one mutex, taken with no other lock of the plug-in held and calling out to
// nothing (a leaf). Recording is checked under it, so a free racing with the turn-off
// records nothing.
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

  // Turned off, every record goes and note() records nothing.
  void set_recording(bool on) noexcept;
  // A block of `bytes` at `address` freed, `requested` of them asked for (cut to `bytes`).
  // Not recording, or no host memory: the free is not named (the snapshot shows 0 there).
  void note(int device, std::uintptr_t address, std::size_t bytes, std::size_t requested) noexcept;
  // The requested bytes of the newest record overlapping [begin, end) of `device`, cut to
  // what lies in the range from where the record meets it.
  std::size_t last_in(int device, std::uintptr_t begin, std::uintptr_t end) const;
  // Memory [begin, end) of `device` went back to the device: its records go (one that begins
  // before it is cut to end there).
  void forget(int device, std::uintptr_t begin, std::uintptr_t end) noexcept;
  std::size_t size(int device) const;  // records kept (tests)

 private:
  struct Entry {
    std::uint64_t order;
    std::size_t bytes;
    std::size_t requested;
  };
  struct Device {
    std::map<std::uintptr_t, Entry> by_address;
    std::map<std::uint64_t, std::uintptr_t> by_order;  // the same records, oldest first
  };
  static void erase(Device& device, std::map<std::uintptr_t, Entry>::iterator it) noexcept;
  // Drops the records that begin in [begin, end) and cuts the one before `begin` to end there.
  static void drop(Device& device, std::uintptr_t begin, std::uintptr_t end) noexcept;

  mutable std::mutex mutex_;
  bool recording_ = false;
  std::uint64_t next_order_ = 0;
  std::vector<Device> devices_;
};

}  // namespace vram_torch
