// `vram replay`: trace parsing (plain and gzip, bad input), the replay driver's figures and
// stream-order rule over host memory, the JSON report, capacity search, and the bench's
// replay and batched scenarios. One GPU test replays the sample through every peer.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench/scenarios.hpp"
#include "commands.hpp"
#include "gpu_test_policy.hpp"
#include "replay/replay.hpp"
#include "replay/replay_allocator.hpp"
#include "replay/replay_cli.hpp"
#include "replay/trace.hpp"
#include "source_tree.hpp"

namespace vram::testing {
namespace {

using replay::AllocatorSpec;
using replay::ReplayOptions;
using replay::Trace;

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * 1024;

std::string sample_path() { return vram::testing::source_path("tests/data/replay_sample.csv"); }

std::string read_file(const std::string& path) {
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  return text.str();
}

// In a folder of this process: two runs of the tests at once (two builds) never share a file.
std::string temp_path(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "vram-tests-" + std::to_string(::getpid()) + "/";
  std::filesystem::create_directories(dir);
  return dir + name;
}

void write_gzip(const std::string& path, const std::string& text) {
  gzFile file = gzopen(path.c_str(), "wb");
  ASSERT_NE(file, nullptr);
  ASSERT_EQ(gzwrite(file, text.data(), static_cast<unsigned>(text.size())),
            static_cast<int>(text.size()));
  ASSERT_EQ(gzclose(file), Z_OK);
}

std::string parse_error(const std::string& text, const std::string& name = "t.csv") {
  try {
    (void)replay::parse_trace(text, name);
  } catch (const replay::TraceError& error) {
    return error.what();
  }
  return "";
}

const std::string kHeader = "Thread,Time,Action,Pointer,Size,Stream\n";

TEST(ReplayTrace, ParsesEveryActionAndComputesPeakLive) {
  const Trace trace = replay::read_trace(sample_path());
  // tests/data/replay_sample.csv: 11 data rows, one of them `allocate failure`.
  EXPECT_EQ(trace.rows, 11U);
  EXPECT_EQ(trace.events.size(), 10U);
  EXPECT_EQ(trace.slots, 5U);
  EXPECT_EQ(trace.allocate_failures, 1U);
  EXPECT_EQ(trace.unknown_frees, 0U);
  EXPECT_EQ(trace.live_at_end, 0U);
  ASSERT_EQ(trace.streams.size(), 1U);
  // Live at row 7: 0x3000 (1 MiB) + 0x4000 (8 KiB) + 0x5000 (2 MiB); never more before.
  EXPECT_EQ(trace.peak_live_bytes, 1 * MiB + 8 * KiB + 2 * MiB);
  EXPECT_EQ(trace.peak_live_row, 7U);
  EXPECT_EQ(trace.name, "replay_sample");
  // `free` (older logs) frees like `deallocate`: the 0x1000 block's free is event 5.
  EXPECT_FALSE(trace.events[5].allocate);
  EXPECT_EQ(trace.events[5].slot, trace.events[0].slot);
  EXPECT_EQ(trace.events[5].line, 7U);
}

TEST(ReplayTrace, ColumnsByHeaderNameHexAndDecimalAndStreams) {
  const Trace trace = replay::parse_trace(
      "Action,Size,Pointer,Stream\n"
      "allocate,0x100,4096,7\n"
      "ALLOCATE,512,0x2000,0x9\n"
      "\n"
      "deallocate,256,0x1000,7\n"
      "free,512,8192,9\n",
      "x.csv");
  ASSERT_EQ(trace.events.size(), 4U);
  EXPECT_EQ(trace.events[0].bytes, 256U);
  EXPECT_EQ(trace.streams, (std::vector<std::uint64_t>{7, 9}));
  EXPECT_EQ(trace.events[1].stream_index, 1U);
  EXPECT_EQ(trace.events[3].slot, trace.events[1].slot);  // 8192 == 0x2000
  EXPECT_EQ(trace.peak_live_bytes, 768U);
  EXPECT_EQ(trace.events[2].line, 5U);  // the blank line counts as a line, not as a row
}

TEST(ReplayTrace, GzipTraceReadsLikeThePlainOne) {
  const std::string text = read_file(sample_path());
  const std::string gz = temp_path("replay_sample_copy.csv.gz");
  write_gzip(gz, text);
  const Trace plain = replay::read_trace(sample_path());
  const Trace packed = replay::read_trace(gz);
  ASSERT_EQ(packed.events.size(), plain.events.size());
  for (std::size_t i = 0; i < plain.events.size(); ++i) {
    EXPECT_EQ(packed.events[i].allocate, plain.events[i].allocate) << i;
    EXPECT_EQ(packed.events[i].bytes, plain.events[i].bytes) << i;
    EXPECT_EQ(packed.events[i].slot, plain.events[i].slot) << i;
    EXPECT_EQ(packed.events[i].line, plain.events[i].line) << i;
  }
  EXPECT_EQ(packed.peak_live_bytes, plain.peak_live_bytes);
  EXPECT_EQ(packed.name, "replay_sample_copy");
  std::remove(gz.c_str());
}

TEST(ReplayTrace, TruncatedGzipIsAnErrorNamingTheFile) {
  const std::string gz = temp_path("replay_truncated.csv.gz");
  std::string text = kHeader;
  for (int i = 0; i < 2000; ++i) {
    text += "1,0,allocate,0x" + std::to_string(1000 + i) + "00,4096,0\n";
  }
  write_gzip(gz, text);
  const std::string packed = read_file(gz);
  std::ofstream(gz, std::ios::binary | std::ios::trunc) << packed.substr(0, packed.size() / 2);
  try {
    (void)replay::read_trace(gz);
    ADD_FAILURE() << "a truncated gzip file was read without error";
  } catch (const replay::TraceError& error) {
    EXPECT_NE(std::string(error.what()).find(gz + ":"), std::string::npos) << error.what();
  }
  std::remove(gz.c_str());
}

TEST(ReplayTrace, MalformedLinesNameFileLineAndProblem) {
  const std::string a = parse_error(kHeader + "1,0,allocate,0x10,64,0\n1,0,allocate,0x20,abc,0\n");
  EXPECT_NE(a.find("t.csv:3:"), std::string::npos) << a;
  EXPECT_NE(a.find("bad size 'abc'"), std::string::npos) << a;
  const std::string b = parse_error(kHeader + "1,0,reallocate,0x10,64,0\n");
  EXPECT_NE(b.find("t.csv:2:"), std::string::npos) << b;
  EXPECT_NE(b.find("unknown action 'reallocate'"), std::string::npos) << b;
  const std::string c = parse_error(kHeader + "1,0,allocate,0x10,64\n");
  EXPECT_NE(c.find("t.csv:2: expected 6 comma-separated fields, got 5"), std::string::npos) << c;
  const std::string d = parse_error("1,0,allocate,0x10,64,0\n");
  EXPECT_NE(d.find("t.csv:1: header must name"), std::string::npos) << d;
  const std::string e = parse_error(kHeader + "1,0,allocate,0xZZ,64,0\n");
  EXPECT_NE(e.find("t.csv:2: bad pointer '0xZZ'"), std::string::npos) << e;
  const std::string f = parse_error(kHeader + "1,0,allocate,0x10,0,0\n");
  EXPECT_NE(f.find("t.csv:2: allocation of 0 bytes"), std::string::npos) << f;
  const std::string g = parse_error("");
  EXPECT_NE(g.find("t.csv:1: no header line"), std::string::npos) << g;
  const std::string h = parse_error(kHeader + "1,0,allocate,0x10,99999999999999999999999,0\n");
  EXPECT_NE(h.find("bad size"), std::string::npos) << h;
}

TEST(ReplayTrace, LiveBytesBeyond64BitsAreAnErrorNamingTheLine) {
  // Two live allocations of 2^63 bytes: the sum does not wrap to a small peak.
  const std::string two_halves =
      "1,0,allocate,0x10,0x8000000000000000,0\n1,0,allocate,0x20,0x8000000000000000,0\n";
  const std::string a = parse_error(kHeader + two_halves);
  EXPECT_NE(a.find("t.csv:3: allocation of 9223372036854775808 bytes on top of "
                   "9223372036854775808 live bytes exceeds 2^64 - 1"),
            std::string::npos)
      << a;
  EXPECT_NE(a.find("Fix:"), std::string::npos) << a;
  // Up to 2^64 - 1 live, and again after a free, the trace reads.
  const Trace trace = replay::parse_trace(
      kHeader +
          "1,0,allocate,0x10,0x8000000000000000,0\n1,0,allocate,0x20,0x7fffffffffffffff,0\n"
          "1,0,free,0x20,0x7fffffffffffffff,0\n1,0,allocate,0x30,0x7fffffffffffffff,0\n",
      "t.csv");
  EXPECT_EQ(trace.peak_live_bytes, ~std::size_t{0});
  // The CLI exits 2 naming the line.
  const std::string path = temp_path("replay_wraps.csv");
  std::ofstream(path) << kHeader << two_halves;
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int code = cli::run_replay({"--host-only", path});
  (void)::testing::internal::GetCapturedStdout();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(code, 2);
  EXPECT_NE(err.find(path + ":3: allocation of"), std::string::npos) << err;
  std::remove(path.c_str());
}

TEST(ReplayTrace, CliExitsTwoOnAMalformedTraceNamingFileAndLine) {
  const std::string path = temp_path("replay_bad.csv");
  std::ofstream(path) << kHeader << "1,0,allocate,0x10,64,0\n1,0,allocate,0x20,-5,0\n";
  ::testing::internal::CaptureStderr();
  ::testing::internal::CaptureStdout();
  const int code = cli::run_replay({"--host-only", path});
  (void)::testing::internal::GetCapturedStdout();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(code, 2);
  EXPECT_NE(err.find(path + ":3: bad size '-5'"), std::string::npos) << err;
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(cli::run_replay({"--host-only", temp_path("no-such-trace.csv")}), 2);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("cannot open"), std::string::npos);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(cli::run_replay({"--host-only"}), 2);
  EXPECT_EQ(cli::run_replay({"--host-only", "--frobnicate", path}), 2);
  (void)::testing::internal::GetCapturedStderr();
  std::remove(path.c_str());
}

// Stream ids map to dense indices in first-seen order in time linear in the events: 400,000
// distinct streams parse in about a second (they took over a minute when every new
// stream was looked up by a scan of the ones before it). The bound only catches a
// quadratic lookup; the structure is what is asserted.
TEST(ReplayTrace, ManyDistinctStreamsParseInLinearTime) {
  constexpr std::size_t kStreams = 400000;
  std::string text = kHeader;
  text.reserve(kStreams * 48);
  for (std::size_t i = 0; i < kStreams; ++i) {
    // Stream ids in a scattered order, so neither a sorted nor a last-seen lookup is enough.
    const std::uint64_t stream = (i * 2654435761ULL) % 1000000007ULL;
    text += "1,0,allocate,0x" + std::to_string(i + 1) + "000,64," + std::to_string(stream) + "\n";
  }
  text += "1,0,allocate,0xfffffff000,64,0x0\n";  // stream 0 again, in hex
  const auto start = std::chrono::steady_clock::now();
  const Trace trace = replay::parse_trace(text, "streams.csv");
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(trace.streams.size(), kStreams);
  ASSERT_EQ(trace.events.size(), kStreams + 1);
  for (std::size_t i = 0; i < kStreams; i += 9973) {
    EXPECT_EQ(trace.events[i].stream_index, i) << i;
    EXPECT_EQ(trace.streams[i], trace.events[i].stream) << i;
  }
  EXPECT_EQ(trace.events.back().stream_index, 0U) << "stream 0 was the first one seen";
  EXPECT_LT(seconds, 20.0) << "parsing " << kStreams << " streams took " << seconds << " s";
}

// The TraceError of reading `path`, or "" when it reads without one.
std::string read_error(const std::string& path) {
  try {
    (void)replay::read_trace(path);
  } catch (const replay::TraceError& error) {
    return error.what();
  }
  return "";
}

void write_binary(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// The gzip member of `text`, as `gzip` writes it.
std::string gzip_bytes(const std::string& text) {
  const std::string path = temp_path("replay_gzip_member.gz");
  write_gzip(path, text);
  std::string bytes = read_file(path);
  std::remove(path.c_str());
  return bytes;
}

using namespace std::string_literals;

TEST(ReplayTrace, ANulByteIsAnErrorNamingItsLine) {
  // At the start of a line (the events after it are not dropped).
  const std::string a = parse_error(kHeader + "1,0,allocate,0x10,64,0\n\0"s +
                                    "1,0,allocate,0x20,64,0\n1,0,allocate,0x30,64,0\n");
  EXPECT_NE(a.find("t.csv:3: NUL byte at column 1"), std::string::npos) << a;
  // Inside a line (the line is not merged with the next one).
  const std::string b =
      parse_error(kHeader + "1,0,allocate,0x10,64,0\0\n"s + "1,0,allocate,0x20,64,0\n");
  EXPECT_NE(b.find("t.csv:2: NUL byte at column 23"), std::string::npos) << b;
  // In the header, and as a line of its own.
  EXPECT_NE(parse_error("Thread,Time,Action,Pointer,Size,Stream\0\n"s).find("t.csv:1: NUL byte"),
            std::string::npos);
  EXPECT_NE(parse_error(kHeader + "\0\n"s).find("t.csv:2: NUL byte"), std::string::npos);
  // Read from a file, plain and gzip, and through the CLI: exit 2, the message on stderr.
  const std::string text = kHeader + "1,0,allocate,0x10,64,0\n\0"s + "1,0,allocate,0x20,64,0\n";
  const std::string plain = temp_path("replay_nul.csv");
  const std::string packed = temp_path("replay_nul.csv.gz");
  write_binary(plain, text);
  write_gzip(packed, text);
  for (const std::string& path : {plain, packed}) {
    const std::string error = read_error(path);
    EXPECT_NE(error.find(path + ":3: NUL byte at column 1"), std::string::npos) << error;
    ::testing::internal::CaptureStdout();
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(cli::run_replay({"--host-only", path}), 2) << path;
    (void)::testing::internal::GetCapturedStdout();
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find(path + ":3: NUL byte"), std::string::npos) << err;
  }
  std::remove(plain.c_str());
  std::remove(packed.c_str());
}

TEST(ReplayTrace, LineNumbersStayExactAcrossLongLinesInFilesPlainAndGzip) {
  // A 300,000-byte Thread field (the column is not parsed) puts line 3 across every read
  // buffer boundary; the bad size on line 5 is still reported as line 5.
  std::string text = kHeader + "1,0,allocate,0x10,64,0\n" + std::string(300000, '7') +
                     ",0,allocate,0x20,64,0\n\n1,0,allocate,0x30,x64,0\n";
  const std::string plain = temp_path("replay_long_line.csv");
  const std::string packed = temp_path("replay_long_line.csv.gz");
  write_binary(plain, text);
  write_gzip(packed, text);
  for (const std::string& path : {plain, packed}) {
    const std::string error = read_error(path);
    EXPECT_NE(error.find(path + ":5: bad size 'x64'"), std::string::npos) << error;
  }
  EXPECT_NE(parse_error(text).find("t.csv:5: bad size 'x64'"), std::string::npos);
  // Without the bad line the events carry their exact lines.
  text.resize(text.rfind("1,0,allocate,0x30"));
  write_gzip(packed, text + "1,0,deallocate,0x20,64,0");  // the last line unterminated
  const Trace trace = replay::read_trace(packed);
  ASSERT_EQ(trace.events.size(), 3U);
  EXPECT_EQ(trace.events[1].line, 3U);
  EXPECT_EQ(trace.events[2].line, 5U);
  std::remove(plain.c_str());
  std::remove(packed.c_str());
}

TEST(ReplayTrace, ConcatenatedGzipMembersReadAsOneTrace) {
  // `cat a.gz b.gz` is a valid gzip file (gzip -d reads both members).
  const std::string text = read_file(sample_path());
  const std::size_t half = text.find('\n', text.size() / 2) + 1;
  const std::string gz = temp_path("replay_members.csv.gz");
  write_binary(gz, gzip_bytes(text.substr(0, half)) + gzip_bytes(text.substr(half)));
  const Trace plain = replay::read_trace(sample_path());
  const Trace packed = replay::read_trace(gz);
  ASSERT_EQ(packed.events.size(), plain.events.size());
  for (std::size_t i = 0; i < plain.events.size(); ++i) {
    EXPECT_EQ(packed.events[i].line, plain.events[i].line) << i;
    EXPECT_EQ(packed.events[i].bytes, plain.events[i].bytes) << i;
  }
  EXPECT_EQ(packed.rows, plain.rows);
  std::remove(gz.c_str());
}

TEST(ReplayTrace, BytesAfterTheGzipDataThatAreNoGzipMemberAreAnError) {
  const std::string member = gzip_bytes(read_file(sample_path()));
  const std::string gz = temp_path("replay_junk.csv.gz");
  for (const std::string& junk : {"garbage\n"s, "\0\0\0\0"s, "\x1f"s, "\x1f\x8c"s}) {
    write_binary(gz, member + junk);
    const std::string error = read_error(gz);
    EXPECT_NE(error.find(gz + ": junk after the end of the gzip data at byte " +
                         std::to_string(member.size())),
              std::string::npos)
        << error;
  }
  // A second member that is itself cut short is a truncated stream.
  std::string rows;
  for (int i = 0; i < 2000; ++i) rows += "1,0,allocate,0x" + std::to_string(1000 + i) + "00,64,0\n";
  const std::string second = gzip_bytes(rows);
  write_binary(gz, member + second.substr(0, second.size() / 2));
  EXPECT_NE(read_error(gz).find("gzip stream is truncated"), std::string::npos) << read_error(gz);
  std::remove(gz.c_str());
}

TEST(ReplayTrace, TruncatedOrCorruptGzipSaysSo) {
  std::string text = kHeader;
  for (int i = 0; i < 2000; ++i) {
    text += "1,0,allocate,0x" + std::to_string(1000 + i) + "00,4096,0\n";
  }
  const std::string member = gzip_bytes(text);
  const std::string gz = temp_path("replay_cut.csv.gz");
  // Cut inside the header, the compressed data, and the CRC/length trailer.
  for (const std::size_t keep :
       {std::size_t{5}, member.size() / 2, member.size() - 6, member.size() - 1}) {
    write_binary(gz, member.substr(0, keep));
    const std::string error = read_error(gz);
    EXPECT_NE(error.find(gz + ":"), std::string::npos) << keep << ": " << error;
    EXPECT_NE(error.find("gzip stream is truncated"), std::string::npos) << keep << ": " << error;
    EXPECT_EQ(error.find("comma-separated fields"), std::string::npos) << keep << ": " << error;
  }
  // A wrong CRC: the data is corrupt, not cut short.
  std::string corrupt = member;
  corrupt[corrupt.size() - 8] = static_cast<char>(corrupt[corrupt.size() - 8] ^ 0x55);
  write_binary(gz, corrupt);
  const std::string error = read_error(gz);
  EXPECT_NE(error.find("corrupt gzip data"), std::string::npos) << error;
  std::remove(gz.c_str());
}

TEST(ReplayTrace, MessagesQuotingTheFileEscapeControlBytes) {
  const std::vector<std::string> errors = {
      parse_error(kHeader + "1,0,\x1b[2J\x1b]0;owned\x07,0x10,64,0\n"),
      parse_error(kHeader + "1,0,allocate,0x10,6\x1b[31m4,0\n"),
      parse_error(kHeader + "1,0,allocate,\x9b"
                            "31m,64,0\n"),
      parse_error(kHeader + "1,0,allocate,0x10,64,\r7\n"),
      parse_error("Thread,\x1b[1mTime\x7f,Act\\ion\n"),
  };
  const std::vector<std::string> quoted = {
      "unknown action '\\x1b[2J\\x1b]0;owned\\x07'", "bad size '6\\x1b[31m4'",
      "bad pointer '\\x9b31m'", "bad stream '\\x0d7'", "got 'Thread,\\x1b[1mTime\\x7f,Act\\\\ion'"};
  for (std::size_t i = 0; i < errors.size(); ++i) {
    EXPECT_NE(errors[i].find(quoted[i]), std::string::npos) << errors[i];
    for (const char c : errors[i]) {
      const auto byte = static_cast<unsigned char>(c);
      EXPECT_TRUE(byte >= 0x20 && byte < 0x7f) << "raw byte " << int{byte} << " in " << i;
    }
  }
}

TEST(ReplayTrace, UnknownFreesAreCountedAndSkippedReusedLivePointersReported) {
  const Trace trace = replay::parse_trace(kHeader +
                                              "1,0,deallocate,0x900,64,0\n"  // never allocated
                                              "1,0,allocate,0x100,64,0\n"
                                              "1,0,deallocate,0x100,64,0\n"
                                              "1,0,deallocate,0x100,64,0\n"  // double free
                                              "1,0,allocate,0x200,128,0\n"
                                              "1,0,allocate,0x200,256,0\n"  // lost free
                                              "1,0,deallocate,0x200,256,0\n",
                                          "u.csv");
  EXPECT_EQ(trace.unknown_frees, 2U);
  ASSERT_EQ(trace.unknown_free_examples.size(), 2U);
  EXPECT_NE(trace.unknown_free_examples[0].find("u.csv:2: free of unknown pointer 0x900"),
            std::string::npos)
      << trace.unknown_free_examples[0];
  EXPECT_NE(trace.unknown_free_examples[1].find("u.csv:5:"), std::string::npos);
  EXPECT_EQ(trace.reused_live_pointers, 1U);
  ASSERT_EQ(trace.reused_live_examples.size(), 1U);
  EXPECT_NE(trace.reused_live_examples[0].find("u.csv:7: pointer 0x200 allocated again"),
            std::string::npos)
      << trace.reused_live_examples[0];
  // allocate, free, allocate, implicit free, allocate, free: consistent for the replay.
  ASSERT_EQ(trace.events.size(), 6U);
  EXPECT_FALSE(trace.events[3].allocate);
  EXPECT_EQ(trace.events[3].slot, trace.events[2].slot);
  EXPECT_EQ(trace.live_at_end, 0U);
  EXPECT_EQ(trace.peak_live_bytes, 256U);
  const auto result = replay::replay_trace(trace, replay::device_pool_spec(), ReplayOptions{});
  EXPECT_FALSE(result.failed_at.has_value()) << result.failure;
  EXPECT_EQ(result.operations, 6U);
}

TEST(ReplayHostOnly, SampleTraceFigures) {
  const Trace trace = replay::read_trace(sample_path());
  const auto result = replay::replay_trace(trace, replay::device_pool_spec(), ReplayOptions{});
  EXPECT_EQ(result.trace, "replay_sample");
  EXPECT_EQ(result.allocator, "vram DevicePool");
  EXPECT_EQ(result.operations, 10U);
  EXPECT_FALSE(result.failed_at.has_value()) << result.failure;
  EXPECT_EQ(result.peak_live_bytes, trace.peak_live_bytes);
  EXPECT_GE(result.peak_reserved_bytes, result.peak_live_bytes);
  EXPECT_GE(result.reserved_over_live(), 1.0);
  ASSERT_TRUE(result.upstream_allocations.has_value());
  // Five allocations of five different sizes: at least one upstream call, at most five.
  EXPECT_GE(*result.upstream_allocations, 1U);
  EXPECT_LE(*result.upstream_allocations, 5U);
  EXPECT_GT(result.ns_per_op, 0.0);
  EXPECT_EQ(result.held_back_frees, 0U);  // one stream: frees go through at once
  // One stream, nothing past the budget: the pool never synchronized the device.
  ASSERT_TRUE(result.device_synchronizes.has_value());
  EXPECT_EQ(*result.device_synchronizes, 0U);
}

TEST(ReplayHostOnly, RecordedTraceGivesTheSameFiguresInEveryRunWhateverTheHeap) {
  // A recorded trace and a pool configuration whose fits depend on the segments' addresses:
  // host-only, those come from the replay's address-only upstream, never from malloc.
  const Trace trace =
      replay::read_trace(vram::testing::source_path("bench/traces/conv_training.csv.gz"));
  std::optional<replay::AllocatorSpec> split;
  for (auto& spec : replay::all_replay_allocators()) {
    if (spec.name == "vram DevicePool (split every segment)") split = std::move(spec);
  }
  ASSERT_TRUE(split.has_value());
  ReplayOptions options;
  options.passes = 2;
  const auto first = replay::replay_trace(trace, *split, options);
  // Other heap blocks between the runs: malloc hands out other addresses from here on.
  std::vector<std::unique_ptr<char[]>> heap;
  for (std::size_t i = 0; i < 64; ++i) heap.emplace_back(new char[(i % 7 + 1) * 300'000]);
  const auto second = replay::replay_trace(trace, *split, options);
  EXPECT_FALSE(first.failed_at.has_value()) << first.failure;
  EXPECT_EQ(first.peak_reserved_bytes, second.peak_reserved_bytes);
  EXPECT_EQ(first.upstream_allocations, second.upstream_allocations);
  EXPECT_EQ(first.pass_upstream_allocations, second.pass_upstream_allocations);
  EXPECT_EQ(first.device_synchronizes, second.device_synchronizes);
}

TEST(ReplayHostOnly, FailingAllocationReportsItsRow) {
  // Rows: 0 allocate 1 MiB, 1 allocate 1 MiB, 2 `allocate failure` (skipped, still a row),
  // 3 free, 4 allocate 4 MiB: cannot fit a 3 MiB device, whatever is cached.
  const Trace trace = replay::parse_trace(kHeader +
                                              "1,0,allocate,0x100000,1048576,0\n"
                                              "1,0,allocate,0x200000,1048576,0\n"
                                              "1,0,allocate failure,0x0,99,0\n"
                                              "1,0,deallocate,0x100000,1048576,0\n"
                                              "1,0,allocate,0x400000,4194304,0\n"
                                              "1,0,deallocate,0x400000,4194304,0\n",
                                          "fail.csv");
  ReplayOptions options;
  options.capacity_bytes = 3 * MiB;
  const auto result = replay::replay_trace(trace, replay::device_pool_spec(), options);
  ASSERT_TRUE(result.failed_at.has_value());
  EXPECT_EQ(*result.failed_at, 4U);
  EXPECT_EQ(result.failed_line, 6U);
  EXPECT_EQ(result.operations, 3U);  // the events before the failing one
  EXPECT_FALSE(result.failure.empty());
  // With room for it the same trace runs to the end.
  options.capacity_bytes = 6 * MiB;
  EXPECT_FALSE(replay::replay_trace(trace, replay::device_pool_spec(), options).failed_at);
}

// A stream-unaware allocator that records the order of calls, to check the driver.
struct CallLog {
  std::vector<std::string> calls;
};

AllocatorSpec recording_spec(CallLog& log, bool stream_ordered) {
  class Recording final : public replay::ReplayAllocator {
   public:
    Recording(CallLog& log, bool ordered) : log_(log), ordered_(ordered) {}
    void* allocate(std::size_t bytes, replay::ReplayStream stream) override {
      log_.calls.push_back("alloc " + std::to_string(bytes) + " s" + std::to_string(stream.index));
      return reinterpret_cast<void*>(next_ += 4096);
    }
    void deallocate(void*, std::size_t bytes, replay::ReplayStream stream) override {
      log_.calls.push_back("free " + std::to_string(bytes) + " s" + std::to_string(stream.index));
    }
    bool stream_ordered() const override { return ordered_; }
    std::size_t peak_reserved_bytes() override { return 0; }
    std::size_t reserved_bytes() override { return 0; }
    std::optional<std::uint64_t> upstream_allocations() override { return std::nullopt; }

   private:
    CallLog& log_;
    bool ordered_;
    std::uintptr_t next_ = 0;
  };
  AllocatorSpec spec;
  spec.name = "recording";
  spec.needs_gpu = false;
  spec.make = [&log, stream_ordered](const replay::ReplayContext&) {
    return std::make_unique<Recording>(log, stream_ordered);
  };
  return spec;
}

// Stream 1 frees a block; stream 2 allocates the same size right after.
const std::string kCrossStream = kHeader +
                                 "1,0,allocate,0x100000,1048576,1\n"
                                 "1,0,deallocate,0x100000,1048576,1\n"
                                 "1,0,allocate,0x100000,1048576,2\n"
                                 "1,0,deallocate,0x100000,1048576,2\n";

TEST(ReplayHostOnly, CrossStreamFreeIsNotReusableBeforeEmulatedCompletion) {
  const Trace trace = replay::parse_trace(kCrossStream, "streams.csv");
  ASSERT_EQ(trace.streams.size(), 2U);
  ReplayOptions options;
  options.stream_lag = 8;
  // The driver holds stream 1's free back past stream 2's allocation.
  CallLog log;
  auto result = replay::replay_trace(trace, recording_spec(log, false), options);
  ASSERT_GE(log.calls.size(), 3U);
  EXPECT_EQ(log.calls[0], "alloc 1048576 s0");
  EXPECT_EQ(log.calls[1], "alloc 1048576 s1");  // before stream 0's free reached the allocator
  EXPECT_EQ(log.calls[2], "free 1048576 s0");
  EXPECT_EQ(result.held_back_frees, 2U);
  // So host-only DevicePool cannot hand stream 2 the block stream 1 freed: two blocks live.
  result = replay::replay_trace(trace, replay::device_pool_spec(), options);
  EXPECT_FALSE(result.failed_at.has_value()) << result.failure;
  EXPECT_EQ(result.held_back_frees, 2U);
  EXPECT_GE(result.peak_reserved_bytes, 2 * MiB);
  // Once the emulated completion has passed (lag 1: one event later) nothing is held back.
  options.stream_lag = 1;
  result = replay::replay_trace(trace, replay::device_pool_spec(), options);
  EXPECT_FALSE(result.failed_at.has_value()) << result.failure;
  // A stream-ordered allocator is called in trace order, nothing held back.
  CallLog ordered;
  result = replay::replay_trace(trace, recording_spec(ordered, true), options);
  EXPECT_EQ(ordered.calls, (std::vector<std::string>{"alloc 1048576 s0", "free 1048576 s0",
                                                     "alloc 1048576 s1", "free 1048576 s1"}));
  EXPECT_EQ(result.held_back_frees, 0U);
}

TEST(ReplayHostOnly, HeldBackFreesAreWaitedForBeforeAnAllocationFails) {
  // Room for one 1 MiB block only (the emulated large tier maps 2 MiB granules, and the
  // 1 MiB class is carved out of it): stream 2's allocation fits once stream 1's held-back
  // free is completed (the driver waits for it, as a stream-ordered pool would).
  const Trace trace = replay::parse_trace(kCrossStream, "streams.csv");
  ReplayOptions options;
  options.stream_lag = 8;
  options.capacity_bytes = 2 * MiB + MiB / 2;
  const auto result = replay::replay_trace(trace, replay::device_pool_spec(), options);
  EXPECT_FALSE(result.failed_at.has_value()) << result.failure;
  EXPECT_LE(result.peak_reserved_bytes, options.capacity_bytes);
}

TEST(ReplayHostOnly, CapacitySearchFindsASurvivingCapacityAtLeastPeakLive) {
  const Trace trace = replay::read_trace(sample_path());
  const auto spec = replay::device_pool_spec();
  const auto unbounded = replay::replay_trace(trace, spec, ReplayOptions{});
  const auto capacity =
      replay::min_capacity(trace, spec, ReplayOptions{}, unbounded.peak_reserved_bytes);
  ASSERT_TRUE(capacity.has_value());
  EXPECT_GE(*capacity, trace.peak_live_bytes);
  ReplayOptions bounded;
  bounded.capacity_bytes = *capacity;
  EXPECT_FALSE(replay::replay_trace(trace, spec, bounded).failed_at.has_value());
  bounded.capacity_bytes = trace.peak_live_bytes - 1;
  EXPECT_TRUE(replay::replay_trace(trace, spec, bounded).failed_at.has_value());
}

TEST(ReplayCli, JsonHasOneRecordPerTraceAndAllocatorWithNullFailedAt) {
  const std::string json = temp_path("replay-test.json");
  std::remove(json.c_str());
  ::testing::internal::CaptureStdout();
  const int code =
      cli::run_replay({"--host-only", "--capacity-search", sample_path(), "--json", json});
  const std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("vram DevicePool"), std::string::npos) << out;
  EXPECT_NE(out.find("skipped: cudaMallocAsync (private pool)"), std::string::npos) << out;
  const std::string text = read_file(json);
  for (const char* key :
       {"\"trace\": \"replay_sample\"", "\"allocator\": \"vram DevicePool\"", "\"operations\": 10",
        "\"ns_per_op\": ", "\"peak_live_bytes\": 3153920",
        "\"peak_reserved_bytes\": ", "\"upstream_allocations\": ", "\"failed_at\": null",
        "\"min_capacity_bytes\": ", "\"mode\": \"host-only\"",
        "\"allocator\": \"CUB CachingDeviceAllocator\", \"reason\""}) {
    EXPECT_NE(text.find(key), std::string::npos) << key << "\n" << text;
  }
  // One record per allocator that runs host-only (the three DevicePool configurations) for
  // the one trace; no temporary left behind.
  std::size_t records = 0;
  for (std::size_t at = text.find("\"ns_per_op\""); at != std::string::npos;
       at = text.find("\"ns_per_op\"", at + 1)) {
    ++records;
  }
  std::size_t host_capable = 0;
  for (const auto& spec : replay::all_replay_allocators()) host_capable += spec.needs_gpu ? 0 : 1;
  EXPECT_EQ(host_capable, 3U);
  EXPECT_EQ(records, host_capable);
  EXPECT_NE(text.find("\"allocator\": \"vram DevicePool (segments)\""), std::string::npos);
  for (const auto& entry : std::filesystem::directory_iterator(::testing::TempDir())) {
    EXPECT_EQ(entry.path().filename().string().find("replay-test.json.tmp"), std::string::npos);
  }
  std::remove(json.c_str());
}

TEST(ReplayCli, RunsRepeatsEveryAllocatorAndReportsTheMedianRun) {
  const std::string json = temp_path("replay-runs.json");
  ::testing::internal::CaptureStdout();
  const int code = cli::run_replay({"--host-only", "--runs", "3", sample_path(), "--json", json});
  const std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("ns/op median of 3 runs"), std::string::npos) << out;
  const std::string text = read_file(json);
  EXPECT_NE(text.find("\"runs_per_allocator\": 3"), std::string::npos) << text;
  std::size_t records = 0;
  for (std::size_t at = text.find("\"ns_per_op\": "); at != std::string::npos;
       at = text.find("\"ns_per_op\": ", at + 1)) {
    ++records;
    const double reported = std::strtod(text.c_str() + at + 13, nullptr);
    const std::size_t list = text.find("\"ns_per_op_runs\": [", at);
    ASSERT_NE(list, std::string::npos) << text;
    std::vector<double> runs;
    const char* c = text.c_str() + list + 19;
    while (*c != ']') {
      char* end = nullptr;
      runs.push_back(std::strtod(c, &end));
      c = end;
      while (*c == ',' || *c == ' ') ++c;
    }
    ASSERT_EQ(runs.size(), 3U) << text;
    std::sort(runs.begin(), runs.end());
    EXPECT_DOUBLE_EQ(reported, runs[1]) << "the median run";
  }
  EXPECT_EQ(records, 3U) << text;
  std::remove(json.c_str());
  for (const char* bad : {"0", "101", "three"}) {
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(cli::run_replay({"--host-only", "--runs", bad, sample_path()}), 2) << bad;
    EXPECT_NE(::testing::internal::GetCapturedStderr().find("--runs"), std::string::npos);
  }
}

// --passes: the trace several times on one allocator instance.

// Slots: 0 = 0x100 (1 MiB, stream 1), 1 = 0x200 (64 KiB, stream 2), 2 = 0x300 (2 MiB,
// stream 1). Four events; slots 1 and 2 are left live by the trace.
const std::string kLeftovers = kHeader +
                               "1,0,allocate,0x100,1048576,1\n"
                               "1,0,allocate,0x200,65536,2\n"
                               "1,0,deallocate,0x100,1048576,1\n"
                               "1,0,allocate,0x300,2097152,1\n";

TEST(ReplayPasses, EachPassRunsTheTraceAndFreesItsLeftoversInSlotOrder) {
  const Trace trace = replay::parse_trace(kLeftovers, "leftovers.csv");
  ASSERT_EQ(trace.events.size(), 4U);
  ASSERT_EQ(trace.live_at_end, 2U);
  ReplayOptions options;
  options.passes = 3;
  CallLog log;
  const auto result = replay::replay_trace(trace, recording_spec(log, true), options);
  EXPECT_FALSE(result.failed_at.has_value()) << result.failure;
  // Operations of a pass: the trace's events plus the two leftovers it frees.
  EXPECT_EQ(result.pass_operations, (std::vector<std::size_t>{6, 6, 6}));
  EXPECT_EQ(result.operations, 18U);
  ASSERT_EQ(result.pass_ns_per_op.size(), 3U);
  EXPECT_EQ(result.ns_per_op, result.pass_ns_per_op[0]);
  ASSERT_TRUE(result.warm_ns_per_op.has_value());
  EXPECT_EQ(*result.warm_ns_per_op, std::max(result.pass_ns_per_op[1], result.pass_ns_per_op[2]))
      << "the median of two warm passes is the upper one";
  // The recording allocator cannot say: per-pass and warm upstream figures are unknown.
  EXPECT_EQ(result.pass_upstream_allocations.size(), 3U);
  EXPECT_FALSE(result.pass_upstream_allocations[1].has_value());
  EXPECT_FALSE(result.warm_upstream_allocations.has_value());
  // Stream-ordered: called in trace order; leftovers in slot order on their own stream.
  const std::vector<std::string> pass = {"alloc 1048576 s0", "alloc 65536 s1", "free 1048576 s0",
                                         "alloc 2097152 s0", "free 65536 s1",  "free 2097152 s0"};
  std::vector<std::string> expected;
  for (int i = 0; i < 3; ++i) expected.insert(expected.end(), pass.begin(), pass.end());
  EXPECT_EQ(log.calls, expected);
}

TEST(ReplayPasses, HeldBackFreesAreAllDeallocatedBeforeTheNextPass) {
  // Stream-unaware allocator, two streams: every free is held back (lag 8 > the pass), so
  // the pass's end deallocates them all (leftovers included) before pass 2 allocates.
  const Trace trace = replay::parse_trace(kLeftovers, "leftovers.csv");
  ReplayOptions options;
  options.passes = 2;
  options.stream_lag = 8;
  CallLog log;
  const auto result = replay::replay_trace(trace, recording_spec(log, false), options);
  EXPECT_FALSE(result.failed_at.has_value()) << result.failure;
  EXPECT_EQ(result.pass_operations, (std::vector<std::size_t>{6, 6}));
  EXPECT_EQ(result.held_back_frees, 6U);  // 3 frees per pass, all held back
  const std::vector<std::string> pass = {"alloc 1048576 s0", "alloc 65536 s1", "alloc 2097152 s0",
                                         "free 1048576 s0",  "free 65536 s1",  "free 2097152 s0"};
  std::vector<std::string> expected;
  for (int i = 0; i < 2; ++i) expected.insert(expected.end(), pass.begin(), pass.end());
  EXPECT_EQ(log.calls, expected);
  // The real pool over the same trace: every pass completes, nothing is left over.
  const auto pool = replay::replay_trace(trace, replay::device_pool_spec(), options);
  EXPECT_FALSE(pool.failed_at.has_value()) << pool.failure;
  EXPECT_EQ(pool.pass_operations, (std::vector<std::size_t>{6, 6}));
}

TEST(ReplayPasses, DevicePoolMakesNoUpstreamAllocationInWarmPassesOfASteadyTrace) {
  // Both traces repeat the same pattern each pass and every pass ends with nothing live,
  // so after pass 1 the pool serves them from what it cached.
  for (const std::string& text : {read_file(sample_path()), kLeftovers}) {
    const Trace trace = replay::parse_trace(text, "steady.csv");
    for (const auto& spec : replay::all_replay_allocators()) {
      if (spec.needs_gpu) continue;
      ReplayOptions options;
      options.passes = 3;
      const auto result = replay::replay_trace(trace, spec, options);
      ASSERT_FALSE(result.failed_at.has_value()) << spec.name << ": " << result.failure;
      ASSERT_EQ(result.pass_upstream_allocations.size(), 3U) << spec.name;
      ASSERT_TRUE(result.pass_upstream_allocations[0].has_value()) << spec.name;
      EXPECT_GE(*result.pass_upstream_allocations[0], 1U) << spec.name;
      EXPECT_EQ(result.pass_upstream_allocations[1], std::optional<std::uint64_t>(0)) << spec.name;
      EXPECT_EQ(result.pass_upstream_allocations[2], std::optional<std::uint64_t>(0)) << spec.name;
      EXPECT_EQ(result.warm_upstream_allocations, std::optional<std::uint64_t>(0)) << spec.name;
      EXPECT_EQ(result.upstream_allocations, result.pass_upstream_allocations[0]) << spec.name;
      // Peak reserved is over all passes: no higher than pass 1 reached when nothing grows.
      ReplayOptions once;
      EXPECT_EQ(result.peak_reserved_bytes,
                replay::replay_trace(trace, spec, once).peak_reserved_bytes)
          << spec.name;
    }
  }
}

// Sixteen streams, each allocating blocks of 3, 5 or 9 MiB and freeing them on itself 32
// allocations later (an engine with a stream per request). Before the large tier over
// virtual memory maps new memory for a stream whose own free ranges do not fit, it fences
// the other streams, so their free memory serves it: reserved stays near live and steady
// over passes instead of growing with every pass.
TEST(ReplayPasses, ManyStreamsKeepDevicePoolReservedNearLiveAndSteady) {
  std::string text = "Thread,Time,Action,Pointer,Size,Stream\n";
  std::uint64_t seed = 7;
  std::vector<std::string> live;  // "pointer,size,stream" in allocation order
  for (std::uint64_t i = 0; i < 6000; ++i) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    const std::size_t size = std::size_t{(seed >> 33) % 3 == 0   ? 3u
                                         : (seed >> 33) % 3 == 1 ? 5u
                                                                 : 9u}
                             << 20;
    const std::string block = std::to_string(0x100000000ULL * (i + 1)) + "," +
                              std::to_string(size) + "," + std::to_string(i % 16);
    text += "0," + std::to_string(2 * i) + ",allocate," + block + "\n";
    live.push_back(block);
    if (live.size() > 32) {
      text += "0," + std::to_string(2 * i + 1) + ",deallocate," + live.front() + "\n";
      live.erase(live.begin());
    }
  }
  const Trace trace = replay::parse_trace(text, "sixteen_streams.csv");
  ReplayOptions options;
  options.passes = 3;
  const auto result = replay::replay_trace(trace, replay::device_pool_spec(), options);
  ASSERT_FALSE(result.failed_at.has_value()) << result.failure;
  EXPECT_LE(result.peak_reserved_bytes, 2 * result.peak_live_bytes)
      << "peak live " << result.peak_live_bytes;
  EXPECT_EQ(result.warm_upstream_allocations, std::optional<std::uint64_t>(0))
      << "a repeated pass maps nothing new";
  // Streams not seen since their frees: growth past the budget synchronizes the device.
  ASSERT_TRUE(result.device_synchronizes.has_value());
  EXPECT_GT(*result.device_synchronizes, 0U);
}

