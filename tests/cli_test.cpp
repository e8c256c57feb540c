// The CLI's commands, called in-process: argument errors, exit codes, well-formed JSON.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "bench/report.hpp"
#include "commands.hpp"
#include "source_tree.hpp"
#include "vram/cuda/device.hpp"

namespace vram::testing {
namespace {

// A minimal JSON well-formedness checker (objects, arrays, strings, numbers, literals).
class JsonChecker {
 public:
  explicit JsonChecker(std::string text) : text_(std::move(text)) {}
  bool valid() {
    skip();
    if (!value()) return false;
    skip();
    return position_ == text_.size();
  }

 private:
  void skip() {
    while (position_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[position_]))) {
      ++position_;
    }
  }
  bool literal(const char* word) {
    const std::string w(word);
    if (text_.compare(position_, w.size(), w) != 0) return false;
    position_ += w.size();
    return true;
  }
  bool string() {
    if (text_[position_] != '"') return false;
    for (++position_; position_ < text_.size(); ++position_) {
      if (text_[position_] == '\\') {
        ++position_;
      } else if (text_[position_] == '"') {
        ++position_;
        return true;
      } else if (static_cast<unsigned char>(text_[position_]) < 0x20) {
        return false;
      }
    }
    return false;
  }
  bool number() {
    const std::size_t start = position_;
    while (position_ < text_.size() && std::strchr("+-0123456789.eE", text_[position_])) {
      ++position_;
    }
    return position_ > start;
  }
  bool value() {
    skip();
    if (position_ >= text_.size()) return false;
    const char c = text_[position_];
    if (c == '{' || c == '[') {
      const char close = c == '{' ? '}' : ']';
      ++position_;
      skip();
      if (text_[position_] == close) {
        ++position_;
        return true;
      }
      for (;;) {
        skip();
        if (c == '{') {
          if (!string()) return false;
          skip();
          if (text_[position_++] != ':') return false;
        }
        if (!value()) return false;
        skip();
        if (text_[position_] == ',') {
          ++position_;
          continue;
        }
        if (text_[position_] == close) {
          ++position_;
          return true;
        }
        return false;
      }
    }
    if (c == '"') return string();
    if (c == 't') return literal("true");
    if (c == 'f') return literal("false");
    if (c == 'n') return literal("null");
    return number();
  }
  std::string text_;
  std::size_t position_ = 0;
};

TEST(Cli, UnknownScenarioIsAClearErrorWithNonZeroExit) {
  ::testing::internal::CaptureStderr();
  const int code = cli::run_bench({"--scenario", "pairs,nonsense"});
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(code, 2);
  EXPECT_NE(err.find("unknown scenario 'nonsense'"), std::string::npos) << err;
}

TEST(Cli, UnknownOptionAndMissingValueAreErrors) {
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(cli::run_bench({"--frobnicate"}), 2);
  EXPECT_EQ(cli::run_bench({"--json"}), 2);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("unknown option '--frobnicate'"), std::string::npos) << err;
  EXPECT_NE(err.find("--json needs a value"), std::string::npos) << err;
}

TEST(Cli, UnwritableOutputPathIsAClearError) {
  ::testing::internal::CaptureStderr();
  const int code = cli::run_bench({"--quick", "--json", "/nonexistent-dir/x/results.json"});
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(code, 2);
  EXPECT_NE(err.find("cannot write --json file"), std::string::npos) << err;
}

TEST(Cli, HostOnlyQuickBenchWritesWellFormedJsonAndSvg) {
  const std::string json = ::testing::TempDir() + "vram-bench-test.json";
  const std::string svg = ::testing::TempDir() + "vram-bench-test.svg";
  ::testing::internal::CaptureStdout();
  const int code = cli::run_bench(
      {"--quick", "--host-only", "--scenario", "pairs", "--json", json, "--svg", svg});
  const std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("host-only"), std::string::npos);
  EXPECT_NE(out.find("verdict pairs"), std::string::npos);
  std::stringstream text;
  text << std::ifstream(json).rdbuf();
  EXPECT_TRUE(JsonChecker(text.str()).valid()) << text.str();
  EXPECT_NE(text.str().find("\"mode\": \"host-only\""), std::string::npos);
  EXPECT_NE(text.str().find("\"scenario\": \"pairs\""), std::string::npos);
  std::stringstream picture;
  picture << std::ifstream(svg).rdbuf();
  EXPECT_EQ(picture.str().rfind("<svg", 0), 0U);
  EXPECT_NE(picture.str().find("<rect"), std::string::npos);
  std::remove(json.c_str());
  std::remove(svg.c_str());
}

TEST(Cli, JsonCheckerRejectsBrokenJson) {
  EXPECT_TRUE(JsonChecker("{\"a\": [1, 2.5e3, true, null, \"x\"]}").valid());
  EXPECT_FALSE(JsonChecker("{\"a\": [1, 2,]}").valid());
  EXPECT_FALSE(JsonChecker("{\"a\" 1}").valid());
}

