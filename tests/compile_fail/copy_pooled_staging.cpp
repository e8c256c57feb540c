// Must not compile: a borrowed staging buffer is move-only.
#include "vram/pinned_staging_pool.hpp"

void misuse(vram::PinnedStagingPool& pool) {
  auto staging = pool.acquire(4096);
#ifdef VRAM_CONTROL
  vram::PooledStaging other = std::move(staging);
#else
  vram::PooledStaging other = staging;
#endif
}