TEST(ReplayPasses, OnePassKeepsTheReplayAsItWas) {
  const Trace trace = replay::parse_trace(kLeftovers, "leftovers.csv");
  CallLog log;
  const auto result = replay::replay_trace(trace, recording_spec(log, true), ReplayOptions{});
  // The trace's events only; leftovers are freed after the timed region, not counted.
  EXPECT_EQ(result.operations, 4U);
  EXPECT_EQ(result.pass_operations, (std::vector<std::size_t>{4}));
  EXPECT_EQ(result.pass_ns_per_op, (std::vector<double>{result.ns_per_op}));
  EXPECT_FALSE(result.warm_ns_per_op.has_value());
  EXPECT_FALSE(result.warm_upstream_allocations.has_value());
  EXPECT_FALSE(result.failed_pass.has_value());
  EXPECT_EQ(log.calls.size(), 6U);  // the two leftovers freed by the cleanup
}

// Allocates until its `limit`-th allocation, which throws.
AllocatorSpec failing_spec(std::size_t limit) {
  class Failing final : public replay::ReplayAllocator {
   public:
    explicit Failing(std::size_t limit) : limit_(limit) {}
    void* allocate(std::size_t, replay::ReplayStream) override {
      if (count_ + 1 >= limit_) throw std::bad_alloc();  // counts only what it allocated
      return reinterpret_cast<void*>(++count_ * 4096);
    }
    void deallocate(void*, std::size_t, replay::ReplayStream) override {}
    bool stream_ordered() const override { return true; }
    std::size_t peak_reserved_bytes() override { return 0; }
    std::size_t reserved_bytes() override { return 0; }
    std::optional<std::uint64_t> upstream_allocations() override { return count_; }

   private:
    std::size_t limit_;
    std::uint64_t count_ = 0;
  };
  AllocatorSpec spec;
  spec.name = "failing";
  spec.needs_gpu = false;
  spec.make = [limit](const replay::ReplayContext&) { return std::make_unique<Failing>(limit); };
  return spec;
}

