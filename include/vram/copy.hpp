// vram/copy.hpp: host-to-device copies that produce proof of their completion.
//
// A CopyCompleted witness says "the host observed the end of a copy issued from staging
// lease L (copy number S of that lease)". PinnedStagingPool takes a staging buffer back for
// reuse only with a witness of that buffer's current lease, and only once every copy
// issued from the lease has been observed complete.
//
//   auto staging = pool.acquire(bytes);
//   std::memcpy(staging.data(), weights, bytes);
//   vram::PendingCopy copy = vram::copy_to_device_async(device_ptr, staging, stream);
//   ...                                     // overlap other work
//   staging.retire(std::move(copy).wait());  // back to the pool, provably after the copy
//
// Why this is sound (each point has a test, see docs/RELIABILITY.md "The staging witness")
//   - Copies from a staging buffer go through its lease: copy_to_device_async(dst,
//     PooledStaging&, ...) counts the copy on the lease (copies_enqueued) before it returns
//     the PendingCopy. The PendingCopy counts the copy complete (copies_completed) only
//     after the host observed its end event complete: in wait() or, for an abandoned copy, in its
//     destructor or when it is overwritten by move-assignment.
//   - A lease id is drawn from a process-wide counter on every acquire(), so it names one
//     buffer for one loan: the same buffer handed out again (or a new pin at a reused
//     address) gets a new id, and a witness of the old loan names nothing current.
//   - retire() (of a lease or of its raw buffer) accepts a witness only if it names the buffer's
//   current lease AND
//     no copy issued from that lease is still unobserved. A witness of one copy while
//     another copy from the same buffer is in flight is refused (vram::InvalidArgument;
//     the lease stays with the caller, intact; the refusal is counted).
//   - A witness is single-use: move-only, not trivially copyable (so std::bit_cast cannot
//     duplicate one), and moving it empties the source (lease 0 proves nothing). wait()
//     consumes its PendingCopy: a second wait() throws vram::InvalidArgument, so one copy
//     yields at most one witness.
//   - Only the copy layer can construct one: the constructor takes a detail::MintKey whose
//     constructor is private to PendingCopy. The only other key holder is the test escape
//     hatch vram::testing::WitnessMint (vram/testing/witness.hpp), which exists only when
//     VRAM_TESTING is defined and is not installed. Without VRAM_TESTING there is no
//     forward-declared friend a user could define instead
//     (tests/compile_fail/user_defined_minter.cpp); defining VRAM_TESTING in production
//     code is the explicit, greppable opt-in to the escape hatch. The key itself is neither
//     copyable nor trivially copyable, so std::bit_cast cannot conjure one
//     (tests/compile_fail/bit_cast_mint_key.cpp).
//   Limits: the guarantee is about copies issued through the lease. A copy the caller
//   issues by hand from staging.data() (cudaMemcpyAsync on the raw pointer, or
//   copy_to_device_async(dst, staging.data(), ...)) is invisible to the lease.
//
// Tests mint witnesses and host-fenced copies through vram/testing/witness.hpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

#include "vram/completion.hpp"
#include "vram/cuda/event.hpp"

namespace vram {

class PooledStaging;
class PendingCopy;
#ifdef VRAM_TESTING
namespace testing {
struct WitnessMint;  // defined only in the test-only vram/testing/witness.hpp
}
#endif

namespace detail {

struct StagingLease;  // the per-loan ledger (src/staging/staging_lease.hpp)

// Passkey: whoever can construct one can mint a witness. Its constructor is private and
// only the copy layer (PendingCopy) may call it; under VRAM_TESTING also the test minter.
// Not copyable or movable (a key travels only as a prvalue, by guaranteed elision) and not
// trivially copyable (user-provided destructor), so std::bit_cast<MintKey>(char{}) cannot
// forge one.
class MintKey {
  MintKey() = default;

 public:
  MintKey(const MintKey&) = delete;
  MintKey& operator=(const MintKey&) = delete;
  ~MintKey() {}  // NOLINT(modernize-use-equals-default): non-trivial on purpose

 private:
  friend class vram::PendingCopy;
#ifdef VRAM_TESTING
  friend struct vram::testing::WitnessMint;
#endif
};

// A host-side completion standing in for a copy's end event (test escape hatch only: a
// PendingCopy over one can only be made with a MintKey).
class HostFence {
 public:
  virtual ~HostFence() = default;
  virtual bool ready() const = 0;
  virtual void wait() = 0;
};

}  // namespace detail

// Single-use proof that the host observed the completion of copy `sequence()` issued from
// staging lease `lease()`. Move-only; a moved-from witness is empty and proves nothing.
class CopyCompleted {
 public:
  // Reachable only with a MintKey (the copy layer, or the test escape hatch).
  CopyCompleted(detail::MintKey, std::uint64_t lease, std::uint64_t sequence) noexcept
      : lease_(lease), sequence_(sequence) {}
  CopyCompleted(CopyCompleted&& other) noexcept
      : lease_(std::exchange(other.lease_, 0)), sequence_(std::exchange(other.sequence_, 0)) {}
  CopyCompleted& operator=(CopyCompleted&& other) noexcept {
    if (this != &other) {
      lease_ = std::exchange(other.lease_, 0);
      sequence_ = std::exchange(other.sequence_, 0);
    }
    return *this;
  }
  CopyCompleted(const CopyCompleted&) = delete;
  CopyCompleted& operator=(const CopyCompleted&) = delete;
  ~CopyCompleted() = default;

