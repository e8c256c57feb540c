// Must not compile: a staging buffer cannot go back to the pool without a CopyCompleted.
#include "vram/pinned_staging_pool.hpp"

void misuse(vram::PinnedStagingPool& pool, vram::PendingCopy copy) {
  auto staging = pool.acquire(4096);
#ifdef VRAM_CONTROL
  staging.retire(std::move(copy).wait());
#else
  staging.retire();
#endif
}
