// Must not compile: a raw PinnedBuffer (a hand-made one, or one from into_inner()) cannot be
// turned back into a PooledStaging lease, whose retire() would then reach the free list.
#include "vram/pinned_staging_pool.hpp"

void misuse(vram::PinnedBuffer raw) {
#ifdef VRAM_CONTROL
  vram::PinnedBuffer other = std::move(raw);
#else
  vram::PooledStaging other = std::move(raw);
#endif
  (void)other;
}
