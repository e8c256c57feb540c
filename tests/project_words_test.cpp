// The tracked files speak of the software and its measurements: no line of any file git
// tracks (every file of the source tree without git) holds a word that describes how the
// work was organised.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "source_tree.hpp"

namespace vram::testing {
namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.rfind(prefix, 0) == 0;
}

// Every file git tracks under the source directory; without git (a copied tree), every file
// there but build*/ and .git.
std::filesystem::path source_root() {
  return std::filesystem::path(source_path("README.md")).parent_path();
}

std::vector<std::filesystem::path> tracked_files() {
  const std::filesystem::path root = source_root();
  std::vector<std::filesystem::path> files;
  const std::string command = "git -C '" + root.string() + "' ls-files -z 2>/dev/null";
  if (FILE* pipe = popen(command.c_str(), "r")) {
    std::string name;
    for (int c = std::fgetc(pipe); c != EOF; c = std::fgetc(pipe)) {
      if (c == '\0') {
        files.push_back(root / name);
        name.clear();
      } else {
        name += static_cast<char>(c);
      }
    }
    pclose(pipe);
  }
  if (!files.empty()) return files;
  for (auto it = std::filesystem::recursive_directory_iterator(root);
       it != std::filesystem::recursive_directory_iterator(); ++it) {
    const std::string name = it->path().filename().string();
    if (it->is_directory() && (name == ".git" || (it.depth() == 0 && starts_with(name, "build")))) {
      it.disable_recursion_pending();
    } else if (it->is_regular_file()) {
      files.push_back(it->path());
    }
  }
  return files;
}

// The words that describe how work was organised rather than the software, whole words,
// any case. Each pattern is built from pieces so that this file does not match itself.
const std::vector<std::regex>& process_words() {
  static const std::vector<std::regex> patterns = [] {
    const std::vector<std::string> sources = {
        std::string(R"(\bsess)") + R"(ions?\b)",
        std::string(R"(\bhelp)") + R"(er'?s? (review|found|said)\b)",
        std::string("host") + "ile review",
        std::string("read") + "-through",
        std::string("revi") + "ew[0-9]+",
        std::string(R"(\btur)") + R"(n's\b)",
        std::string(R"(\bthis )") + R"(turn\b)",
    };
    std::vector<std::regex> out;
    for (const auto& s : sources) {
      out.emplace_back(s, std::regex::ECMAScript | std::regex::icase);
    }
    return out;
  }();
  return patterns;
}

TEST(ProjectWords, NoProcessWordsInTheProject) {
  const auto files = tracked_files();
  ASSERT_FALSE(files.empty()) << "no files found under " << source_path("README.md");
  // Lines worth running the patterns on hold one of these (lower case).
  const std::vector<std::string> cues = {"sess", "help", "host", "read", "revi", "turn"};
  std::vector<std::string> hits;
  std::size_t scanned = 0;
  for (const auto& path : files) {
    std::ifstream file(path, std::ios::binary);
    if (!file) continue;  // listed by git, gone from the working tree
    std::stringstream content;
    content << file.rdbuf();
    const std::string text = content.str();
    if (text.find('\0') != std::string::npos) continue;  // binary (the .csv.gz traces)
    ++scanned;
    std::size_t number = 0;
    for (const auto& line : lines_of(text)) {
      ++number;
      std::string lower = line;
      std::transform(lower.begin(), lower.end(), lower.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      if (std::none_of(cues.begin(), cues.end(), [&](const std::string& cue) {
            return lower.find(cue) != std::string::npos;
          })) {
        continue;
      }
      for (const auto& pattern : process_words()) {
        std::smatch match;
        if (std::regex_search(line, match, pattern)) {
          hits.push_back(path.lexically_relative(source_root()).string() + ":" +
                         std::to_string(number) + ": " + match.str());
          break;
        }
      }
    }
  }
  EXPECT_GT(scanned, 10U);
  std::string report;
  for (std::size_t i = 0; i < hits.size() && i < 200; ++i) report += "  " + hits[i] + "\n";
  EXPECT_TRUE(hits.empty()) << hits.size() << " lines name how the work was organised:\n" << report;
}

}  // namespace
}  // namespace vram::testing
