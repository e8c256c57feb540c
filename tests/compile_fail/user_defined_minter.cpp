// Must not compile: a user who defines a minter of their own (here under the very name of
// the test escape hatch) gets no access to the witness's MintKey. Only the test-only header,
// with VRAM_TESTING defined, can mint (the control).
#ifdef VRAM_CONTROL
#define VRAM_TESTING
#include "vram/testing/witness.hpp"
#else
#include "vram/pinned_staging_pool.hpp"
namespace vram::testing {
struct WitnessMint {
  static CopyCompleted completed_copy_of(const PooledStaging& staging) {
    return CopyCompleted(detail::MintKey{}, staging.lease_id(), 0);
  }
};
}  // namespace vram::testing
#endif

vram::CopyCompleted forge(const vram::PooledStaging& staging) {
  return vram::testing::WitnessMint::completed_copy_of(staging);
}
