// Must not compile: a pool lease is move-only (two owners would release one block twice).
#include "vram/device_pool.hpp"

void misuse(vram::DevicePool& pool) {
  auto lease = pool.acquire(256);
#ifdef VRAM_CONTROL
  vram::DevicePool::Lease other = std::move(lease);
#else
  vram::DevicePool::Lease other = lease;
#endif
}