TEST(ReplayPasses, AFailureInALaterPassEndsTheRunAndNamesThePass) {
  const Trace trace = replay::parse_trace(kLeftovers, "leftovers.csv");
  ReplayOptions options;
  options.passes = 4;
  // Three allocations a pass: the 5th allocation is pass 2's second (row 1).
  const auto result = replay::replay_trace(trace, failing_spec(5), options);
  ASSERT_TRUE(result.failed_at.has_value());
  EXPECT_EQ(*result.failed_at, 1U);
  EXPECT_EQ(result.failed_line, 3U);
  EXPECT_EQ(result.failed_pass, std::optional<std::size_t>(2));
  EXPECT_EQ(result.pass_operations, (std::vector<std::size_t>{6, 1}));
  EXPECT_EQ(result.operations, 7U);
  EXPECT_EQ(result.pass_upstream_allocations, (std::vector<std::optional<std::uint64_t>>{3, 1}));
  // The failing pass is cut short: no warm figure comes from it.
  EXPECT_FALSE(result.warm_upstream_allocations.has_value());
  EXPECT_FALSE(result.warm_ns_per_op.has_value());
  // In the JSON record and the text.
  replay::ReplayReport report;
  report.passes_per_run = 4;
  report.runs.push_back({result, {result.ns_per_op}, {}, {}, ""});
  const std::string json = replay::to_json(report);
  EXPECT_NE(json.find("\"passes_per_run\": 4"), std::string::npos) << json;
  EXPECT_NE(json.find("\"failed_pass\": 2"), std::string::npos) << json;
  EXPECT_NE(json.find("\"pass_operations\": [6, 1]"), std::string::npos) << json;
  EXPECT_NE(json.find("\"pass_upstream_allocations\": [3, 1]"), std::string::npos) << json;
  EXPECT_NE(json.find("\"warm_upstream_allocations\": null"), std::string::npos) << json;
  // A failure in pass 1 leaves no warm figures.
  const auto cold = replay::replay_trace(trace, failing_spec(2), options);
  EXPECT_EQ(cold.failed_pass, std::optional<std::size_t>(1));
  EXPECT_FALSE(cold.warm_ns_per_op.has_value());
  EXPECT_FALSE(cold.warm_upstream_allocations.has_value());
}