TEST(Cli, InfoRunsWithOrWithoutADevice) {
  ::testing::internal::CaptureStdout();
  EXPECT_EQ(cli::run_info({}), 0);
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_FALSE(out.empty());
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(cli::run_info({"--bogus"}), 2);
  (void)::testing::internal::GetCapturedStderr();
}

}  // namespace
}  // namespace vram::testing

namespace vram::testing {
namespace {

TEST(Cli, EveryDocumentedScenarioIsAccepted) {
  // GPU-only scenarios are accepted and reported as skipped on a host-only run; as nothing
  // is then measured, the run exits 3.
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int code = cli::run_bench({"--host-only", "--scenario", "overhead,pagein,pinning"});
  const std::string out = ::testing::internal::GetCapturedStdout();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(code, 3) << out << err;
  for (const char* name : {"overhead", "pagein", "pinning"}) {
    EXPECT_NE(out.find(std::string("scenario '") + name + "' skipped: it needs a GPU"),
              std::string::npos)
        << out;
  }
}

}  // namespace
}  // namespace vram::testing

namespace vram::testing {
namespace {

std::string read_text(const std::string& path) {
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  return text.str();
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// Names in `directory` that start with `prefix` (leftover temporaries).
std::vector<std::string> files_starting_with(const std::string& directory,
                                             const std::string& prefix) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(directory)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) names.push_back(name);
  }
  return names;
}

struct Captured {
  int code;
  std::string out;
  std::string err;
};

Captured capture_bench(const std::vector<std::string>& args) {
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int code = cli::run_bench(args);
  std::string out = ::testing::internal::GetCapturedStdout();
  std::string err = ::testing::internal::GetCapturedStderr();
  return {code, std::move(out), std::move(err)};
}

Captured capture_info(const std::vector<std::string>& args) {
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int code = cli::run_info(args);
  std::string out = ::testing::internal::GetCapturedStdout();
  std::string err = ::testing::internal::GetCapturedStderr();
  return {code, std::move(out), std::move(err)};
}

// An empty directory of this process under the test's temporary directory.
std::string fresh_directory(const std::string& name) {
  const std::string directory = ::testing::TempDir() + name + "-" + std::to_string(::getpid());
  std::filesystem::remove_all(directory);
  std::filesystem::create_directories(directory + "/sub");
  return directory;
}

// Runs `body` with `directory` as the working directory, restored afterwards.
template <typename Body>
auto in_directory(const std::string& directory, Body body) {
  struct Restore {
    std::filesystem::path saved = std::filesystem::current_path();
    ~Restore() { std::filesystem::current_path(saved); }
  } restore;
  std::filesystem::current_path(directory);
  return body();
}

TEST(CliOutput, AFailingRunLeavesAnExistingOutputFileUntouched) {
  const std::string directory = ::testing::TempDir();
  const std::string keep = directory + "vram-keep.json";
  write_text(keep, "precious");
  // An unwritable --svg is found before anything runs: exit 2, keep.json not truncated.
  auto run = capture_bench({"--quick", "--host-only", "--scenario", "pairs", "--json", keep,
                            "--svg", "/nonexistent-dir/x.svg"});
  EXPECT_EQ(run.code, 2) << run.err;
  EXPECT_NE(run.err.find("cannot write --svg file"), std::string::npos) << run.err;
  EXPECT_EQ(read_text(keep), "precious");
  // A run that measures nothing writes nothing either.
  run = capture_bench({"--host-only", "--scenario=pagein", "--json=" + keep});
  EXPECT_EQ(run.code, 3) << run.err;
  EXPECT_EQ(read_text(keep), "precious");
  EXPECT_TRUE(files_starting_with(directory, "vram-keep.json.tmp").empty());
  std::remove(keep.c_str());
}

