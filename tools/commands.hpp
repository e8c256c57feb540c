// The CLI's sub-commands. Each returns the process exit code.
#pragma once

#include <string>
#include <vector>

namespace vram::cli {
int run_info(const std::vector<std::string>& args);
int run_bench(const std::vector<std::string>& args);
int run_replay(const std::vector<std::string>& args);
}  // namespace vram::cli