// The value of `"key": ` in a JSON record starting at `from` (numbers and null only).
std::string json_value(const std::string& text, const std::string& key, std::size_t from = 0) {
  const std::string tag = "\"" + key + "\": ";
  const std::size_t at = text.find(tag, from);
  if (at == std::string::npos) return "<missing>";
  const std::size_t begin = at + tag.size();
  const std::size_t end =
      text.find_first_of(",}", text[begin] == '[' ? text.find(']', begin) : begin);
  return text.substr(begin, end - begin);
}

TEST(ReplayPasses, CliPassesWithRunsReportsWarmColumnsAndJson) {
  const std::string json = temp_path("replay-passes.json");
  ::testing::internal::CaptureStdout();
  const int code = cli::run_replay(
      {"--host-only", "--runs", "3", "--passes", "3", sample_path(), "--json", json});
  const std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("warm ns/op warm upstream"), std::string::npos) << out;
  EXPECT_NE(out.find("warm ns/op median of 3 runs; range"), std::string::npos) << out;
  EXPECT_NE(out.find("by pass"), std::string::npos) << out;
  const std::string text = read_file(json);
  EXPECT_NE(text.find("\"passes_per_run\": 3"), std::string::npos) << text;
  std::size_t records = 0;
  for (std::size_t at = text.find("{\"trace\": \"replay_sample\", \"allocator\"");
       at != std::string::npos;
       at = text.find("{\"trace\": \"replay_sample\", \"allocator\"", at + 1)) {
    ++records;
    // 10 events, nothing left live: 10 operations a pass.
    EXPECT_EQ(json_value(text, "operations", at), "30") << text;
    EXPECT_EQ(json_value(text, "pass_operations", at), "[10, 10, 10]") << text;
    EXPECT_EQ(json_value(text, "warm_upstream_allocations", at), "0") << text;
    EXPECT_EQ(json_value(text, "failed_pass", at), "null") << text;
    // The reported warm ns/op is the median of the runs' warm figures.
    const std::string runs = json_value(text, "warm_ns_per_op_runs", at);
    std::vector<double> values;
    for (const char* c = runs.c_str() + 1; *c != ']';) {
      char* end = nullptr;
      values.push_back(std::strtod(c, &end));
      c = end;
      while (*c == ',' || *c == ' ') ++c;
    }
    ASSERT_EQ(values.size(), 3U) << text;
    std::sort(values.begin(), values.end());
    EXPECT_DOUBLE_EQ(std::strtod(json_value(text, "warm_ns_per_op", at).c_str(), nullptr),
                     values[1]);
    const std::string passes = json_value(text, "pass_ns_per_op", at);
    EXPECT_EQ(std::count(passes.begin(), passes.end(), ','), 2) << passes;
  }
  EXPECT_EQ(records, 3U) << text;
  std::remove(json.c_str());
}