TEST(CliOutput, ASuccessfulRunReplacesTheFileAndLeavesNoTemporary) {
  const std::string directory = ::testing::TempDir();
  const std::string json = directory + "vram-replace.json";
  write_text(json, "old");
  const auto run = capture_bench({"--quick", "--host-only", "--scenario=pairs", "--json=" + json});
  ASSERT_EQ(run.code, 0) << run.err;
  const std::string text = read_text(json);
  EXPECT_TRUE(JsonChecker(text).valid()) << text;
  EXPECT_NE(run.out.find("wrote " + json), std::string::npos) << run.out;
  EXPECT_TRUE(files_starting_with(directory, "vram-replace.json.tmp").empty());
  const mode_t mask = umask(0);
  umask(mask);
  struct stat info {};
  ASSERT_EQ(stat(json.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0666 & ~mask) << "the mode a plain fopen would give";
  std::remove(json.c_str());
}

TEST(CliOutput, NothingMeasuredIsExitThreeWithAMessage) {
  const auto run = capture_bench({"--host-only", "--scenario", "pagein"});
  EXPECT_EQ(run.code, 3);
  EXPECT_NE(run.err.find("nothing was measured"), std::string::npos) << run.err;
}

TEST(CliOutput, JsonDashWritesOnlyJsonToStdout) {
  const auto run = capture_bench({"--quick", "--host-only", "--scenario", "pairs", "--json", "-"});
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_TRUE(JsonChecker(run.out).valid()) << run.out;
  EXPECT_NE(run.out.find("\"scenario\": \"pairs\""), std::string::npos);
  EXPECT_NE(run.err.find("verdict pairs"), std::string::npos) << "tables go to stderr";
  EXPECT_FALSE(std::filesystem::exists("-"));
}

TEST(CliOutput, JsonSizesAndCountsAreWholeNumbers) {
  EXPECT_EQ(bench::json_number(1048576.0), "1048576");
  EXPECT_EQ(bench::json_number(268435456.0), "268435456");
  EXPECT_EQ(bench::json_number(50000.0), "50000");
  EXPECT_EQ(bench::json_number(9.435), "9.435");
  EXPECT_EQ(bench::json_number(0.0), "0");
  EXPECT_EQ(bench::json_number(std::numeric_limits<double>::quiet_NaN()), "null");
  const auto run = capture_bench({"--quick", "--host-only", "--scenario", "pairs", "--json", "-"});
  ASSERT_EQ(run.code, 0) << run.err;
  const std::string key = "\"parameter_value\": ";
  std::size_t found = 0;
  for (auto at = run.out.find(key); at != std::string::npos; at = run.out.find(key, at + 1)) {
    const std::size_t start = at + key.size();
    const std::size_t end = run.out.find_first_not_of("0123456789", start);
    ASSERT_GT(end, start) << run.out.substr(at, 40);
    EXPECT_EQ(run.out[end], ',') << "not a whole number: " << run.out.substr(at, 40);
    ++found;
  }
  EXPECT_GT(found, 0U);
}

TEST(CliOptions, BadDeviceOrdinalsAreRefused) {
  for (const char* value : {"abc", "-1", "99999999999", "1e3", "0x1", "", " 1", "1 "}) {
    for (const bool equals_form : {false, true}) {
      const auto run = equals_form ? capture_bench({std::string("--device=") + value})
                                   : capture_bench({"--device", value});
      EXPECT_EQ(run.code, 2) << "'" << value << "'";
      EXPECT_NE(run.err.find("--device needs a device ordinal"), std::string::npos)
          << "'" << value << "': " << run.err;
    }
  }
}

TEST(CliOptions, ADeviceThatDoesNotExistIsAnError) {
  // Ordinal == count is one past the last device, on a GPU machine or not.
  const int count = vram::cuda::Device::count();
  const auto run = capture_bench({"--quick", "--device", std::to_string(count)});
  EXPECT_EQ(run.code, 2) << run.out << run.err;
  const std::string expected = count == 0 ? "no CUDA device is usable" : "does not exist";
  EXPECT_NE(run.err.find(expected), std::string::npos) << run.err;
  EXPECT_EQ(run.out.find("verdict"), std::string::npos) << "nothing may run: " << run.out;
}

TEST(CliOptions, EveryValueOptionTakesTheEqualsForm) {
  const std::string json = ::testing::TempDir() + "vram-equals.json";
  const std::string markdown = ::testing::TempDir() + "vram-equals.md";
  const auto run = capture_bench(
      {"--quick", "--host-only", "--scenario=pairs", "--json=" + json, "--markdown=" + markdown});
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_TRUE(JsonChecker(read_text(json)).valid());
  EXPECT_NE(read_text(markdown).find("### pairs"), std::string::npos);
  EXPECT_EQ(capture_bench({"--quick=yes"}).code, 2);
  EXPECT_EQ(capture_bench({"--scenario="}).code, 2);
  std::remove(json.c_str());
  std::remove(markdown.c_str());
}

TEST(CliOptions, HelpDescribesEveryOptionScenarioAndExitCode) {
  const auto run = capture_bench({"--help"});
  EXPECT_EQ(run.code, 0);
  for (const char* option : {"--quick", "--scenario", "--device", "--host-only", "--json", "--svg",
                             "--markdown", "--help", "exit codes", "'-'"}) {
    EXPECT_NE(run.out.find(option), std::string::npos) << option;
  }
  for (const char* scenario : {"pairs", "threads", "mixed", "overhead", "pagein", "pinning"}) {
    EXPECT_NE(run.out.find(std::string("  ") + scenario + " "), std::string::npos) << scenario;
  }
}

TEST(CliOutput, HostOnlyMallocShowsItsRealPeak) {
  const auto run = capture_bench({"--quick", "--host-only", "--scenario", "mixed", "--json", "-"});
  ASSERT_EQ(run.code, 0) << run.err;
  const auto at = run.out.find("\"allocator\": \"malloc/free (host reference)\"");
  ASSERT_NE(at, std::string::npos) << run.out;
  const std::string key = "\"peak_reserved_mib\": ";
  const auto peak = run.out.find(key, at);
  ASSERT_NE(peak, std::string::npos) << run.out.substr(at);
  EXPECT_GT(std::stod(run.out.substr(peak + key.size())), 0.0) << run.out.substr(at, 400);
}

TEST(CliInfo, VersionNamesTheReleaseAndCommit) {
  const std::string version = cli::version_text();
  EXPECT_EQ(version.rfind("vram ", 0), 0U) << version;
  EXPECT_NE(version.find("commit "), std::string::npos) << version;
}

TEST(CliInfo, WithoutADeviceInfoPrintsTheLibrarysFixHint) {
  if (vram::cuda::Device::count() > 0) {
    GTEST_SKIP() << "a CUDA device is visible: the no-device message cannot be shown here";
  }
  ::testing::internal::CaptureStdout();
  EXPECT_EQ(cli::run_info({}), 0);
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("Fix:"), std::string::npos) << out;
  EXPECT_EQ(out.find("driver version is insufficient"), std::string::npos) << out;
  EXPECT_EQ(cli::no_device_explanation().find("driver version is insufficient"), std::string::npos);
}

