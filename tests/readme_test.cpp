// The README shows what the repository holds: its code snippets are the marked regions of
// the programs in examples/ (built by CI from the installed package), and its results table
// is the headline table of bench/RESULTS.md, each row a verdict line of the latest result in
// the section of RESULTS.md it links to. No figure is typed in this test: all come from the
// two files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "source_tree.hpp"

namespace vram::testing {
namespace {

std::string read_source(const std::string& relative) {
  std::ifstream file(source_path(relative), std::ios::binary);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

std::string trim(const std::string& text) {
  const auto begin = text.find_first_not_of(" \t");
  if (begin == std::string::npos) return {};
  return text.substr(begin, text.find_last_not_of(" \t") - begin + 1);
}

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.rfind(prefix, 0) == 0;
}

// The lines between `// [readme:NAME]` and `// [/readme:NAME]`, common indentation removed.
std::string example_region(const std::string& path, const std::string& name) {
  const auto lines = lines_of(read_source(path));
  std::vector<std::string> body;
  bool inside = false;
  for (const auto& line : lines) {
    if (trim(line) == "// [/readme:" + name + "]") break;
    if (inside) body.push_back(line);
    if (trim(line) == "// [readme:" + name + "]") inside = true;
  }
  std::size_t indent = std::string::npos;
  for (const auto& line : body) {
    if (!trim(line).empty()) indent = std::min(indent, line.find_first_not_of(' '));
  }
  std::string out;
  for (const auto& line : body) out += (line.size() > indent ? line.substr(indent) : "") + "\n";
  return out;
}

TEST(Readme, SnippetsAreTheExamplesAsTheyAre) {
  const auto readme = lines_of(read_source("README.md"));
  ASSERT_FALSE(readme.empty()) << "README.md not found at " << source_path("README.md");
  const std::regex marker(R"(<!-- snippet: (\S+) (\S+) -->)");
  std::set<std::string> seen;
  for (std::size_t i = 0; i < readme.size(); ++i) {
    std::smatch match;
    if (!std::regex_match(readme[i], match, marker)) continue;
    const std::string path = match[1];
    const std::string name = match[2];
    ASSERT_LT(i + 1, readme.size());
    ASSERT_EQ(readme[i + 1], "```cpp") << "snippet " << name << " must follow its marker";
    std::string block;
    std::size_t j = i + 2;
    for (; j < readme.size() && readme[j] != "```"; ++j) block += readme[j] + "\n";
    ASSERT_LT(j, readme.size()) << "unterminated code block for " << name;
    const std::string region = example_region(path, name);
    ASSERT_FALSE(trim(region).empty()) << path << " has no region " << name;
    EXPECT_EQ(block, region) << "README snippet " << name << " differs from " << path;
    seen.insert(name);
  }
  for (const char* name :
       {"device_pool", "stream_ordered_pool", "pinned_staging_pool", "weight_pager"}) {
    EXPECT_TRUE(seen.count(name)) << "README lacks the snippet " << name;
  }
}

// The CI script (.ci/run) takes the two set-up commands from these lines of README.md.
const std::regex& main_job_line() {
  static const std::regex line(R"(^    cmake -S \. -B build .*-DVRAM_BUILD_TESTS=OFF.*)");
  return line;
}
const std::regex& test_command_line() {
  static const std::regex line(R"(^    cmake -S \. -B build .*-DVRAM_BUILD_TESTS=ON.*)");
  return line;
}

// A newcomer's first screen says what vram is, how to build it and where the numbers are;
// the README stays a page (the measurements live in bench/RESULTS.md).
TEST(Readme, FirstScreenSaysWhatHowAndWhereTheNumbersAre) {
  const auto readme = lines_of(read_source("README.md"));
  ASSERT_FALSE(readme.empty());
  const std::size_t screen = std::min<std::size_t>(readme.size(), 40);
  bool what = false, main_job = false, tests = false, numbers = false;
  for (std::size_t i = 0; i < screen; ++i) {
    what = what || starts_with(readme[i], "vram is ");
    main_job = main_job || std::regex_match(readme[i], main_job_line());
    tests = tests || std::regex_match(readme[i], test_command_line());
    numbers = numbers || readme[i].find("(bench/RESULTS.md") != std::string::npos;
  }
  EXPECT_TRUE(what) << "the first screen does not say what vram is (a line 'vram is ...')";
  EXPECT_TRUE(main_job) << "the first screen lacks the main job's command line";
  EXPECT_TRUE(tests) << "the first screen lacks the test command line";
  EXPECT_TRUE(numbers) << "the first screen does not link bench/RESULTS.md";
  EXPECT_LE(readme.size(), 150U) << "README.md is " << readme.size() << " lines";
}

// ---- headline table ---------------------------------------------------------------------

std::string headline_block(const std::string& text) {
  const std::string begin = "<!-- headline:";
  const std::string end = "<!-- /headline -->";
  const auto b = text.find(begin);
  const auto e = text.find(end);
  if (b == std::string::npos || e == std::string::npos || e < b) return {};
  return text.substr(b, e - b);
}

std::string replace_all(std::string text, const std::string& from, const std::string& to) {
  for (auto at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
  }
  return text;
}

std::vector<std::string> cells_of(const std::string& row) {
  std::vector<std::string> cells;
  if (!starts_with(row, "|")) return cells;
  std::stringstream stream(row.substr(1));
  for (std::string cell; std::getline(stream, cell, '|');) cells.push_back(trim(cell));
  return cells;
}

// GitHub's anchor of a heading: lower case, spaces to '-', other punctuation dropped.
std::string anchor_of(const std::string& heading) {
  std::string out;
  for (const char c : heading) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalnum(u) || c == '-' || c == '_') {
      out += static_cast<char>(std::tolower(u));
    } else if (c == ' ') {
      out += '-';
    }
  }
  return out;
}