TEST(ReplayPasses, CliOnePassPrintsNoWarmColumnsAndNullWarmFields) {
  const std::string json = temp_path("replay-one-pass.json");
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{}, std::vector<std::string>{"--passes", "1"}}) {
    std::vector<std::string> args = {"--host-only", sample_path(), "--json", json};
    args.insert(args.end(), flags.begin(), flags.end());
    ::testing::internal::CaptureStdout();
    ASSERT_EQ(cli::run_replay(args), 0);
    const std::string out = ::testing::internal::GetCapturedStdout();
    EXPECT_EQ(out.find("warm"), std::string::npos) << out;
    EXPECT_EQ(out.find("by pass"), std::string::npos) << out;
    // The table header of a one-pass replay, unchanged.
    EXPECT_NE(
        out.find("  allocator                                     ops     ns/op peak reserved "
                 "res/live   upstream  failed_at  min capacity\n"),
        std::string::npos)
        << out;
    const std::string text = read_file(json);
    EXPECT_NE(text.find("\"passes_per_run\": 1"), std::string::npos) << text;
    const std::size_t at = text.find("{\"trace\": \"replay_sample\", \"allocator\"");
    ASSERT_NE(at, std::string::npos) << text;
    EXPECT_EQ(json_value(text, "operations", at), "10");
    EXPECT_EQ(json_value(text, "warm_ns_per_op", at), "null");
    EXPECT_EQ(json_value(text, "warm_upstream_allocations", at), "null");
    EXPECT_EQ(json_value(text, "warm_ns_per_op_runs", at), "[]");
    EXPECT_EQ(json_value(text, "failed_pass", at), "null");
    EXPECT_EQ(json_value(text, "pass_operations", at), "[10]");
    EXPECT_EQ(json_value(text, "pass_ns_per_op", at),
              "[" + json_value(text, "ns_per_op", at) + "]");
    // Every field a record had before --passes is still there.
    for (const char* key :
         {"operations", "ns_per_op", "ns_per_op_runs", "peak_live_bytes", "peak_reserved_bytes",
          "reserved_over_live", "upstream_allocations", "failed_at", "failed_line", "failure",
          "held_back_frees", "min_capacity_bytes", "min_capacity_method"}) {
      EXPECT_NE(json_value(text, key, at), "<missing>") << key;
    }
    EXPECT_EQ(json_value(text, "device_synchronizes", at), "0");
  }
  std::remove(json.c_str());
}

