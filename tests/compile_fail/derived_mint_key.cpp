// Must not compile: deriving from the witness's passkey does not give access to its private
// constructor (aggregate initialisation of the derived key still calls it), and a derived
// key cannot be sliced into a MintKey parameter (not copyable or movable).
#include "vram/pinned_staging_pool.hpp"

struct Forged : vram::detail::MintKey {};

vram::CopyCompleted forge(const vram::PooledStaging& staging, vram::PendingCopy copy) {
#ifdef VRAM_CONTROL
  (void)staging;
  return std::move(copy).wait();
#else
  (void)copy;
  return vram::CopyCompleted(Forged{}, staging.lease_id(), 1);
#endif
}
