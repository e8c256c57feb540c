// configuration.hpp: the options of a device's pool, from vram_torch_configure and the
// environment, read when the pool is made (vram_torch.h lists the variables).
//
// Rules:
// - A value that cannot be parsed is reported on stderr and the default is kept; it never
//   fails the allocation that makes the pool.
// - A max cached bytes set through vram_torch_configure wins over
//   VRAM_TORCH_MAX_CACHED_BYTES; with neither, the cache is unbounded, as PyTorch's caching
//   allocator keeps freed memory until empty_cache() or an out-of-memory retry.
#pragma once

#include <cstddef>

#include "vram/device_pool.hpp"

namespace vram_torch {

// A decimal byte count with an optional suffix K, M or G (powers of 1024); 0 for null,
// empty or unparsable text.
std::size_t parse_bytes(const char* text) noexcept;

// The pool's options: `configured_max_cached_bytes` (0: the environment's, else unbounded),
// VRAM_TORCH_VIRTUAL_MEMORY and VRAM_TORCH_GROWTH_HEADROOM.
vram::DevicePool::Options pool_options(std::size_t configured_max_cached_bytes);

}  // namespace vram_torch
