// src/device_pool/deallocation_validation.hpp: the refused deallocations of one DevicePool, and
// with Options::validate_deallocations (the part is named after that public option) the record of
// every leased block that lets a deallocation be checked before it touches the pool.
//
// Rule: a refused deallocation changes nothing in the pool; it is counted (rejected(), the
// stats' invalid_deallocations) and said on stderr. The record holds a block from its hand-out
// (record()) until its deallocation is checked (check()) or it returns by another way (forget()).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace vram::detail {

class DeallocationValidation {
 public:
  // Files a leased block with its block bytes; throws std::bad_alloc (the caller undoes
  // the hand-out).
  void record(void* block, std::size_t block_bytes);
  // True when `block` is filed with `block_bytes`; it is then forgotten. Otherwise the
  // deallocation is refused (counted, said) and false returned.
  bool check(void* block, std::size_t block_bytes) noexcept;
  // A filed block that came back by another way than a checked deallocation.
  void forget(void* block) noexcept;
  // Counts a refused deallocation of `block` (`bytes`: as the caller gave them, 0: unknown) and
  // says why on stderr.
  void reject(const void* block, std::size_t bytes, const char* why) noexcept;
  // Counts a refusal the caller says itself.
  void count_rejected() noexcept { rejected_.fetch_add(1, std::memory_order_relaxed); }
  std::uint64_t rejected() const noexcept { return rejected_.load(std::memory_order_relaxed); }

 private:
  std::mutex mutex_;  // guards live_; taken after every other lock of the pool
  std::unordered_map<void*, std::size_t> live_;
  std::atomic<std::uint64_t> rejected_{0};
};

}  // namespace vram::detail
