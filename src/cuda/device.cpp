#include "vram/cuda/device.hpp"

#include <cuda_runtime_api.h>

#include <fstream>
#include <string>

#include "vram/cuda/error.hpp"

namespace vram::cuda {
namespace {

std::string read_sysfs_line(const std::string& path) {
  std::ifstream file(path);
  std::string line;
  if (file) std::getline(file, line);
  return line;
}

std::string lower(std::string text) {
  for (char& c : text) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return text;
}

}  // namespace

DeviceAvailability Device::availability() noexcept {
  DeviceAvailability result;
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    int driver_version = 0;
    (void)cudaDriverGetVersion(&driver_version);
    int runtime_version = 0;
    (void)cudaRuntimeGetVersion(&runtime_version);
    if (status == cudaErrorInsufficientDriver && driver_version == 0) {
      result.reason = "no NVIDIA driver found (libcuda could not be loaded)";
    } else if (status == cudaErrorInsufficientDriver) {
      result.reason = "the NVIDIA driver supports CUDA " + version_string(driver_version) +
                      ", older than the CUDA runtime " + version_string(runtime_version) +
                      " vram was built with";
    } else {
      result.reason = std::string("no usable CUDA device: ") + cudaGetErrorString(status);
    }
    result.reason += std::string(" (") + cudaGetErrorName(status) + ")";
    result.error = status;
    return result;
  }
  result.count = count;
  if (count == 0) result.reason = "cudaGetDeviceCount reported 0 devices";
  return result;
}

int Device::count() noexcept { return availability().count; }

int Device::current() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

void Device::require_present(int ordinal, const char* who) {
  int count = 0;
  check(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (ordinal < 0 || ordinal >= count) {
    throw InvalidArgument(std::string(who) + ": device " + std::to_string(ordinal) +
                          " is not present (" + std::to_string(count) +
                          " visible). Fix: a device index below that; CUDA_VISIBLE_DEVICES "
                          "renumbers them.");
  }
}

bool Device::memory_pools_supported(int ordinal) {
  int supported = 0;
  check(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, ordinal),
        "cudaDeviceGetAttribute(cudaDevAttrMemoryPoolsSupported)");
  return supported != 0;
}

std::string Device::version_string(int cuda_version) {
  if (cuda_version <= 0) return "none";
  return std::to_string(cuda_version / 1000) + "." + std::to_string((cuda_version % 1000) / 10);
}

DeviceProperties Device::properties(int ordinal) {
  DeviceProperties p;
  p.ordinal = ordinal;
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, ordinal), "cudaGetDeviceProperties");
  p.name = prop.name;
  p.compute_major = prop.major;
  p.compute_minor = prop.minor;
  p.multiprocessors = prop.multiProcessorCount;
  p.total_memory_bytes = prop.totalGlobalMem;
  p.l2_cache_bytes = static_cast<std::size_t>(prop.l2CacheSize);
  p.copy_engines = prop.asyncEngineCount;
  p.unified_addressing = prop.unifiedAddressing != 0;
  p.memory_pools_supported = memory_pools_supported(ordinal);
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, ordinal) == cudaSuccess) {
    p.pci_bus_id = lower(bus_id);
    const std::string dir = "/sys/bus/pci/devices/" + p.pci_bus_id + "/";
    p.pcie_link_speed = read_sysfs_line(dir + "current_link_speed");
    p.pcie_link_width = read_sysfs_line(dir + "current_link_width");
    p.pcie_max_link_speed = read_sysfs_line(dir + "max_link_speed");
  } else {
    (void)cudaGetLastError();
  }
  {
    DeviceGuard guard(ordinal);
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
    p.free_memory_bytes = free_bytes;
  }
  (void)cudaDriverGetVersion(&p.driver_version);
  (void)cudaRuntimeGetVersion(&p.runtime_version);
  return p;
}

DeviceGuard::DeviceGuard(int ordinal) {
  check(cudaGetDevice(&previous_), "cudaGetDevice");
  if (previous_ != ordinal) {
    check(cudaSetDevice(ordinal), "cudaSetDevice");
    changed_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (changed_ && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace vram::cuda