TEST(ReplayPasses, CliRejectsBadPassCountsNamingTheFlag) {
  for (const char* bad : {"0", "x", "1001", "-1"}) {
    ::testing::internal::CaptureStderr();
    ::testing::internal::CaptureStdout();
    EXPECT_EQ(cli::run_replay({"--host-only", "--passes", bad, sample_path()}), 2) << bad;
    (void)::testing::internal::GetCapturedStdout();
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("--passes"), std::string::npos) << bad << ": " << err;
  }
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(cli::run_replay({"--host-only", sample_path(), "--passes"}), 2);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("--passes needs a value"),
            std::string::npos);
}

TEST(ReplayPasses, CapacitySearchUsesOnePass) {
  const Trace trace = replay::read_trace(sample_path());
  const auto spec = replay::device_pool_spec();
  ReplayOptions one;
  ReplayOptions three;
  three.passes = 3;
  const auto unbounded = replay::replay_trace(trace, spec, one);
  EXPECT_EQ(replay::min_capacity(trace, spec, three, unbounded.peak_reserved_bytes),
            replay::min_capacity(trace, spec, one, unbounded.peak_reserved_bytes));
}

TEST(ReplayBench, ReplayAndBatchedScenariosRunHostOnly) {
  const std::string dir = temp_path("replay-bench-traces");
  std::filesystem::create_directories(dir);
  write_gzip(dir + "/sample.csv.gz", read_file(sample_path()));
  ASSERT_EQ(setenv("VRAM_TRACE_DIR", dir.c_str(), 1), 0);
  const std::string json = temp_path("replay-bench.json");
  ::testing::internal::CaptureStdout();
  const int code =
      cli::run_bench({"--quick", "--host-only", "--scenario", "replay,batched", "--json", json});
  const std::string out = ::testing::internal::GetCapturedStdout();
  unsetenv("VRAM_TRACE_DIR");
  ASSERT_EQ(code, 0) << out;
  const std::string text = read_file(json);
  EXPECT_NE(text.find("\"scenario\": \"replay\""), std::string::npos) << text;
  EXPECT_NE(text.find("\"scenario\": \"batched\""), std::string::npos) << text;
  EXPECT_NE(text.find("16 threads"), std::string::npos) << text;
  EXPECT_NE(text.find("reserved_over_live"), std::string::npos) << text;
  std::filesystem::remove_all(dir);
  std::remove(json.c_str());
}

