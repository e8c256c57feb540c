// `vram bench`'s Python peers (tools/bench/python_peer.hpp): the child process, its output
// read back as lines, its exit status, a missing interpreter and a child stopped at its time
// limit. The interpreter is sh here (any program that runs a script file will do), so the
// tests need no Python.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "bench/harness.hpp"
#include "bench/python_peer.hpp"

namespace vram::bench {
namespace {

bool has_line(const ChildRun& run, const std::string& line) {
  return std::find(run.lines.begin(), run.lines.end(), line) != run.lines.end();
}

TEST(BenchPythonPeer, OutputErrorAndExitStatusComeBack) {
  const ChildRun run =
      run_python("sh", "echo out \"$1\"\necho err >&2\nprintf 'no newline'\nexit 3\n", {"arg"}, 30);
  ASSERT_TRUE(run.ran) << run.error;
  EXPECT_EQ(run.exit_code, 3);
  EXPECT_TRUE(has_line(run, "out arg"));
  EXPECT_TRUE(has_line(run, "err"));
  EXPECT_TRUE(has_line(run, "no newline"));
  EXPECT_TRUE(run.error.empty());
}

TEST(BenchPythonPeer, TheScriptFileIsGoneAfterTheRun) {
  const ChildRun run = run_python("sh", "echo \"$0\"\n", {}, 30);
  ASSERT_TRUE(run.ran) << run.error;
  ASSERT_EQ(run.lines.size(), 1U);
  EXPECT_NE(run.lines[0].find("vram-bench-"), std::string::npos);
  EXPECT_FALSE(std::ifstream(run.lines[0]).good());
  const std::string folder = run.lines[0].substr(0, run.lines[0].rfind('/'));
  EXPECT_FALSE(std::filesystem::exists(folder)) << folder;
}

TEST(BenchPythonPeer, AChildThatClosesItsOutputAndRunsOnIsStoppedAtItsLimit) {
  const double start = now_seconds();
  const ChildRun run = run_python("sh", "exec >&- 2>&-\nsleep 30\n", {}, 1);
  EXPECT_LT(now_seconds() - start, 20.0);
  EXPECT_FALSE(run.ran);
  EXPECT_NE(run.error.find("stopped after 1 s"), std::string::npos) << run.error;
}

TEST(BenchPythonPeer, AMissingInterpreterIsSaidNotThrown) {
  const ChildRun run = run_python("/nonexistent/python-for-vram-tests", "print(1)\n", {}, 30);
  EXPECT_FALSE(run.ran);
  EXPECT_NE(run.error.find("/nonexistent/python-for-vram-tests"), std::string::npos) << run.error;
}

TEST(BenchPythonPeer, AChildPastItsTimeLimitIsStopped) {
  const double start = now_seconds();
  const ChildRun run = run_python("sh", "echo started\nsleep 30\necho never\n", {}, 1);
  EXPECT_LT(now_seconds() - start, 20.0);
  EXPECT_FALSE(run.ran);
  EXPECT_NE(run.error.find("stopped after 1 s"), std::string::npos) << run.error;
  EXPECT_TRUE(has_line(run, "started"));
  EXPECT_FALSE(has_line(run, "never"));
}

TEST(BenchPythonPeer, TheSleepPeerScriptIsCarriedWhole) {
  const std::string script = torch_sleep_script();
  EXPECT_NE(script.find("def child_tms"), std::string::npos);
  EXPECT_NE(script.find("def _print_lines"), std::string::npos);
  EXPECT_NE(script.find("if __name__ == \"__main__\":"), std::string::npos);
}

}  // namespace
}  // namespace vram::bench
