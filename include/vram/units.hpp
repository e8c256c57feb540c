// vram/units.hpp: byte-size literals for readable configuration.
//
//   using namespace vram::literals;
//   vram::DevicePool::Options{.max_cached_bytes = 8_GiB};
#pragma once

#include <cstddef>

namespace vram::literals {
constexpr std::size_t operator""_KiB(unsigned long long n) { return std::size_t(n) << 10; }
constexpr std::size_t operator""_MiB(unsigned long long n) { return std::size_t(n) << 20; }
constexpr std::size_t operator""_GiB(unsigned long long n) { return std::size_t(n) << 30; }
}  // namespace vram::literals