TEST(ReplayBench, AnOutputThatIsATraceOfTheReplayScenarioIsRefused) {
  const std::string dir = temp_path("replay-bench-own-trace");
  std::filesystem::create_directories(dir + "/sub");
  const std::string trace = dir + "/sample.csv.gz";
  write_gzip(trace, read_file(sample_path()));
  const std::string original = read_file(trace);
  ASSERT_EQ(setenv("VRAM_TRACE_DIR", dir.c_str(), 1), 0);
  for (const char* flag : {"--json", "--markdown", "--svg"}) {
    for (const std::string& spelling : {trace, dir + "/sub/../sample.csv.gz"}) {
      ::testing::internal::CaptureStdout();
      ::testing::internal::CaptureStderr();
      const int code =
          cli::run_bench({"--quick", "--host-only", "--scenario", "pairs,replay", flag, spelling});
      const std::string out = ::testing::internal::GetCapturedStdout();
      const std::string err = ::testing::internal::GetCapturedStderr();
      EXPECT_EQ(code, 2) << flag << " " << spelling << out;
      EXPECT_NE(err.find(std::string(flag) + " file '" + spelling + "' is the trace '" + trace +
                         "' that the replay scenario reads"),
                std::string::npos)
          << err;
      EXPECT_NE(err.find("Fix:"), std::string::npos) << err;
      EXPECT_EQ(out.find("verdict"), std::string::npos) << "nothing may run: " << out;
      EXPECT_EQ(read_file(trace), original) << flag << " " << spelling;
    }
  }
  // Without the replay scenario an output beside the traces is written as usual, and the
  // traces stay as they were.
  ::testing::internal::CaptureStdout();
  const int code =
      cli::run_bench({"--quick", "--host-only", "--scenario", "pairs", "--json", dir + "/x.json"});
  (void)::testing::internal::GetCapturedStdout();
  unsetenv("VRAM_TRACE_DIR");
  EXPECT_EQ(code, 0);
  EXPECT_EQ(read_file(trace), original);
  std::filesystem::remove_all(dir);
}

