// Must not compile: release() takes the witness by value and a witness is move-only, so one
// witness cannot be handed to release() and still be kept for a second buffer.
#include "vram/pinned_staging_pool.hpp"

void misuse(vram::PinnedStagingPool& pool, vram::PooledStaging& staging, vram::PendingCopy copy) {
  vram::CopyCompleted witness = std::move(copy).wait();
#ifdef VRAM_CONTROL
  pool.release(staging.into_inner(), std::move(witness));
#else
  pool.release(staging.into_inner(), witness);
#endif
}
