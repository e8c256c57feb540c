#include "configuration.hpp"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace vram_torch {

std::size_t parse_bytes(const char* text) noexcept {
  if (text == nullptr || *text == '\0') return 0;
  // strtoull negates after a '-': "-1" would read as the largest value.
  const char* digits = text;
  while (*digits == ' ' || (*digits >= '\t' && *digits <= '\r')) ++digits;
  if (*digits == '-') return 0;
  errno = 0;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(digits, &end, 10);
  if (errno != 0 || end == digits) return 0;
  std::size_t scale = 1;
  switch (*end) {
    case 'k':
    case 'K':
      scale = std::size_t{1} << 10;
      break;
    case 'm':
    case 'M':
      scale = std::size_t{1} << 20;
      break;
    case 'g':
    case 'G':
      scale = std::size_t{1} << 30;
      break;
    default:
      break;
  }
  if (static_cast<std::size_t>(value) > SIZE_MAX / scale) return 0;  // past the address space
  return static_cast<std::size_t>(value) * scale;
}

vram::DevicePool::Options pool_options(std::size_t configured_max_cached_bytes) {
  vram::DevicePool::Options options;
  // A bound makes the pool give memory back during the run, and each cudaFree synchronizes
  // the device: unbounded unless asked for.
  options.max_cached_bytes = SIZE_MAX;
  // A capture PyTorch's hooks do not name (a raw cudaStreamBeginCapture in an extension)
  // still keeps its blocks apart: one driver query per call, small beside PyTorch's own.
  options.detect_unscoped_capture = true;
  std::size_t max_cached = configured_max_cached_bytes;
  if (max_cached == 0) {
    const char* text = std::getenv("VRAM_TORCH_MAX_CACHED_BYTES");
    max_cached = parse_bytes(text);
    if (max_cached == 0 && text != nullptr && std::strpbrk(text, "123456789") != nullptr) {
      std::fprintf(stderr,
                   "vram_torch: VRAM_TORCH_MAX_CACHED_BYTES=%s is not a byte count below "
                   "16 EiB (digits, optional K/M/G): the cache stays unbounded\n",
                   text);
    }
  }
  if (max_cached != 0) options.max_cached_bytes = max_cached;
  // The pool's default: large blocks over one virtual address range mapped in runs of 2 MiB
  // granules where the device supports it (else cudaMalloc segments): free ranges merge
  // across what would be segment boundaries, so a new shape fits in memory already mapped
  // instead of a new segment, and nothing is given back during the run (no cudaFree, no
  // device synchronize). CUDA IPC cannot share this memory, as with PyTorch's own
  // expandable segments. VRAM_TORCH_VIRTUAL_MEMORY=0 selects cudaMalloc segments (then
  // torch.multiprocessing shares CUDA tensors: ipc.cpp).
  if (const char* text = std::getenv("VRAM_TORCH_VIRTUAL_MEMORY")) {
    const std::string value(text);
    if (value == "0" || value == "false" || value == "off" || value == "no") {
      options.large_tier.memory = vram::LargeTierMemory::segments;
    } else if (!(value == "1" || value == "true" || value == "on" || value == "yes")) {
      std::fprintf(stderr,
                   "vram_torch: VRAM_TORCH_VIRTUAL_MEMORY=%s is not 0/1 (false/true, off/on, "
                   "no/yes): the default (virtual memory where supported) is used\n",
                   text);
    }
  }
  // Segments: reserved may pass each tier's peak in use by this fraction before growing
  // gives wholly free segments back (vram::DevicePool::Options::growth_headroom).
  if (const char* text = std::getenv("VRAM_TORCH_GROWTH_HEADROOM")) {
    char* end = nullptr;
    const double value = std::strtod(text, &end);
    if (end != text && *end == '\0' && value >= 0) {  // NaN fails value >= 0
      options.growth_headroom = value;
    } else {
      std::fprintf(stderr,
                   "vram_torch: VRAM_TORCH_GROWTH_HEADROOM=%s is not a number >= 0 (e.g. "
                   "0.0625 or 0.5): the default 1/16 is used\n",
                   text);
    }
  }
  return options;
}

}  // namespace vram_torch
