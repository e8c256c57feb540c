#include "deallocation_validation.hpp"

#include <cstdio>

namespace vram::detail {

void DeallocationValidation::record(void* block, std::size_t block_bytes) {
  std::lock_guard lock(mutex_);
  live_[block] = block_bytes;
}

bool DeallocationValidation::check(void* block, std::size_t block_bytes) noexcept {
  std::lock_guard lock(mutex_);
  auto it = live_.find(block);
  const char* problem = nullptr;
  if (it == live_.end()) {
    problem =
        "it was never handed out by this pool or was already deallocated (double deallocation)";
  } else if (it->second != block_bytes) {
    problem = "the byte count does not match the one it was allocated with";
  } else {
    live_.erase(it);
    return true;
  }
  count_rejected();
  std::fprintf(stderr,
               "vram::DevicePool: deallocation of %p (%zu block bytes) rejected: %s. The block was "
               "not cached.\n",
               block, block_bytes, problem);
  return false;
}

void DeallocationValidation::forget(void* block) noexcept {
  std::lock_guard lock(mutex_);
  live_.erase(block);
}

void DeallocationValidation::reject(const void* block, std::size_t bytes,
                                    const char* why) noexcept {
  count_rejected();
  char size[40] = "";
  if (bytes != 0) std::snprintf(size, sizeof size, " (%zu bytes)", bytes);
  std::fprintf(stderr,
               "vram::DevicePool: deallocation of %p%s rejected: %s. Nothing was deallocated. Fix: "
               "deallocate each block once, with the size it was allocated with, to the pool it "
               "came from.\n",
               block, size, why);
}

}  // namespace vram::detail
