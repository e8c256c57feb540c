#include "cuda/host_registration.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "cuda/memory.hpp"
#include "cuda/status.hpp"

namespace vram::cuda {
namespace {

constexpr std::uintptr_t kPage = 4096;

}  // namespace

std::string memlock_limit_text() {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return "unknown";
  if (limit.rlim_cur == RLIM_INFINITY) return "unlimited";
  return std::to_string(limit.rlim_cur) + " bytes";
}

std::string pin_failure_text(const char* call, cudaError_t status, std::size_t bytes) {
  return std::string(call) + " of " + std::to_string(bytes) + " bytes returned " +
         error_text(status) + "; RLIMIT_MEMLOCK is " + memlock_limit_text();
}

std::optional<PinFailure> register_host_pages(std::span<const HostRange> ranges,
                                              std::size_t chunk_bytes,
                                              std::vector<HostRegistration>& registered) {
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> pages;  // [begin, end)
  pages.reserve(ranges.size());
  for (const auto& range : ranges) {
    const auto data = reinterpret_cast<std::uintptr_t>(range.data);
    pages.emplace_back(data / kPage * kPage, (data + range.bytes + kPage - 1) / kPage * kPage);
  }
  std::sort(pages.begin(), pages.end());
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> merged;
  for (const auto& range : pages) {
    if (!merged.empty() && range.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, range.second);
    } else {
      merged.push_back(range);
    }
  }
  for (const auto& [begin, end] : merged) {
    const std::size_t chunk =
        chunk_bytes == 0 ? end - begin : std::max<std::size_t>(kPage, chunk_bytes / kPage * kPage);
    for (std::uintptr_t at = begin; at < end; at += chunk) {
      const std::size_t length = std::min<std::size_t>(chunk, end - at);
      void* pointer = reinterpret_cast<void*>(at);
      const cudaError_t status = try_register_host(pointer, length);
      if (status != cudaSuccess) {
        return PinFailure{status, pin_failure_text("cudaHostRegister", status, length)};
      }
      registered.push_back({pointer, length});
    }
  }
  return std::nullopt;
}

void unregister_host_pages(std::vector<HostRegistration>& registered) noexcept {
  for (const auto& registration : registered) unregister_host(registration.pointer);
  registered.clear();
}

}  // namespace vram::cuda
