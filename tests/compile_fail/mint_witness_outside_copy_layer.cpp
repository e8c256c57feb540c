// Must not compile: only the copy layer (PendingCopy::wait) can make a CopyCompleted.
#include "vram/pinned_staging_pool.hpp"

void misuse(vram::PooledStaging& staging, vram::PendingCopy copy) {
#ifdef VRAM_CONTROL
  vram::CopyCompleted forged = std::move(copy).wait();
#else
  vram::CopyCompleted forged(staging.data(), staging.len());
#endif
  staging.retire(std::move(forged));
}
