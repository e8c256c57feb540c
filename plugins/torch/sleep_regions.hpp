// sleep_regions.hpp: the plug-in's sleep and wake (vram_torch.h "Sleep and wake"): named
// tags of each device's pool, and the calling thread's open regions.
//
// Rules:
// - A region is a DevicePool::TagScope of the device's pool, kept on the calling thread's
//   stack: regions end in the reverse order they began (the exit of a region closes the
//   innermost one of the thread).
// - A tag is made by the first region that names it on a device and lives as long as the
//   pool; a later region of the same name must ask the same discardability.
// - Every function here returns 0 on success and -1 on error, with the reason kept as the
//   latest error (errors.hpp); none lets an exception out.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace vram_torch {

int region_enter(const char* tag, int discardable, int device) noexcept;
int region_exit() noexcept;
// `device` -1: every device whose pool has the tag (at least one must).
// `discard`: the contents are dropped even when the tag keeps a backup (uninitialised after
// wake).
int sleep_tag(const char* tag, int device, cudaStream_t stream, bool discard) noexcept;
int wake_tag(const char* tag, int device, cudaStream_t stream) noexcept;

}  // namespace vram_torch
