// src/staging/staging_lease.hpp (private): the ledger of one staging loan, shared by the leased
// PinnedBuffer and every PendingCopy issued from it.
//
// Invariants
//   - id is unique in the process (never reused), so it is the buffer's identity and
//     generation at once: every acquire() makes a new ledger.
//   - copies_completed <= copies_enqueued. copies_enqueued grows only on the lease owner's
//     thread (copy_to_device_async takes the PooledStaging by non-const reference);
//     copies_completed grows on whichever thread observed a copy's end event.
//   - parked memory: a buffer destroyed while copies from it are unobserved moves its
//     memory here instead of freeing it; the memory is freed when the last PendingCopy
//     holding the ledger has observed its copy and let go (~StagingLease).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "vram/upstream.hpp"

namespace vram::detail {

struct StagingPoolState;

struct StagingLease {
  StagingLease(std::uint64_t pool_id_in, std::uint64_t id_in) noexcept
      : pool_id(pool_id_in), id(id_in) {}
  StagingLease(const StagingLease&) = delete;
  StagingLease& operator=(const StagingLease&) = delete;
  ~StagingLease() {
    if (parked != nullptr) parked_upstream->deallocate(parked, parked_bytes);
  }

  // Process-wide, starting at 1 (0 means "no lease" in a witness).
  static std::uint64_t next_id() noexcept {
    static std::atomic<std::uint64_t> counter{0};
    return counter.fetch_add(1, std::memory_order_relaxed) + 1;
  }

  // Copies issued from this lease whose end no host has observed yet.
  std::uint64_t copies_in_flight() const noexcept {
    const std::uint64_t enqueued = copies_enqueued.load(std::memory_order_acquire);
    return enqueued - copies_completed.load(std::memory_order_acquire);
  }

  const std::uint64_t pool_id;
  const std::uint64_t id;
  std::atomic<std::uint64_t> copies_enqueued{0};
  std::atomic<std::uint64_t> copies_completed{0};
  // Set by PooledStaging::into_inner(): the pool whose freed_without_witness counts the raw
  // buffer if it is destroyed still on loan (release() ends the loan first).
  std::weak_ptr<StagingPoolState> raw_owner;
  std::shared_ptr<Upstream> parked_upstream;
  void* parked = nullptr;
  std::size_t parked_bytes = 0;
};

}  // namespace vram::detail
