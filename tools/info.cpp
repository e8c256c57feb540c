// `vram info`: what a user needs to know about the visible devices before picking a pool.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>
#include <vector>

#include "commands.hpp"
#include "replay/trace.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/driver_api.hpp"
#include "vram/cuda/error.hpp"
#include "vram/detail/asymmetric_barrier.hpp"
#include "vram/pinned_host_upstream.hpp"
#include "vram/virtual_memory.hpp"
#include "vram_git_commit.hpp"

namespace vram::cli {

std::string version_text() {
  int runtime_version = 0;
  (void)cudaRuntimeGetVersion(&runtime_version);
  return std::string("vram ") + VRAM_VERSION + " (commit " + VRAM_GIT_COMMIT + ", CUDA runtime " +
         cuda::Device::version_string(runtime_version) + ", static)";
}

std::string no_device_explanation() {
  const auto availability = cuda::Device::availability();
  if (availability.count > 0) return "a CUDA device is visible";
  std::string text = availability.reason;
  const auto status = static_cast<cudaError_t>(availability.error);
  const auto fix = cuda::fix_hint(status == cudaSuccess ? cudaErrorNoDevice : status);
  if (!fix.empty()) text += ". " + std::string(fix);
  return text;
}

namespace {

void print_info_usage(std::FILE* out) {
  std::fprintf(out,
               "usage: vram info\n"
               "  Prints the CUDA runtime and driver versions and, per visible device, its\n"
               "  memory, memory-pool and virtual-memory support, copy engines and PCIe link;\n"
               "  without a usable device, why not and how to fix it.\n"
               "  -h, --help  this text\n"
               "  Exit status: 0 done (with or without a device), 2 bad usage.\n");
}

}  // namespace

int run_info(const std::vector<std::string>& args) {
  if (args.size() == 1 && (args[0] == "--help" || args[0] == "-h")) {
    print_info_usage(stdout);
    return 0;
  }
  if (!args.empty()) {
    std::fprintf(stderr, "vram info: takes no arguments, got '%s'\n",
                 replay::printable(args[0]).c_str());
    print_info_usage(stderr);
    return 2;
  }
  int runtime_version = 0;
  (void)cudaRuntimeGetVersion(&runtime_version);
  const auto availability = cuda::Device::availability();
  if (availability.count == 0) {
    std::printf("%s\nvram info: %s\n", version_text().c_str(), no_device_explanation().c_str());
    return 0;
  }
  int driver_version = 0;
  (void)cudaDriverGetVersion(&driver_version);
  const auto& api = cuda::driver_api();
  std::printf(
      "CUDA runtime %s (static), driver supports CUDA %s, stream-ordered pool entry "
      "points %s\n",
      cuda::Device::version_string(runtime_version).c_str(),
      cuda::Device::version_string(driver_version).c_str(),
      api.mem_alloc_from_pool_async.function != nullptr ? "resolved" : "missing");
  std::printf("host: RLIMIT_MEMLOCK %s\n", memlock_limit_text().c_str());
  std::printf("host: DevicePool thread-cache handshake %s\n",
              vram::detail::asymmetric_barrier_mode());
  for (int ordinal = 0; ordinal < availability.count; ++ordinal) {
    const auto p = cuda::Device::properties(ordinal);
    const double gib = 1024.0 * 1024.0 * 1024.0;
    std::printf("device %d: %s\n", ordinal, p.name.c_str());
    std::printf("  compute capability  %d.%d, %d multiprocessors, L2 %.0f MiB\n", p.compute_major,
                p.compute_minor, p.multiprocessors,
                static_cast<double>(p.l2_cache_bytes) / (1024.0 * 1024.0));
    std::printf("  memory              %.1f GiB total, %.1f GiB free\n",
                static_cast<double>(p.total_memory_bytes) / gib,
                static_cast<double>(p.free_memory_bytes) / gib);
    std::printf("  memory pools        %s\n", p.memory_pools_supported
                                                  ? "supported (StreamOrderedPool available)"
                                                  : "NOT supported (use DevicePool)");
    std::printf("  virtual memory      %s\n",
                CudaVirtualMemory::supported(ordinal)
                    ? "supported (DevicePool's large tier runs over it by default unless "
                      "another device has peer access to this one)"
                    : "NOT supported (DevicePool's large tier uses cudaMalloc segments)");
    std::printf("  copy engines        %d\n", p.copy_engines);
    std::printf("  PCI bus             %s\n", p.pci_bus_id.c_str());
    if (!p.pcie_link_speed.empty()) {
      std::printf("  PCIe link           %s x%s (max %s)\n", p.pcie_link_speed.c_str(),
                  p.pcie_link_width.c_str(), p.pcie_max_link_speed.c_str());
    } else {
      std::printf("  PCIe link           not reported (no sysfs entry for this bus id)\n");
    }
  }
  return 0;
}

}  // namespace vram::cli
