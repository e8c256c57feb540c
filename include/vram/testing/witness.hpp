// vram/testing/witness.hpp: TEST-ONLY escape hatch of the copy layer. Not installed; refuses
// to compile unless VRAM_TESTING is defined. It mints CopyCompleted witnesses without a copy
// and issues host-fenced "copies", so the staging pool's rules can be tested over plain
// host memory. Production code must never include it: a witness that no copy earned
// defeats the reuse-after-completion guarantee.
//
// Even a minted witness cannot retire a buffer with a copy in flight: the pool also checks
// the lease's own count of unobserved copies, which this header cannot change.
#pragma once

#ifndef VRAM_TESTING
#error "vram/testing/witness.hpp is test-only: define VRAM_TESTING in a test target to use it"
#endif

#include <memory>
#include <utility>

#include "vram/completion.hpp"
#include "vram/copy.hpp"
#include "vram/pinned_staging_pool.hpp"

namespace vram::testing {

struct WitnessMint {
  // A witness naming the current lease of `staging` / `buffer` (sequence 0), as if its
  // copies had completed. The lease id is read, not changed.
  static CopyCompleted completed_copy_of(const PooledStaging& staging) noexcept {
    return CopyCompleted(detail::MintKey{}, staging.lease_id(), 0);
  }
  static CopyCompleted completed_copy_of(const PinnedBuffer& buffer) noexcept {
    return CopyCompleted(detail::MintKey{}, buffer.lease_id(), 0);
  }
  // A witness naming an arbitrary lease id (for stale/forged-id cases).
  static CopyCompleted completed_copy_of_lease(std::uint64_t lease) noexcept {
    return CopyCompleted(detail::MintKey{}, lease, 0);
  }

  // A "copy" issued from `staging` and counted on its lease, complete when `fence` is.
  template <Completion Fence>
  static PendingCopy host_copy(PooledStaging& staging, Fence fence) {
    struct Adapter final : detail::HostFence {
      explicit Adapter(Fence f) : fence(std::move(f)) {}
      bool ready() const override { return static_cast<bool>(fence.ready()); }
      void wait() override { fence.wait(); }
      Fence fence;
    };
    return PendingCopy::host_fenced(detail::MintKey{}, staging,
                                    std::make_unique<Adapter>(std::move(fence)));
  }
};

}  // namespace vram::testing