TEST(CliInfo, HelpPrintsTheUsageAndExitsZero) {
  for (const char* help : {"--help", "-h"}) {
    const auto run = capture_info({help});
    EXPECT_EQ(run.code, 0) << help << run.err;
    EXPECT_EQ(run.out.rfind("usage: vram info", 0), 0U) << run.out;
    EXPECT_TRUE(run.err.empty()) << run.err;
  }
  const auto bogus = capture_info({"--bogus"});
  EXPECT_EQ(bogus.code, 2);
  EXPECT_NE(bogus.err.find("takes no arguments, got '--bogus'"), std::string::npos) << bogus.err;
  EXPECT_TRUE(bogus.out.empty()) << bogus.out;
}

// Two outputs that are one file, in any spelling: refused before the run, the file kept.
TEST(CliOutput, TwoOutputsThatAreOneFileAreRefused) {
  const std::string directory = fresh_directory("vram-bench-one-file");
  const std::string json = directory + "/b.json";
  write_text(json, "precious");
  for (const std::string& markdown : {json, directory + "/./b.json", directory + "//b.json"}) {
    const auto run = capture_bench(
        {"--quick", "--host-only", "--scenario", "pairs", "--json", json, "--markdown", markdown});
    EXPECT_EQ(run.code, 2) << markdown << run.out;
    EXPECT_NE(run.err.find("--json file '" + json + "' and --markdown file '" + markdown +
                           "' are one file"),
              std::string::npos)
        << run.err;
    EXPECT_NE(run.err.find("Fix:"), std::string::npos) << run.err;
    EXPECT_EQ(run.out.find("verdict"), std::string::npos) << "nothing may run: " << run.out;
    EXPECT_EQ(read_text(json), "precious") << markdown;
  }
  // Not existing yet: the normalized absolute paths are compared, also of a bare name in
  // the working directory ("new.svg" and "./new.svg").
  const std::string fresh = directory + "/new.svg";
  for (const auto& [svg, markdown] :
       {std::pair<std::string, std::string>{fresh, directory + "/sub/../new.svg"},
        std::pair<std::string, std::string>{"new.svg", "./new.svg"}}) {
    const auto run = in_directory(directory, [&] {
      return capture_bench(
          {"--quick", "--host-only", "--scenario", "pairs", "--svg", svg, "--markdown", markdown});
    });
    EXPECT_EQ(run.code, 2) << svg << " " << markdown << run.out;
    EXPECT_NE(run.err.find("are one file"), std::string::npos) << run.err;
    EXPECT_FALSE(std::filesystem::exists(fresh));
  }
  std::filesystem::remove_all(directory);
}

}  // namespace
}  // namespace vram::testing