TEST(ReplayGpu, SampleTraceThroughEveryPeerOnTheDevice) {
  VRAM_GPU_TEST_OR_SKIP();
  const Trace trace = replay::read_trace(sample_path());
  ReplayOptions options;
  options.device = true;
  const auto specs = replay::all_replay_allocators();
  ASSERT_GE(specs.size(), 4U);
  for (const auto& spec : specs) {
    const auto result = replay::replay_trace(trace, spec, options);
    EXPECT_FALSE(result.failed_at.has_value()) << spec.name << ": " << result.failure;
    EXPECT_EQ(result.operations, trace.events.size()) << spec.name;
    EXPECT_GE(result.peak_reserved_bytes, trace.peak_live_bytes) << spec.name;
  }
  // Two streams on the device: DevicePool is driven through its stream-ordered API, so the
  // driver holds nothing back (the pool's own cross-stream rule is tested in
  // DevicePoolStreamsGpu); the replay's streams are destroyed before the pool (the case
  // that crashed ~DevicePool before it stopped recording markers on freeing streams).
  const Trace streams = replay::parse_trace(kCrossStream, "streams.csv");
  const auto result = replay::replay_trace(streams, replay::device_pool_spec(), options);
  EXPECT_FALSE(result.failed_at.has_value()) << result.failure;
  EXPECT_EQ(result.held_back_frees, 0U);
}

TEST(ReplayGpu, PassesOnTheDeviceRunEveryPeerOnOneInstance) {
  VRAM_GPU_TEST_OR_SKIP();
  ReplayOptions options;
  options.device = true;
  options.passes = 3;
  // Leftovers on two streams: freed at each pass's end on the stream they were allocated on.
  const Trace trace = replay::parse_trace(kLeftovers, "leftovers.csv");
  for (const auto& spec : replay::all_replay_allocators()) {
    const auto result = replay::replay_trace(trace, spec, options);
    EXPECT_FALSE(result.failed_at.has_value()) << spec.name << ": " << result.failure;
    EXPECT_EQ(result.pass_operations, (std::vector<std::size_t>{6, 6, 6})) << spec.name;
    EXPECT_EQ(result.operations, 18U) << spec.name;
    EXPECT_TRUE(result.warm_ns_per_op.has_value()) << spec.name;
    EXPECT_EQ(result.warm_upstream_allocations.has_value(), result.upstream_allocations.has_value())
        << spec.name;
    EXPECT_GE(result.peak_reserved_bytes, trace.peak_live_bytes) << spec.name;
    EXPECT_EQ(result.held_back_frees, 0U) << spec.name;  // every peer is stream-ordered on a device
  }
}

}  // namespace
}  // namespace vram::testing
