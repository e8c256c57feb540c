// Where the tests find files of the source tree (README.md, examples/, tests/data/).
// The path compiled in (VRAM_SOURCE_DIR) is the build machine's; on another machine (the
// GPU machine runs the binary from the repository root) the current directory is used.
#pragma once

#include <filesystem>
#include <string>

namespace vram::testing {

inline std::string source_path(const std::string& relative) {
  const std::filesystem::path built = std::filesystem::path(VRAM_SOURCE_DIR) / relative;
  if (std::filesystem::exists(built)) return built.string();
  return (std::filesystem::current_path() / relative).string();
}

}  // namespace vram::testing
