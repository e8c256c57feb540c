// The CLI's sub-commands. Each returns the process exit code (0 done, 1 run-time failure,
// 2 bad usage; `vram bench` adds 3: nothing measured).
#pragma once

#include <string>
#include <vector>

namespace vram::cli {
int run_info(const std::vector<std::string>& args);
int run_bench(const std::vector<std::string>& args);
int run_replay(const std::vector<std::string>& args);

// "vram 0.1.0 (commit ..., CUDA runtime 13.0, static)".
std::string version_text();
// Why no CUDA device is usable, in the library's words, with its "Fix:" hint: e.g. "no
// NVIDIA driver found (cudaErrorInsufficientDriver). Fix: ...". Only meaningful when
// vram::cuda::Device::count() == 0.
std::string no_device_explanation();
}  // namespace vram::cli
