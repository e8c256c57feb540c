// Must not compile: only the copy layer (PendingCopy::wait) can make a CopyCompleted; the
// constructor needs a detail::MintKey, whose constructor is private to the copy layer.
#include "vram/pinned_staging_pool.hpp"

void misuse(vram::PooledStaging& staging, vram::PendingCopy copy) {
#ifdef VRAM_CONTROL
  vram::CopyCompleted forged = std::move(copy).wait();
#else
  vram::CopyCompleted forged({}, staging.lease_id(), 1);
#endif
  staging.retire(std::move(forged));
}