  // The staging lease the copy was issued from; 0 when empty (moved from) or when the copy
  // read raw host memory rather than a lease (such a witness retires nothing).
  std::uint64_t lease() const noexcept { return lease_; }
  // 1-based number of the copy within its lease (0: minted by the test escape hatch).
  std::uint64_t sequence() const noexcept { return sequence_; }
  explicit operator bool() const noexcept { return lease_ != 0; }

 private:
  std::uint64_t lease_ = 0;
  std::uint64_t sequence_ = 0;
};

struct CopyResult {
  CopyCompleted completed;
  float elapsed_ms;  // measured with CUDA events around the copy
};

// An enqueued copy. The witness comes only out of wait(), after the host saw the end
// event complete; ready() checks without blocking. wait() consumes the PendingCopy: a
// second wait() (or one on a moved-from PendingCopy) throws vram::InvalidArgument.
// Destroying or move-assigning over an unwaited PendingCopy first blocks until its copy
// ends (the source stays safe) and yields no witness; the copy still counts as observed
// complete on its lease. If that wait fails (device lost), the lease's buffer is leaked
// deliberately rather than freed or reused while the DMA may still read it.
class PendingCopy {
 public:
  PendingCopy(PendingCopy&& other) noexcept;
  PendingCopy& operator=(PendingCopy&& other) noexcept;
  PendingCopy(const PendingCopy&) = delete;
  PendingCopy& operator=(const PendingCopy&) = delete;
  ~PendingCopy();

  // True once the copy has completed (and for a consumed or moved-from PendingCopy).
  bool ready() const;
  // True until wait() consumed it or it was moved from.
  bool pending() const noexcept { return pending_; }
  [[nodiscard]] CopyCompleted wait() &&;
  // wait(), plus the copy's elapsed time from its CUDA events (0 for a host-fenced copy).
  [[nodiscard]] CopyResult wait_timed() &&;

  // Test escape hatch (needs a MintKey): a copy "issued" from `staging` that completes when
  // `fence` does, counted on the lease exactly like a real one.
  static PendingCopy host_fenced(detail::MintKey, PooledStaging& staging,
                                 std::unique_ptr<detail::HostFence> fence);

 private:
  friend PendingCopy copy_to_device_async(void*, const void*, std::size_t, cudaStream_t);
  friend PendingCopy copy_to_device_async(void*, PooledStaging&, std::size_t, std::size_t,
                                          cudaStream_t);
  PendingCopy() = default;
  // Waits for the copy (as the destructor must), records it complete on its lease, and
  // empties this object. Never throws.
  void abandon() noexcept;
  void mark_observed() noexcept;  // counts the copy complete on its lease
  void wait_fence();
  // Records the end event after a queued copy; on failure drains the stream, then throws.
  void record_end(cudaStream_t stream);
  static const std::shared_ptr<detail::StagingLease>& lease_of(PooledStaging& staging);

  std::shared_ptr<detail::StagingLease> lease_;  // null for a copy from raw memory
  std::uint64_t sequence_ = 0;
  std::optional<cuda::Event> start_;
  std::optional<cuda::Event> end_;
  std::unique_ptr<detail::HostFence> host_fence_;  // test escape hatch only
  bool pending_ = false;
};

// Raw host memory: the witness names no lease (retires nothing); the PendingCopy still
// keeps the source safe while it lives. Throws vram::InvalidArgument / vram::CudaError.
PendingCopy copy_to_device_async(void* device_destination, const void* host_source,
                                 std::size_t bytes, cudaStream_t stream);
// From a staging lease: [offset, offset + bytes) of source.bytes(), counted on the lease.
PendingCopy copy_to_device_async(void* device_destination, PooledStaging& source,
                                 std::size_t offset, std::size_t bytes, cudaStream_t stream);
// The whole of source.bytes().
PendingCopy copy_to_device_async(void* device_destination, PooledStaging& source,
                                 cudaStream_t stream);

// Queue the copy on `stream`, then block until it completed.
CopyResult copy_to_device(void* device_destination, const void* host_source, std::size_t bytes,
                          cudaStream_t stream);
CopyResult copy_to_device(void* device_destination, PooledStaging& source, cudaStream_t stream);

// A copy's completion is observed once, and its wait yields the witness.
static_assert(ConsumingCompletion<PendingCopy, CopyCompleted>);
static_assert(!Completion<PendingCopy>);  // no lvalue wait(): one copy, one witness

}  // namespace vram
