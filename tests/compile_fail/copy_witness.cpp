// Must not compile: a witness is move-only, so one completed copy cannot retire two buffers.
#include "vram/pinned_staging_pool.hpp"

void misuse(vram::PooledStaging& a, vram::PendingCopy copy) {
  vram::CopyCompleted witness = std::move(copy).wait();
#ifdef VRAM_CONTROL
  vram::CopyCompleted second = std::move(witness);
#else
  vram::CopyCompleted second = witness;
#endif
  a.retire(std::move(second));
}
