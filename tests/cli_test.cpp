// The CLI's commands, called in-process: argument errors, exit codes, well-formed JSON.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "commands.hpp"

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
  // GPU-only scenarios are accepted and reported as skipped on a host-only run.
  ::testing::internal::CaptureStdout();
  const int code = cli::run_bench({"--host-only", "--scenario", "overhead,pagein,pinning"});
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(code, 0) << out;
  for (const char* name : {"overhead", "pagein", "pinning"}) {
    EXPECT_NE(out.find(std::string("scenario '") + name + "' skipped: it needs a GPU"),
              std::string::npos)
        << out;
  }
}

}  // namespace
}  // namespace vram::testing
