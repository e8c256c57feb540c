// vram/size_classes.hpp: the size-class rule of DevicePool.
//
// Rule: 4 classes per power of two. A request of n bytes gets the smallest class
//   max(256, 2^k + j * 2^(k-2)),  j in 1..4,  that is >= n.
// Classes: 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, ... up to 2^40 (1 TiB).
// Worst case internal waste: a request of 2^k + 1 bytes gets 1.25 * 2^k, so the waste is
// below 25% of the request for every n > 256 (and below 256 bytes for n <= 256). Every
// class of 8 MiB and above is a multiple of 2 MiB (the driver's large-page granularity),
// so large requests come out rounded to 2 MiB automatically.
//
//   auto index = vram::SizeClasses::index_for(1000);   // 8 -> class of 1024 bytes
//   vram::SizeClasses::bytes_of(index);                 // 1024
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

namespace vram {

struct SizeClasses {
  static constexpr std::size_t kMinBytes = 256;
  static constexpr unsigned kMinShift = 8;
  static constexpr unsigned kMaxShift = 40;
  static constexpr std::size_t kMaxBytes = std::size_t{1} << kMaxShift;
  static constexpr std::size_t kCount = (kMaxShift - kMinShift) * 4 + 1;

  // Class index for a request of `bytes` (1 .. kMaxBytes). Precondition checked by callers.
  static constexpr std::size_t index_for(std::size_t bytes) noexcept {
    if (bytes <= kMinBytes) return 0;
    const std::size_t m = bytes - 1;
    const unsigned k = static_cast<unsigned>(std::bit_width(m)) - 1;  // 2^k <= m < 2^(k+1)
    const std::size_t quarter = (m >> (k - 2)) & 3;
    return std::size_t{k - kMinShift} * 4 + quarter + 1;
  }

  static constexpr std::size_t bytes_of(std::size_t index) noexcept {
    if (index == 0) return kMinBytes;
    const unsigned k = static_cast<unsigned>((index - 1) / 4) + kMinShift;
    const std::size_t quarter = (index - 1) % 4;
    return (std::size_t{1} << k) + (quarter + 1) * (std::size_t{1} << (k - 2));
  }

  static constexpr std::size_t round_up(std::size_t bytes) noexcept {
    return bytes_of(index_for(bytes));
  }
};

static_assert(SizeClasses::bytes_of(SizeClasses::index_for(1)) == 256);
static_assert(SizeClasses::round_up(257) == 320);
static_assert(SizeClasses::round_up(1024) == 1024);
static_assert(SizeClasses::round_up(1025) == 1280);
static_assert(SizeClasses::bytes_of(SizeClasses::kCount - 1) == SizeClasses::kMaxBytes);

}  // namespace vram
