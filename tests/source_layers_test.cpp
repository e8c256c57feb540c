// The layer rule of src/ (src/README.md): each folder includes only the folders below it,
// and no folder but these holds library sources.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "source_tree.hpp"

namespace {

using vram::testing::source_path;

// Bottom up; folders of one rank do not include each other.
const std::map<std::string, int> kRank = {
    {"cuda", 0},    {"platform", 1}, {"tier", 2}, {"device_pool", 3}, {"stream_ordered_pool", 3},
    {"staging", 4}, {"pager", 5},
};

TEST(SourceLayers, EachFolderIncludesOnlyTheFoldersBelowIt) {
  const std::regex include(R"(^\s*#\s*include\s+"([A-Za-z0-9_]+)/[^"]+")");
  const std::filesystem::path base = source_path("src");
  ASSERT_TRUE(std::filesystem::is_directory(base)) << base;
  std::vector<std::string> found;
  std::size_t files = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(base)) {
    if (!entry.is_regular_file()) continue;
    const std::string ext = entry.path().extension().string();
    if (ext != ".cpp" && ext != ".hpp") continue;
    const std::filesystem::path relative = entry.path().lexically_relative(base);
    const std::string folder = relative.begin()->string();
    const auto rank = kRank.find(folder);
    if (rank == kRank.end()) {
      found.push_back(relative.generic_string() + ": outside the layer folders");
      continue;
    }
    ++files;
    std::ifstream in(entry.path());
    std::string line;
    for (int number = 1; std::getline(in, line); ++number) {
      std::smatch match;
      if (!std::regex_search(line, match, include)) continue;
      const auto target = kRank.find(match[1].str());
      if (target == kRank.end()) continue;  // not a src/ folder (vram/..., a system header)
      if (target->first != folder && target->second >= rank->second) {
        found.push_back(relative.generic_string() + ":" + std::to_string(number) + ": " + line);
      }
    }
  }
  EXPECT_GT(files, 50U);
  std::string report;
  for (const auto& f : found) report += f + "\n";
  EXPECT_TRUE(found.empty()) << found.size() << " includes against the layers:\n" << report;
}

}  // namespace