// The part of a `## ` section of RESULTS.md before its `### History`: its latest result.
std::optional<std::vector<std::string>> latest_part(const std::vector<std::string>& results,
                                                    const std::string& anchor) {
  for (std::size_t i = 0; i < results.size(); ++i) {
    if (!starts_with(results[i], "## ") || anchor_of(results[i].substr(3)) != anchor) continue;
    std::vector<std::string> part;
    for (std::size_t j = i + 1; j < results.size(); ++j) {
      if (starts_with(results[j], "## ") || starts_with(results[j], "### History")) break;
      part.push_back(results[j]);
    }
    return part;
  }
  return std::nullopt;
}

bool is_number(const std::string& token) {
  static const std::regex number(R"(^[0-9][0-9,]*(\.[0-9]+)?(e[+-]?[0-9]+)?$)");
  return std::regex_match(token, number);
}

// "NAME FIGURE UNIT" with the figure the last number in the text (names may hold numbers,
// "8 fill threads"; units may have two words, "M pairs/s").
bool split_at_figure(const std::string& text, std::string& name, std::string& figure,
                     std::string& unit) {
  std::vector<std::string> tokens;
  std::stringstream stream(text);
  for (std::string token; stream >> token;) tokens.push_back(token);
  for (std::size_t k = tokens.size(); k-- > 0;) {
    if (!is_number(tokens[k])) continue;
    name.clear();
    unit.clear();
    for (std::size_t i = 0; i < k; ++i) name += (i ? " " : "") + tokens[i];
    for (std::size_t i = k + 1; i < tokens.size(); ++i) unit += (i > k + 1 ? " " : "") + tokens[i];
    figure = tokens[k];
    return !unit.empty();
  }
  return false;
}

struct Verdict {
  std::string ours, ours_figure, peer, peer_figure, unit, ratio;
  bool better = true;
  bool on_par = false;
};

// "Verdict CASE: OURS FIGURE UNIT vs best peer PEER FIGURE UNIT: **RATIOx better|worse**",
// or "**RATIOx, on par**" where the two are within 1% of each other.
std::optional<Verdict> parse_verdict(const std::string& line, const std::string& case_name) {
  const std::string prefix = "Verdict " + case_name + ": ";
  if (!starts_with(line, prefix)) return std::nullopt;
  const std::string rest = line.substr(prefix.size());
  const auto vs = rest.find(" vs best peer ");
  const auto bold = rest.rfind(": **");
  if (vs == std::string::npos || bold == std::string::npos || bold < vs) return std::nullopt;
  // NAME FIGURE UNIT: the figure is the last number (a unit may have two words, "M pairs/s").
  auto split_figure = [](const std::string& text, std::string& name, std::string& figure,
                         std::string& unit) { return split_at_figure(text, name, figure, unit); };
  Verdict v;
  std::string peer_unit;
  if (!split_figure(rest.substr(0, vs), v.ours, v.ours_figure, v.unit) ||
      !split_figure(rest.substr(vs + 14, bold - vs - 14), v.peer, v.peer_figure, peer_unit) ||
      peer_unit != v.unit) {
    return std::nullopt;
  }
  std::string tail = rest.substr(bold + 4);
  if (tail.size() < 2 || tail.substr(tail.size() - 2) != "**") return std::nullopt;
  v.ratio = tail.substr(0, tail.size() - 2);  // "62.11x better"
  v.better = v.ratio.find(" better") != std::string::npos;
  v.on_par = v.ratio.find(", on par") != std::string::npos;
  return v;
}

