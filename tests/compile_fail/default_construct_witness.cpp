// Must not compile: a witness cannot be default-constructed (an "empty" witness proves
// nothing, but neither can it be declared and later filled by a forged assignment).
#include "vram/pinned_staging_pool.hpp"

void misuse(vram::PooledStaging& staging, vram::PendingCopy copy) {
#ifdef VRAM_CONTROL
  vram::CopyCompleted witness = std::move(copy).wait();
#else
  (void)copy;
  vram::CopyCompleted witness;
#endif
  staging.retire(std::move(witness));
}
