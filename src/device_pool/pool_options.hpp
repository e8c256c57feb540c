// src/device_pool/pool_options.hpp: how DevicePool turns its Options and upstream into the pieces
// it is built from (the large tier's memory, its reservation, the growth budget, the stream
// marker). Decided once, at construction; nothing here runs on an allocation.
#pragma once

#include <cstddef>
#include <memory>

#include "vram/device_pool.hpp"
#include "vram/stream_fence.hpp"
#include "vram/upstream.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::detail {

// small_tier.segment_max_bytes = 0 over virtual memory: small blocks above this are carved out
// of the large tier.
inline constexpr std::size_t kAutoSmallSegmentMax = std::size_t{256} << 10;
// small_tier.segment_max_bytes below this counts as this: from here on every small class is a
// multiple of the large tier's 512-byte rounding.
inline constexpr std::size_t kMinLargeTierBlock = 2048;

// The upstream the pool's tiers call: `upstream` itself, or with Options::observer an
// ObservedUpstream over it (platform/observed_memory.hpp). Every function below looks
// through that wrapper to the upstream given (underlying()).
std::shared_ptr<Upstream> observed_upstream(std::shared_ptr<Upstream> upstream,
                                            const DevicePoolOptions& options);

// What backs the large tier (Options::large_tier.memory): virtual memory, or null for
// segments from the upstream. With an observer it tells it of every map and unmap.
std::shared_ptr<VirtualMemory> make_virtual_memory(const DevicePoolOptions& options,
                                                   const std::shared_ptr<Upstream>& upstream);
// The virtual memory sleep tags use when the large tier has none: CUDA virtual memory on the
// device of vram's DeviceMemoryUpstream where supported (mapped for that device only), else
// null. Observed like the upstream.
std::shared_ptr<VirtualMemory> make_tag_virtual_memory(const Upstream& upstream);
// The most address space one reserved range of a pool may span (the large tier's, a sleep
// tag's): both keep a few words per 2 MiB granule (16 TiB: 8 Mi granules, about 200 MiB of
// host memory), far above any device's memory.
inline constexpr std::size_t kMaxReservationBytes = std::size_t{16} << 40;
// The address range a virtual-memory large tier reserves; throws vram::InvalidArgument above
// kMaxReservationBytes.
std::size_t reservation_for(const DevicePoolOptions& options, const Upstream& upstream);
// Options::growth_headroom as the tiers' fixed point (1024ths); throws vram::InvalidArgument
// for a negative or NaN headroom.
std::size_t growth_headroom_1024(double headroom);
// The stream marker of a pool whose options name none: CUDA events over device memory,
// "always complete" over any other upstream (host memory has no queued work).
std::shared_ptr<StreamFence> default_fence(const Upstream& upstream);

}  // namespace vram::detail