// A figure as printed ("1,076", "6.54e+04"), with half a unit of its last digit.
double parse_figure(std::string text, double& slack) {
  text.erase(std::remove(text.begin(), text.end(), ','), text.end());
  const auto e = text.find_first_of("eE");
  const std::string mantissa = text.substr(0, e);
  const auto dot = mantissa.find('.');
  const int decimals = dot == std::string::npos ? 0 : static_cast<int>(mantissa.size() - dot - 1);
  const double value = std::stod(text);
  const double scale = e == std::string::npos ? 1.0 : std::pow(10.0, std::stod(text.substr(e + 1)));
  slack = 0.5 * std::pow(10.0, -decimals) * scale;
  return value;
}

// Whether `line` holds `figure` as a whole token: a table cell or a note's value.
bool holds_figure(const std::string& line, const std::string& figure) {
  for (auto at = line.find(figure); at != std::string::npos; at = line.find(figure, at + 1)) {
    const char before = at == 0 ? ' ' : line[at - 1];
    const std::size_t end = at + figure.size();
    const char after = end >= line.size() ? ' ' : line[end];
    if ((before == ' ' || before == '|' || before == '=') && (after == ' ' || after == '|')) {
      return true;
    }
  }
  return false;
}

std::string first_part(const std::string& text) { return text.substr(0, text.find(", ")); }

// A table row of the latest part for this case (its first cell up to the first comma) and
// allocator (where the table has an allocator column) that holds the figure.
bool table_holds(const std::vector<std::string>& part, const std::string& case_name,
                 const std::string& allocator, const std::string& figure) {
  bool allocator_column = false;
  for (const auto& line : part) {
    const auto cells = cells_of(line);
    if (cells.size() < 2) continue;
    if (cells[0] == "parameter" || cells[0] == "workload" || cells[0] == "trace") {
      allocator_column = cells[1] == "allocator";
      continue;
    }
    if (first_part(cells[0]) != first_part(case_name)) continue;
    if (allocator_column) {
      std::string name = cells[1];
      name.erase(std::remove(name.begin(), name.end(), '*'), name.end());
      if (name != allocator) continue;
    }
    if (holds_figure(line, figure)) return true;
  }
  return false;
}

TEST(Readme, HeadlineTableIsTheTableOfResults) {
  const std::string readme_block = headline_block(read_source("README.md"));
  const std::string block = headline_block(read_source("bench/RESULTS.md"));
  ASSERT_FALSE(block.empty()) << "bench/RESULTS.md has no headline block";
  ASSERT_FALSE(readme_block.empty()) << "README.md has no headline block";
  // The README's links reach RESULTS.md from the repository root, RESULTS.md's its own anchors.
  EXPECT_EQ(replace_all(readme_block, "](bench/RESULTS.md#", "](#"), block)
      << "README's headline table differs from bench/RESULTS.md's";
}

