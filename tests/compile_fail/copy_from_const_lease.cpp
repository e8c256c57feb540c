// Must not compile: a copy from a staging lease is counted on the lease, so it needs the
// lease itself (non-const), never a read-only view of it.
#include "vram/pinned_staging_pool.hpp"

vram::PendingCopy misuse(void* device, vram::PooledStaging& staging, cudaStream_t stream) {
#ifdef VRAM_CONTROL
  return vram::copy_to_device_async(device, staging, stream);
#else
  const vram::PooledStaging& view = staging;
  return vram::copy_to_device_async(device, view, stream);
#endif
}
