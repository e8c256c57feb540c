// The README shows what the repository holds: its code snippets are the marked regions of
// the programs in examples/ (built by CI from the installed package), and its headline
// figures are the block of bench/RESULTS.md, each range holding the figures of the latest
// full run recorded there. No figure is typed in this test: all come from the two files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "source_tree.hpp"

namespace vram::testing {
namespace {

std::string read_source(const std::string& relative) {
  std::ifstream file(source_path(relative));
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
  for (const char* name : {"device_pool", "stream_ordered_pool", "pinned_staging_pool"}) {
    EXPECT_TRUE(seen.count(name)) << "README lacks the snippet " << name;
  }
}

// ---- headline figures ---------------------------------------------------------------------

std::string headline_block(const std::string& text) {
  const std::string begin = "<!-- headline:";
  const std::string end = "<!-- /headline -->";
  const auto b = text.find(begin);
  const auto e = text.find(end);
  if (b == std::string::npos || e == std::string::npos || e < b) return {};
  return text.substr(b, e - b);
}

struct Row {
  std::string scenario, parameter, allocator;
  double median = 0;
  std::map<std::string, double> extra;
};

// The tables of the section "## Latest full run" of bench/RESULTS.md.
std::vector<Row> latest_run_rows(const std::string& results) {
  std::vector<Row> rows;
  bool in_latest = false;
  std::string scenario;
  for (const auto& line : lines_of(results)) {
    if (line.rfind("## ", 0) == 0) in_latest = line.rfind("## Latest full run", 0) == 0;
    if (!in_latest) continue;
    if (line.rfind("### ", 0) == 0) scenario = trim(line.substr(4));
    if (line.rfind("| ", 0) != 0 || line.rfind("| parameter", 0) == 0) continue;
    std::vector<std::string> cells;
    std::stringstream stream(line.substr(1));
    for (std::string cell; std::getline(stream, cell, '|');) cells.push_back(trim(cell));
    if (cells.size() < 5) continue;
    Row row;
    row.scenario = scenario;
    row.parameter = cells[0];
    row.allocator = cells[1];
    row.allocator.erase(std::remove(row.allocator.begin(), row.allocator.end(), '*'),
                        row.allocator.end());
    row.median = std::stod(cells[2]);
    std::stringstream notes(cells[4]);
    for (std::string note; notes >> note;) {
      const auto equals = note.find('=');
      if (equals != std::string::npos) {
        row.extra[note.substr(0, equals)] = std::stod(note.substr(equals + 1));
      }
    }
    rows.push_back(row);
  }
  return rows;
}

// A range as printed ("1,076", "0.305"), with half a unit of its last digit for rounding.
struct Range {
  double low = 0, high = 0, low_slack = 0, high_slack = 0;
};

double parse_figure(std::string text, double& slack) {
  text.erase(std::remove(text.begin(), text.end(), ','), text.end());
  const auto dot = text.find('.');
  const int decimals = dot == std::string::npos ? 0 : static_cast<int>(text.size() - dot - 1);
  slack = 0.5 * std::pow(10.0, -decimals) + 1e-9;
  return std::stod(text);
}

// Every "A-B" range of one headline bullet, in order.
std::vector<Range> ranges_of(const std::string& bullet) {
  std::vector<Range> ranges;
  const std::regex range(R"(([0-9][0-9,]*(?:\.[0-9]+)?)-([0-9][0-9,]*(?:\.[0-9]+)?))");
  for (auto it = std::sregex_iterator(bullet.begin(), bullet.end(), range);
       it != std::sregex_iterator(); ++it) {
    Range r;
    r.low = parse_figure((*it)[1], r.low_slack);
    r.high = parse_figure((*it)[2], r.high_slack);
    ranges.push_back(r);
  }
  return ranges;
}

std::string bullet_starting(const std::string& block, const std::string& start) {
  for (const auto& line : lines_of(block)) {
    if (line.rfind("- " + start, 0) == 0) return line;
  }
  return {};
}

// Over runs: the latest run's figures lie inside. Latest run: they are its exact extremes.
enum class Kind { over_runs, latest_run };

void expect_range(const Range& range, const std::vector<double>& values, Kind kind,
                  const std::string& what) {
  ASSERT_FALSE(values.empty()) << what << ": no figure found in bench/RESULTS.md";
  const auto [min, max] = std::minmax_element(values.begin(), values.end());
  EXPECT_GE(*min, range.low - range.low_slack) << what;
  EXPECT_LE(*max, range.high + range.high_slack) << what;
  if (kind == Kind::latest_run) {
    EXPECT_NEAR(*min, range.low, range.low_slack) << what << ": the low end is not the minimum";
    EXPECT_NEAR(*max, range.high, range.high_slack) << what << ": the high end is not the maximum";
  }
}

std::vector<double> medians(const std::vector<Row>& rows, const std::string& scenario,
                            const std::set<std::string>& allocators,
                            const std::set<std::string>& parameters = {}) {
  std::vector<double> out;
  for (const auto& row : rows) {
    if (row.scenario == scenario && allocators.count(row.allocator) &&
        (parameters.empty() || parameters.count(row.parameter))) {
      out.push_back(row.median);
    }
  }
  return out;
}

TEST(Readme, HeadlineFiguresAreTheBlockOfResultsAndHoldItsTables) {
  const std::string readme_block = headline_block(read_source("README.md"));
  const std::string results_text = read_source("bench/RESULTS.md");
  const std::string block = headline_block(results_text);
  ASSERT_FALSE(block.empty()) << "bench/RESULTS.md has no headline block";
  EXPECT_EQ(readme_block, block) << "README's headline block differs from bench/RESULTS.md's";
  const auto rows = latest_run_rows(results_text);
  ASSERT_GT(rows.size(), 20U) << "could not read the latest run's tables";

  // The realistic pattern leads: the recorded traces (one pass on a fresh pool each).
  const auto block_lines = lines_of(block);
  ASSERT_GE(block_lines.size(), 2U);
  EXPECT_EQ(block_lines[1].rfind("- DevicePool on real", 0), 0U)
      << "the first bullet is the recorded traces, not a micro-benchmark";
  const std::string traces = bullet_starting(block, "DevicePool on real");
  auto r = ranges_of(traces);
  ASSERT_EQ(r.size(), 6U) << traces;
  auto replay_figure = [&rows](const std::string& allocator, const std::string& note) {
    std::vector<double> out;
    for (const auto& row : rows) {
      if (row.scenario != "replay" || row.allocator != allocator) continue;
      out.push_back(note.empty() ? row.median : row.extra.at(note));
    }
    return out;
  };
  expect_range(r[0], replay_figure("vram DevicePool", "reserved_over_live"), Kind::latest_run,
               "DevicePool reserved/live over the traces");
  expect_range(r[1], replay_figure("vram DevicePool", ""), Kind::latest_run,
               "DevicePool ns/op over the traces");
  expect_range(r[2], replay_figure("cudaMallocAsync (private pool)", "reserved_over_live"),
               Kind::latest_run, "cudaMallocAsync reserved/live");
  expect_range(r[3], replay_figure("cudaMallocAsync (private pool)", ""), Kind::latest_run,
               "cudaMallocAsync ns/op");
  expect_range(r[4], replay_figure("CUB CachingDeviceAllocator", "reserved_over_live"),
               Kind::latest_run, "CUB reserved/live");
  expect_range(r[5], replay_figure("CUB CachingDeviceAllocator", ""), Kind::latest_run,
               "CUB ns/op");

  const std::string pairs = bullet_starting(block, "DevicePool warm acquire+release pair");
  r = ranges_of(pairs);
  ASSERT_EQ(r.size(), 4U) << pairs;
  expect_range(r[0],
               medians(rows, "pairs", {"vram DevicePool"}, {"256 B", "4 KiB", "64 KiB", "1 MiB"}),
               Kind::over_runs, "DevicePool pair, 256 B to 1 MiB");
  expect_range(r[1], medians(rows, "pairs", {"vram DevicePool"}, {"16 MiB", "256 MiB"}),
               Kind::latest_run, "DevicePool pair, 16 and 256 MiB");
  expect_range(r[2], medians(rows, "pairs", {"CUB CachingDeviceAllocator"}), Kind::latest_run,
               "CUB pair");
  expect_range(r[3], medians(rows, "pairs", {"cudaMallocAsync"}), Kind::latest_run,
               "cudaMallocAsync pair");

  const std::string threads = bullet_starting(block, "DevicePool at 16 threads");
  r = ranges_of(threads);
  ASSERT_EQ(r.size(), 2U) << threads;
  expect_range(r[0], medians(rows, "threads", {"vram DevicePool"}, {"16 threads"}), Kind::over_runs,
               "DevicePool at 16 threads");
  expect_range(
      r[1],
      medians(rows, "threads", {"CUB CachingDeviceAllocator", "cudaMallocAsync"}, {"16 threads"}),
      Kind::latest_run, "CUB and cudaMallocAsync at 16 threads");

  const std::string pagein = bullet_starting(block, "Page-in");
  r = ranges_of(pagein);
  ASSERT_EQ(r.size(), 2U) << pagein;
  std::vector<double> share_all, share_16;
  for (const auto& row : rows) {
    if (row.scenario != "pagein" || !row.extra.count("of_ceiling_pct")) continue;
    share_all.push_back(row.extra.at("of_ceiling_pct"));
    if (row.parameter == "64 x 16 MiB") share_16.push_back(row.extra.at("of_ceiling_pct"));
  }
  expect_range(r[0], share_all, Kind::latest_run, "page-in share of the ceiling");
  expect_range(r[1], share_16, Kind::over_runs, "page-in share at 16 MiB chunks");

  const std::string pinning = bullet_starting(block, "Pinning");
  r = ranges_of(pinning);
  ASSERT_EQ(r.size(), 1U) << pinning;
  std::vector<double> ratios;
  for (const auto& row : rows) {
    if (row.scenario != "pinning" || row.allocator != "vram touch+register (parallel)") continue;
    for (const auto& peer : rows) {
      if (peer.scenario == "pinning" && peer.parameter == row.parameter &&
          peer.allocator == "cudaHostAlloc") {
        ratios.push_back(row.median / peer.median);
      }
    }
  }
  // The ratios come from medians rounded to 4 digits: allow that much on top.
  Range widened = r[0];
  widened.low_slack += widened.low * 1e-3;
  widened.high_slack += widened.high * 1e-3;
  expect_range(widened, ratios, Kind::latest_run, "pinning vs cudaHostAlloc");
}

}  // namespace
}  // namespace vram::testing