TEST(Readme, EveryHeadlineRowIsAVerdictOfTheLatestResultItLinksTo) {
  const auto results = lines_of(read_source("bench/RESULTS.md"));
  const auto block = lines_of(headline_block(read_source("README.md")));
  const std::regex link(R"(^\[[^\]]+\]\(bench/RESULTS\.md#([a-z0-9_-]+)\)$)");
  const std::regex latest_line(R"(^Latest: \d{4}-\d{2}-\d{2}, commit [0-9a-f]{7,}\b.*)");
  std::size_t rows = 0;
  for (const auto& line : block) {
    const auto cells = cells_of(line);
    if (cells.size() < 5 || cells[0] == "scenario" || starts_with(cells[0], "---")) continue;
    ++rows;
    std::smatch match;
    ASSERT_TRUE(std::regex_match(cells[0], match, link))
        << "the scenario cell must link a RESULTS.md section: " << cells[0];
    const std::string anchor = match[1];
    if (rows == 1) {
      // The realistic pattern leads: the recorded traces, not a micro-benchmark.
      EXPECT_TRUE(starts_with(anchor, "recorded-traces")) << "first row: " << anchor;
    }
    const auto part = latest_part(results, anchor);
    ASSERT_TRUE(part.has_value()) << "bench/RESULTS.md has no section #" << anchor;
    const bool dated = std::any_of(part->begin(), part->end(), [&](const std::string& l) {
      return std::regex_match(l, latest_line);
    });
    const bool command = std::any_of(part->begin(), part->end(), [](const std::string& l) {
      return starts_with(l, "Command: `");
    });
    EXPECT_TRUE(dated) << "#" << anchor << " states no 'Latest: DATE, commit HASH' line";
    EXPECT_TRUE(command) << "#" << anchor << " states no 'Command: `...`' line";

    const std::string& case_name = cells[1];
    std::optional<Verdict> verdict;
    for (const auto& l : *part) {
      if (!verdict) verdict = parse_verdict(l, case_name);
    }
    ASSERT_TRUE(verdict.has_value())
        << "#" << anchor << " has no verdict line for '" << case_name << "' in its latest result";
    const Verdict& v = *verdict;
    EXPECT_EQ(cells[2], v.ours_figure + " " + v.unit) << case_name;
    std::string peer_short, peer_figure, peer_unit;
    ASSERT_TRUE(split_at_figure(cells[3], peer_short, peer_figure, peer_unit)) << cells[3];
    EXPECT_EQ(peer_figure + " " + peer_unit, v.peer_figure + " " + v.unit) << case_name;
    EXPECT_TRUE(starts_with(v.peer, peer_short))
        << case_name << ": '" << peer_short << "' does not name " << v.peer;
    EXPECT_EQ(cells[4], v.ratio) << case_name;

    // The verdict's figures are the table's, and its ratio their quotient.
    EXPECT_TRUE(table_holds(*part, case_name, v.ours, v.ours_figure))
        << "#" << anchor << ": no table row of " << v.ours << " for '" << case_name << "' holds "
        << v.ours_figure;
    EXPECT_TRUE(table_holds(*part, case_name, v.peer, v.peer_figure))
        << "#" << anchor << ": no table row of " << v.peer << " for '" << case_name << "' holds "
        << v.peer_figure;
    double ours_slack = 0, peer_slack = 0, ratio_slack = 0;
    const double ours = parse_figure(v.ours_figure, ours_slack);
    const double peer = parse_figure(v.peer_figure, peer_slack);
    const double ratio = parse_figure(v.ratio.substr(0, v.ratio.find('x')), ratio_slack);
    const bool higher_is_better = v.unit.size() >= 2 && v.unit.substr(v.unit.size() - 2) == "/s";
    const double advantage = higher_is_better ? ours / peer : peer / ours;
    if (v.on_par) {
      // "on par" only where the figures are within 1% of each other: no winner is named.
      EXPECT_LE(std::abs(advantage - 1), 0.01) << case_name;
    } else {
      EXPECT_EQ(v.better, advantage >= 1) << case_name;
    }
    const double expected = advantage >= 1 ? advantage : 1 / advantage;
    const double figures_slack = expected * (ours_slack / ours + peer_slack / peer);
    EXPECT_NEAR(ratio, expected, ratio_slack + figures_slack + expected * 1e-4) << case_name;
  }
  EXPECT_GE(rows, 10U) << "the headline table has " << rows << " rows";
}

// Every scenario section of RESULTS.md (one with a history) says when, where and how its
// latest result was taken.
TEST(Readme, EveryResultsSectionStatesItsLatestRun) {
  const auto results = lines_of(read_source("bench/RESULTS.md"));
  const std::regex latest_line(R"(^Latest: \d{4}-\d{2}-\d{2}, .*)");
  std::size_t sections = 0;
  for (std::size_t i = 0; i < results.size(); ++i) {
    if (!starts_with(results[i], "## ")) continue;
    bool history = false, latest = false, command = false;
    for (std::size_t j = i + 1; j < results.size() && !starts_with(results[j], "## "); ++j) {
      if (starts_with(results[j], "### History")) history = true;
      if (history) continue;
      latest = latest || std::regex_match(results[j], latest_line);
      command = command || starts_with(results[j], "Command: `");
    }
    if (!history) continue;
    ++sections;
    EXPECT_TRUE(latest) << results[i] << ": no 'Latest: DATE, ...' line before its history";
    EXPECT_TRUE(command) << results[i] << ": no 'Command: `...`' line before its history";
  }
  EXPECT_GE(sections, 10U);
}

}  // namespace
}  // namespace vram::testing