// `vram replay`'s options: the same value forms, --device check and output handling as
// `vram bench` (the code is shared), and its own bounds and input/output rules.
namespace vram::testing {
namespace {

std::string sample_trace() { return source_path("tests/data/replay_sample.csv"); }

Captured capture_replay(const std::vector<std::string>& args) {
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int code = cli::run_replay(args);
  std::string out = ::testing::internal::GetCapturedStdout();
  std::string err = ::testing::internal::GetCapturedStderr();
  return {code, std::move(out), std::move(err)};
}

// Whether the replay ran (it prints a header per trace).
bool replayed(const Captured& run) {
  return (run.out + run.err).find("trace replay_sample") != std::string::npos;
}

TEST(CliReplay, BadDeviceOrdinalsAreUsageErrorsAsInBench) {
  // Neither wraps: 4294967296 is not device 0, 2147483648 not a negative ordinal.
  for (const char* value :
       {"abc", "-1", "4294967296", "2147483648", "99999999999", "1e3", "0x1", "", " 1"}) {
    for (const bool equals_form : {false, true}) {
      const auto run = equals_form
                           ? capture_replay({sample_trace(), std::string("--device=") + value})
                           : capture_replay({sample_trace(), "--device", value});
      EXPECT_EQ(run.code, 2) << "'" << value << "'";
      EXPECT_NE(run.err.find("vram replay: --device needs a device ordinal"), std::string::npos)
          << "'" << value << "': " << run.err;
      EXPECT_FALSE(replayed(run)) << value;
    }
  }
}

TEST(CliReplay, ADeviceThatIsNotVisibleIsAnErrorNotAHostOnlyRun) {
  // A device that is not visible is never replaced by a host-only replay.
  const int count = vram::cuda::Device::count();
  for (const int device : {99, std::max(count, 1)}) {
    for (const bool host_only : {false, true}) {
      std::vector<std::string> args = {sample_trace(), "--device", std::to_string(device)};
      if (host_only) args.push_back("--host-only");
      const auto run = capture_replay(args);
      EXPECT_EQ(run.code, 2) << device << run.out << run.err;
      EXPECT_NE(run.err.find("--device " + std::to_string(device) +
                             " does not exist: " + std::to_string(count) +
                             (count == 0 ? " devices" : " device(s)") + " visible"),
                std::string::npos)
          << run.err;
      EXPECT_FALSE(replayed(run)) << "nothing may run: " << run.out;
    }
  }
  // --host-only with device 0 (the default) names no device; without --device, no usable
  // device means a host-only replay; an explicit --device 0 with none usable is an error
  // with the fix, as `vram bench --device 0` is.
  const auto run = capture_replay({sample_trace(), "--device", "0", "--host-only"});
  EXPECT_EQ(run.code, 0) << run.err;
  EXPECT_TRUE(replayed(run));
  if (count == 0) {
    const auto fallback = capture_replay({sample_trace()});
    EXPECT_EQ(fallback.code, 0) << fallback.err;
    EXPECT_NE(fallback.out.find("vram replay: host-only ("), std::string::npos) << fallback.out;
    const auto explicit_device = capture_replay({sample_trace(), "--device=0"});
    EXPECT_EQ(explicit_device.code, 2) << explicit_device.out;
    EXPECT_NE(explicit_device.err.find("Fix: drop --device"), std::string::npos)
        << explicit_device.err;
    EXPECT_FALSE(replayed(explicit_device));
  }
}

TEST(CliReplay, StreamLagBeyondItsMaximumIsAUsageError) {
  // A lag past the maximum never wraps the emulated completion to "at once".
  for (const char* value : {"18446744073709551615", "1000000001", "0xffffffffffffffff"}) {
    const auto run = capture_replay({"--host-only", sample_trace(), "--stream-lag", value});
    EXPECT_EQ(run.code, 2) << value;
    EXPECT_NE(run.err.find("--stream-lag needs a whole number from 0 to 1000000000, got '" +
                           std::string(value) + "'"),
              std::string::npos)
        << run.err;
    EXPECT_FALSE(replayed(run));
  }
  for (const char* value : {"0", "1000000000"}) {
    const auto run = capture_replay(
        {"--host-only", sample_trace(), "--json", "-", std::string("--stream-lag=") + value});
    ASSERT_EQ(run.code, 0) << value << run.err;
    EXPECT_NE(run.out.find(std::string("\"stream_lag_events\": ") + value), std::string::npos);
  }
  EXPECT_NE(capture_replay({"--help"}).out.find("0 to 1000000000"), std::string::npos);
}

TEST(CliReplay, ADashReadsTheTraceFromStandardInput) {
  const int saved = ::dup(STDIN_FILENO);
  ASSERT_GE(saved, 0);
  std::FILE* trace = std::fopen(sample_trace().c_str(), "rb");
  ASSERT_NE(trace, nullptr);
  ASSERT_GE(::dup2(::fileno(trace), STDIN_FILENO), 0);
  std::clearerr(stdin);
  const auto run = capture_replay({"--host-only", "-"});
  ::dup2(saved, STDIN_FILENO);
  ::close(saved);
  std::fclose(trace);
  std::clearerr(stdin);
  EXPECT_EQ(run.code, 0) << run.err;
  EXPECT_NE(run.out.find("trace stdin (standard input)"), std::string::npos) << run.out;
}

TEST(CliReplay, ValuesQuotedInMessagesAreCutToAReadableLength) {
  const std::string huge(100000, '7');
  const auto run = capture_replay({"--host-only", sample_trace(), "--passes", huge});
  EXPECT_EQ(run.code, 2);
  EXPECT_NE(run.err.find("(100000 characters)"), std::string::npos) << run.err.substr(0, 300);
  EXPECT_LT(run.err.size(), 400U) << "the whole value was echoed";
  const auto negative = capture_replay({"--host-only", sample_trace(), "--passes", "-1"});
  EXPECT_EQ(negative.code, 2);
  EXPECT_NE(negative.err.find("--passes needs a whole number from 1 to 1000, got '-1'"),
            std::string::npos)
      << negative.err;
}

TEST(CliReplay, ThePassLineOfManyPassesShowsTheFirstAndLastOnes) {
  const auto run = capture_replay({"--host-only", sample_trace(), "--passes", "30"});
  ASSERT_EQ(run.code, 0) << run.err;
  const auto at = run.out.find("by pass (30): ");
  ASSERT_NE(at, std::string::npos) << run.out;
  const std::string line = run.out.substr(at, run.out.find('\n', at) - at);
  EXPECT_NE(line.find(", ..."), std::string::npos) << line;
  EXPECT_LT(line.size(), 600U) << line;
}

// Whether `xml` nests its elements properly (each end tag closes the latest open one).
bool well_formed(const std::string& xml) {
  std::vector<std::string> open;
  for (std::size_t at = xml.find('<'); at != std::string::npos; at = xml.find('<', at + 1)) {
    const std::size_t end = xml.find('>', at);
    if (end == std::string::npos) return false;
    const std::string tag = xml.substr(at + 1, end - at - 1);
    if (tag.empty() || tag[0] == '?' || tag[0] == '!') continue;
    if (tag[0] == '/') {
      if (open.empty() || open.back() != tag.substr(1)) return false;
      open.pop_back();
    } else if (tag.back() != '/') {
      open.push_back(tag.substr(0, tag.find_first_of(" \n")));
    }
  }
  return open.empty();
}

std::size_t occurrences(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(CliReplay, TheSvgPictureHasOneLineOfReservedBytesPerAllocatorAndTheLiveLine) {
  const auto path = (std::filesystem::temp_directory_path() /
                     ("vram_replay_picture_" + std::to_string(::getpid()) + ".svg"))
                        .string();
  std::filesystem::remove(path);
  const auto run = capture_replay({"--host-only", sample_trace(), "--svg", path});
  ASSERT_EQ(run.code, 0) << run.err;
  std::ifstream in(path);
  const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(svg.empty());
  EXPECT_EQ(svg.rfind("<?xml", 0), 0U);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_TRUE(well_formed(svg)) << svg.substr(0, 400);
  // Host-only, the allocators that ran are the DevicePool configurations the table lists.
  std::size_t rows = 0;
  for (const char* name : {"vram DevicePool\"", "vram DevicePool (segments)\"",
                           "vram DevicePool (split every segment)\""}) {
    EXPECT_EQ(occurrences(svg, std::string("data-allocator=\"") + name), 1U) << name;
    ++rows;
  }
  EXPECT_EQ(occurrences(svg, "class=\"reserved\""), rows);
  EXPECT_EQ(occurrences(svg, "class=\"live\""), 1U);
  EXPECT_EQ(occurrences(svg, "class=\"trace\""), 1U);
  // The same rules as --json: never over a trace.
  const auto over = capture_replay({"--host-only", sample_trace(), "--svg", sample_trace()});
  EXPECT_EQ(over.code, 2);
  EXPECT_NE(over.err.find("--svg file"), std::string::npos) << over.err;
  std::filesystem::remove(path);
}

TEST(CliReplay, EveryValueOptionTakesTheEqualsForm) {
  const std::string json = ::testing::TempDir() + "vram-replay-equals.json";
  const auto run = capture_replay({"--host-only", sample_trace(), "--runs=3", "--passes=2",
                                   "--stream-lag=5", "--device=0", "--json=" + json});
  ASSERT_EQ(run.code, 0) << run.err;
  const std::string text = read_text(json);
  EXPECT_TRUE(JsonChecker(text).valid()) << text;
  for (const char* key :
       {"\"runs_per_allocator\": 3", "\"passes_per_run\": 2", "\"stream_lag_events\": 5"}) {
    EXPECT_NE(text.find(key), std::string::npos) << key << "\n" << text;
  }
  EXPECT_EQ(capture_replay({sample_trace(), "--host-only=yes"}).code, 2);
  EXPECT_EQ(capture_replay({sample_trace(), "--host-only", "--runs="}).code, 2);
  const auto unknown = capture_replay({sample_trace(), "--frobnicate=1"});
  EXPECT_EQ(unknown.code, 2);
  EXPECT_NE(unknown.err.find("unknown option '--frobnicate=1'"), std::string::npos) << unknown.err;
  const auto missing = capture_replay({sample_trace(), "--runs"});
  EXPECT_NE(missing.err.find("--runs needs a value"), std::string::npos) << missing.err;
  EXPECT_NE(capture_replay({"--help"}).out.find("--runs=3"), std::string::npos);
  std::remove(json.c_str());
}

TEST(CliReplay, JsonDashWritesOnlyJsonToStdout) {
  // '-' is standard output, never a file of that name.
  std::remove("-");
  const auto run = capture_replay({"--host-only", sample_trace(), "--json", "-"});
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_TRUE(JsonChecker(run.out).valid()) << run.out;
  EXPECT_NE(run.out.find("\"tool\": \"vram replay\""), std::string::npos) << run.out;
  EXPECT_NE(run.err.find("trace replay_sample"), std::string::npos) << "tables go to stderr";
  EXPECT_NE(run.err.find("vram DevicePool"), std::string::npos) << run.err;
  EXPECT_FALSE(std::filesystem::exists("-"));
  std::remove("-");
}

TEST(CliReplay, AnEmptyJsonNameIsRefusedInReplayAndBench) {
  // An empty name is refused, not taken as "no --json".
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--json", ""}, std::vector<std::string>{"--json="}}) {
    std::vector<std::string> replay = {"--host-only", sample_trace()};
    replay.insert(replay.end(), args.begin(), args.end());
    const auto run = capture_replay(replay);
    EXPECT_EQ(run.code, 2);
    EXPECT_NE(run.err.find("vram replay: --json needs a file name"), std::string::npos) << run.err;
    EXPECT_FALSE(replayed(run));
    std::vector<std::string> bench = {"--quick", "--host-only", "--scenario", "pairs"};
    bench.insert(bench.end(), args.begin(), args.end());
    const auto measured = capture_bench(bench);
    EXPECT_EQ(measured.code, 2);
    EXPECT_NE(measured.err.find("vram bench: --json needs a file name"), std::string::npos)
        << measured.err;
  }
}

TEST(CliReplay, AJsonPathThatCannotBeWrittenIsRefusedBeforeTheRun) {
  // A directory is refused before the replay runs, not at the rename after it.
  const std::string directory = ::testing::TempDir() + "vram-replay-json-dir";
  std::filesystem::create_directories(directory);
  auto run = capture_replay({"--host-only", sample_trace(), "--json", directory});
  EXPECT_EQ(run.code, 2);
  EXPECT_NE(run.err.find("cannot write --json file '" + directory + "': it is a directory"),
            std::string::npos)
      << run.err;
  EXPECT_FALSE(replayed(run)) << run.out;
  run = capture_replay({"--host-only", sample_trace(), "--json", directory + "/missing/r.json"});
  EXPECT_EQ(run.code, 2);
  EXPECT_NE(run.err.find("cannot create a file in '" + directory + "/missing'"), std::string::npos)
      << run.err;
  EXPECT_FALSE(replayed(run));
  EXPECT_TRUE(std::filesystem::is_empty(directory)) << "no temporary left behind";
  std::filesystem::remove_all(directory);
}

TEST(CliReplay, AJsonPathThatIsOneOfTheTracesIsRefusedBeforeTheRun) {
  // The trace is never replaced by the report.
  const std::string directory = ::testing::TempDir() + "vram-replay-same";
  std::filesystem::create_directories(directory + "/sub");
  const std::string trace = directory + "/input.csv";
  const std::string original = read_text(sample_trace());
  write_text(trace, original);
  std::filesystem::create_symlink(trace, directory + "/link.csv");
  std::filesystem::create_hard_link(trace, directory + "/hard.csv");
  const std::string relative =
      std::filesystem::relative(trace, std::filesystem::current_path()).string();
  for (const std::string& spelling : {trace, directory + "/./input.csv", directory + "//input.csv",
                                      directory + "/sub/../input.csv", relative,
                                      directory + "/link.csv", directory + "/hard.csv"}) {
    const auto run = capture_replay({"--host-only", sample_trace(), trace, "--json", spelling});
    EXPECT_EQ(run.code, 2) << spelling;
    EXPECT_NE(run.err.find("--json file '" + spelling + "' is the trace '" + trace + "'"),
              std::string::npos)
        << run.err;
    EXPECT_FALSE(replayed(run)) << spelling;
    EXPECT_EQ(read_text(trace), original) << spelling;
  }
  // A different file in the same directory is fine.
  const auto run = capture_replay({"--host-only", trace, "--json", directory + "/input.csv.json"});
  EXPECT_EQ(run.code, 0) << run.err;
  EXPECT_EQ(read_text(trace), original);
  std::filesystem::remove_all(directory);
}

// Runs `vram replay` with standard input read from `path`.
Captured replay_with_stdin(const std::string& path, const std::vector<std::string>& args) {
  const int saved = ::dup(STDIN_FILENO);
  std::FILE* input = std::fopen(path.c_str(), "rb");
  if (saved < 0 || input == nullptr || ::dup2(::fileno(input), STDIN_FILENO) < 0) {
    ADD_FAILURE() << "cannot redirect standard input from " << path;
    return {-1, {}, {}};
  }
  std::clearerr(stdin);
  auto run = capture_replay(args);
  ::dup2(saved, STDIN_FILENO);
  ::close(saved);
  std::fclose(input);
  std::clearerr(stdin);
  return run;
}

TEST(CliReplay, AnOutputThatIsTheFileOnStandardInputIsRefused) {
  // `vram replay - --json t.csv < t.csv`: '-' is whatever fd 0 is.
  const std::string directory = fresh_directory("vram-replay-stdin");
  const std::string trace = directory + "/t.csv";
  const std::string original = read_text(sample_trace());
  write_text(trace, original);
  std::filesystem::create_hard_link(trace, directory + "/hard.csv");
  for (const char* flag : {"--json", "--svg"}) {
    for (const std::string& spelling :
         {trace, directory + "/sub/../t.csv", directory + "/hard.csv"}) {
      const auto run = replay_with_stdin(trace, {"--host-only", "-", flag, spelling});
      EXPECT_EQ(run.code, 2) << flag << " " << spelling << run.out;
      EXPECT_NE(run.err.find(std::string(flag) + " file '" + spelling +
                             "' is the trace '-' (standard input)"),
                std::string::npos)
          << run.err;
      EXPECT_NE(run.err.find("Fix:"), std::string::npos) << run.err;
      EXPECT_EQ(read_text(trace), original) << flag << " " << spelling;
    }
  }
  // Another file is written as before.
  const std::string json = directory + "/r.json";
  const auto run = replay_with_stdin(trace, {"--host-only", "-", "--json", json});
  EXPECT_EQ(run.code, 0) << run.err;
  EXPECT_TRUE(JsonChecker(read_text(json)).valid());
  EXPECT_EQ(read_text(trace), original);
  std::filesystem::remove_all(directory);
}

TEST(CliReplay, JsonAndSvgThatAreOneFileAreRefused) {
  const std::string directory = fresh_directory("vram-replay-one-file");
  const std::string json = directory + "/o.json";
  const std::string trace = sample_trace();
  std::filesystem::create_symlink(json, directory + "/link.json");
  for (const bool exists : {false, true}) {
    if (exists) write_text(json, "precious");
    // Run in `directory`: "o.json" and "./o.json" are one file there. A symlink is one file
    // with its target only while the target exists (before, the rename replaces the link
    // itself, and both outputs are kept).
    std::vector<std::pair<std::string, std::string>> spellings = {
        {json, json},
        {json, directory + "/./o.json"},
        {json, directory + "/sub/../o.json"},
        {"o.json", "./o.json"},
        {"o.json", json}};
    if (exists) spellings.emplace_back(json, directory + "/link.json");
    for (const auto& [first, second] : spellings) {
      const auto run = in_directory(directory, [&] {
        return capture_replay({"--host-only", trace, "--json", first, "--svg", second});
      });
      EXPECT_EQ(run.code, 2) << first << " " << second << " exists: " << exists;
      EXPECT_NE(
          run.err.find("--json file '" + first + "' and --svg file '" + second + "' are one file"),
          std::string::npos)
          << run.err;
      EXPECT_FALSE(replayed(run)) << second;
      if (exists) {
        EXPECT_EQ(read_text(json), "precious") << second;
      } else {
        EXPECT_FALSE(std::filesystem::exists(json)) << second;
      }
    }
  }
  std::filesystem::remove_all(directory);
}

// An existing output that is no regular file (a FIFO, a device) is never replaced by the
// rename of the finished file: refused before the run, left as it is.
TEST(CliOutput, AnOutputThatIsNoRegularFileIsRefused) {
  const std::string directory = fresh_directory("vram-not-regular");
  const std::string fifo = directory + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const std::string device = directory + "/null";  // a symlink to a character device
  std::filesystem::create_symlink("/dev/null", device);
  for (const auto& [path, kind] : {std::pair<std::string, std::string>{fifo, "a FIFO"},
                                   std::pair<std::string, std::string>{device, "a character"}}) {
    const auto bench =
        capture_bench({"--quick", "--host-only", "--scenario", "pairs", "--json", path});
    EXPECT_EQ(bench.code, 2) << path << bench.out;
    const std::string message = "cannot write --json file '" + path + "': it is " + kind;
    EXPECT_NE(bench.err.find(message), std::string::npos) << bench.err;
    EXPECT_NE(bench.err.find("Fix:"), std::string::npos) << bench.err;
    const auto replay = capture_replay({"--host-only", sample_trace(), "--svg", path});
    EXPECT_EQ(replay.code, 2) << path << replay.out;
    EXPECT_NE(replay.err.find("cannot write --svg file '" + path + "': it is " + kind),
              std::string::npos)
        << replay.err;
  }
  EXPECT_TRUE(std::filesystem::is_fifo(fifo));
  EXPECT_TRUE(std::filesystem::is_symlink(device));
  EXPECT_EQ(files_starting_with(directory, "fifo.tmp").size(), 0U);
  std::filesystem::remove_all(directory);
}

}  // namespace
}  // namespace vram::testing
