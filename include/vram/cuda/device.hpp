// vram/cuda/device.hpp: device discovery, properties and a scoped current-device guard.
//
//   if (vram::cuda::Device::count() == 0) {
//     std::puts(vram::cuda::Device::availability().reason.c_str());  // why there is none
//   }
//   auto props = vram::cuda::Device::properties(0);
//   vram::cuda::DeviceGuard guard(props.ordinal);  // current device until scope exit
#pragma once

#include <cstddef>
#include <string>

namespace vram::cuda {

struct DeviceAvailability {
  int count = 0;       // visible devices; 0 when there is no device or no usable driver
  std::string reason;  // empty when count > 0; otherwise the CUDA error that said why
  int error = 0;       // that cudaError_t (cudaSuccess when the driver counted the devices)
};

struct DeviceProperties {
  int ordinal = 0;
  std::string name;
  int compute_major = 0;
  int compute_minor = 0;
  int multiprocessors = 0;
  std::size_t total_memory_bytes = 0;
  std::size_t free_memory_bytes = 0;
  std::size_t l2_cache_bytes = 0;
  bool memory_pools_supported = false;
  int copy_engines = 0;  // cudaDevAttrAsyncEngineCount
  bool unified_addressing = false;
  std::string pci_bus_id;  // "0000:3b:00.0"
  // PCIe link as Linux sysfs reports it for that bus id ("32.0 GT/s PCIe", "16"); empty
  // where it cannot be read (the CUDA runtime itself does not report the link).
  std::string pcie_link_speed;
  std::string pcie_link_width;
  std::string pcie_max_link_speed;
  int driver_version = 0;   // cudaDriverGetVersion, e.g. 13000
  int runtime_version = 0;  // cudaRuntimeGetVersion
};

class Device {
 public:
  // Number of visible devices; 0 (not an exception) without a device or driver.
  static int count() noexcept;
  static DeviceAvailability availability() noexcept;
  // Throws vram::CudaError (cudaErrorInvalidDevice with a Fix hint) for a bad ordinal.
  static DeviceProperties properties(int ordinal);
  static int current();
  // Throws vram::InvalidArgument naming `who` when `ordinal` is not a visible device, and
  // vram::CudaError when the devices cannot be counted (no driver).
  static void require_present(int ordinal, const char* who);
  // Whether the device's driver supports stream-ordered memory pools.
  static bool memory_pools_supported(int ordinal);
  // Runtime and driver versions as "13.0"; "none" where no driver is installed.
  static std::string version_string(int cuda_version);
};

// Makes `ordinal` the calling thread's current device; restores the previous one on
// destruction (noexcept; a shut-down runtime is tolerated).
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool changed_ = false;
};

}  // namespace vram::cuda
