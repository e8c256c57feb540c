#include "replay/trace.hpp"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <unordered_map>
#include <vector>

namespace vram::replay {
namespace {

std::string_view trim(std::string_view text) {
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t' || text.back() == '\r' ||
                           text.back() == '\n')) {
    text.remove_suffix(1);
  }
  return text;
}

std::string lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

std::string base_name(const std::string& path) {
  std::string name =
      path.substr(path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/') + 1);
  for (const char* suffix : {".gz", ".csv"}) {
    const std::size_t n = std::strlen(suffix);
    if (name.size() > n && name.compare(name.size() - n, n, suffix) == 0) {
      name.resize(name.size() - n);
    }
  }
  return name;
}

std::string hex(std::uint64_t value) {
  char buffer[24];
  std::snprintf(buffer, sizeof buffer, "0x%llx", static_cast<unsigned long long>(value));
  return buffer;
}

}  // namespace

// `text` as it may appear in a message: printable ASCII as it is, a backslash as "\\" and
// every other byte as "\xNN", so no byte of a trace reaches a terminal raw (escape
// sequences, control bytes); past 48 bytes cut, with the length said. Every message that
// quotes file content or a command-line value goes through it.
std::string printable(std::string_view text) {
  constexpr std::size_t kShown = 48;
  std::string out;
  const std::string_view shown = text.substr(0, std::min(text.size(), kShown));
  out.reserve(shown.size() + 32);
  for (const char c : shown) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte == '\\') {
      out += "\\\\";
    } else if (byte >= 0x20 && byte < 0x7f) {
      out += c;
    } else {
      char buffer[8];
      std::snprintf(buffer, sizeof buffer, "\\x%02x", byte);
      out += buffer;
    }
  }
  if (shown.size() < text.size()) {
    out += "... (" + std::to_string(text.size()) + " characters)";
  }
  return out;
}

namespace {

constexpr std::size_t kExamples = 5;
constexpr std::size_t kMaxLine = std::size_t{1} << 20;  // longest line read_trace accepts

// Builds a Trace line by line; see trace.hpp for the invariants it establishes.
class Parser {
 public:
  explicit Parser(Trace& trace) : trace_(trace) {}

  // One line without its '\n'. A NUL byte anywhere is an error (a text trace has none).
  void line(std::string_view text, std::size_t number) {
    if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos) {
      fail(number, "NUL byte at column " + std::to_string(nul + 1) +
                       " (a CSV trace is text; the file is binary or corrupt)");
    }
    text = trim(text);
    if (text.empty()) return;
    fields_.clear();
    std::size_t start = 0;
    while (true) {
      const std::size_t comma = text.find(',', start);
      fields_.push_back(trim(text.substr(
          start, comma == std::string_view::npos ? std::string_view::npos : comma - start)));
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
    if (!have_header_) {
      header(number);
      return;
    }
    data(number);
  }

  void finish(std::size_t last_line) {
    if (!have_header_) {
      fail(last_line == 0 ? 1 : last_line,
           "no header line (expected Thread,Time,Action,Pointer,Size,Stream)");
    }
    trace_.live_at_end = live_.size();
  }

 private:
  [[noreturn]] void fail(std::size_t number, const std::string& what) const {
    throw TraceError(trace_.path + ":" + std::to_string(number) + ": " + what);
  }

  void header(std::size_t number) {
    for (std::size_t i = 0; i < fields_.size(); ++i) {
      const std::string name = lower(fields_[i]);
      if (name == "action") action_ = i;
      if (name == "pointer") pointer_ = i;
      if (name == "size") size_ = i;
      if (name == "stream") stream_ = i;
    }
    if (action_ == npos || pointer_ == npos || size_ == npos) {
      fail(number,
           "header must name the columns Action, Pointer and Size (RMM: "
           "Thread,Time,Action,Pointer,Size,Stream), got '" +
               printable(joined()) + "'");
    }
    columns_ = fields_.size();
    have_header_ = true;
  }

  std::string joined() const {
    std::string out;
    for (std::size_t i = 0; i < fields_.size(); ++i) {
      if (i > 0) out += ',';
      out += fields_[i];
    }
    return out;
  }

  std::uint64_t number_field(std::size_t column, const char* what, std::size_t number) const {
    std::uint64_t value = 0;
    if (!parse_number(fields_[column], value)) {
      fail(number, std::string("bad ") + what + " '" + printable(fields_[column]) +
                       "' (expected a decimal or 0x-hex number)");
    }
    return value;
  }

  void data(std::size_t number) {
    const std::size_t row = trace_.rows++;
    if (fields_.size() != columns_) {
      fail(number, "expected " + std::to_string(columns_) + " comma-separated fields, got " +
                       std::to_string(fields_.size()));
    }
    const std::string action = lower(fields_[action_]);
    const bool is_allocate = action == "allocate";
    const bool is_free = action == "deallocate" || action == "free";
    if (action == "allocate failure") {
      ++trace_.allocate_failures;
      return;
    }
    if (!is_allocate && !is_free) {
      fail(number, "unknown action '" + printable(fields_[action_]) +
                       "' (expected allocate, deallocate, free or allocate failure)");
    }
    const std::uint64_t pointer = number_field(pointer_, "pointer", number);
    const std::uint64_t size = number_field(size_, "size", number);
    const std::uint64_t stream = stream_ == npos ? 0 : number_field(stream_, "stream", number);
    TraceEvent event;
    event.allocate = is_allocate;
    event.stream = stream;
    event.stream_index = stream_index(stream);
    event.row = row;
    event.line = number;
    if (is_allocate) {
      if (size == 0) fail(number, "allocation of 0 bytes");
      if (pointer == 0) fail(number, "allocation at null pointer");
      if (auto it = live_.find(pointer); it != live_.end()) {
        ++trace_.reused_live_pointers;
        if (trace_.reused_live_examples.size() < kExamples) {
          trace_.reused_live_examples.push_back(
              trace_.path + ":" + std::to_string(number) + ": pointer " + hex(pointer) +
              " allocated again while live (allocated at line " +
              std::to_string(trace_.events[it->second.event].line) + "); freed implicitly");
        }
        TraceEvent implicit = trace_.events[it->second.event];
        implicit.allocate = false;
        implicit.row = row;
        implicit.line = number;
        release(it);
        trace_.events.push_back(implicit);
      }
      // Live bytes fit 64 bits in every trace read (no device holds more): the replay's own
      // live sums and the capacity search rely on it.
      if (size > std::numeric_limits<std::size_t>::max() - live_bytes_) {
        fail(number, "allocation of " + std::to_string(size) + " bytes on top of " +
                         std::to_string(live_bytes_) +
                         " live bytes exceeds 2^64 - 1 bytes live (no device holds that). Fix: "
                         "check the size column of the trace");
      }
      event.bytes = size;
      event.slot = static_cast<std::uint32_t>(trace_.slots++);
      live_.emplace(pointer, Live{trace_.events.size()});
      live_bytes_ += size;
      if (live_bytes_ > trace_.peak_live_bytes) {
        trace_.peak_live_bytes = live_bytes_;
        trace_.peak_live_row = row;
      }
      trace_.events.push_back(event);
      return;
    }
    auto it = live_.find(pointer);
    if (it == live_.end()) {
      ++trace_.unknown_frees;
      if (trace_.unknown_free_examples.size() < kExamples) {
        trace_.unknown_free_examples.push_back(trace_.path + ":" + std::to_string(number) +
                                               ": free of unknown pointer " + hex(pointer) +
                                               " (skipped)");
      }
      return;
    }
    const TraceEvent& allocation = trace_.events[it->second.event];
    if (size != allocation.bytes) ++trace_.free_size_mismatches;
    event.bytes = allocation.bytes;
    event.slot = allocation.slot;
    release(it);
    trace_.events.push_back(event);
  }

  struct Live {
    std::size_t event;  // index of the allocate event in trace_.events
  };

  void release(std::unordered_map<std::uint64_t, Live>::iterator it) {
    live_bytes_ -= trace_.events[it->second.event].bytes;
    live_.erase(it);
  }

  // Dense index of `stream`, assigned in first-seen order: O(1) per event whatever the
  // number of distinct streams. Consecutive events mostly share a stream, so the previous
  // event's stream is checked before the map.
  std::uint32_t stream_index(std::uint64_t stream) {
    if (!trace_.streams.empty() && trace_.streams[last_stream_] == stream) return last_stream_;
    const auto [it, added] =
        stream_indices_.try_emplace(stream, static_cast<std::uint32_t>(trace_.streams.size()));
    if (added) trace_.streams.push_back(stream);
    last_stream_ = it->second;
    return last_stream_;
  }

  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
  Trace& trace_;
  std::vector<std::string_view> fields_;
  bool have_header_ = false;
  std::size_t columns_ = 0;
  std::size_t action_ = npos;
  std::size_t pointer_ = npos;
  std::size_t size_ = npos;
  std::size_t stream_ = npos;
  std::unordered_map<std::uint64_t, Live> live_;
  std::size_t live_bytes_ = 0;
  std::unordered_map<std::uint64_t, std::uint32_t> stream_indices_;  // tag -> index in streams
  std::uint32_t last_stream_ = 0;  // index of the previous event's stream
};

}  // namespace

bool parse_number(std::string_view text, std::uint64_t& value) {
  int base = 10;
  if (text.size() > 2 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X')) {
    base = 16;
    text.remove_prefix(2);
  }
  if (text.empty()) return false;
  std::uint64_t result = 0;
  for (char c : text) {
    unsigned digit;
    if (c >= '0' && c <= '9') {
      digit = static_cast<unsigned>(c - '0');
    } else if (base == 16 && c >= 'a' && c <= 'f') {
      digit = static_cast<unsigned>(c - 'a' + 10);
    } else if (base == 16 && c >= 'A' && c <= 'F') {
      digit = static_cast<unsigned>(c - 'A' + 10);
    } else {
      return false;
    }
    if (result > (UINT64_MAX - digit) / static_cast<unsigned>(base)) return false;  // overflow
    result = result * static_cast<unsigned>(base) + digit;
  }
  value = result;
  return true;
}

namespace {

// Cuts bytes into lines at '\n' (only there: every other byte, NUL included, belongs to its
// line, so line numbers are exact) and hands each to the parser with its 1-based number.
// A line may arrive in pieces across feed() calls; pieces are joined up to kMaxLine bytes.
class LineSplitter {
 public:
  LineSplitter(Parser& parser, const std::string& path) : parser_(parser), path_(path) {}

  void feed(std::string_view bytes) {
    while (!bytes.empty()) {
      const std::size_t end = bytes.find('\n');
      if (end == std::string_view::npos) {
        append_pending(bytes);
        return;
      }
      ++number_;
      if (pending_.empty()) {
        parser_.line(bytes.substr(0, end), number_);
      } else {
        append_pending(bytes.substr(0, end));
        parser_.line(pending_, number_);
        pending_.clear();
      }
      bytes.remove_prefix(end + 1);
    }
  }

  // The input is complete: a last line without '\n' is a line.
  void finish() {
    if (!pending_.empty()) parser_.line(pending_, ++number_);
    parser_.finish(number_);
  }

  // The line the next byte belongs to.
  std::size_t current_line() const noexcept { return number_ + 1; }

 private:
  void append_pending(std::string_view piece) {
    if (pending_.size() + piece.size() > kMaxLine) {
      throw TraceError(path_ + ":" + std::to_string(current_line()) + ": line longer than 1 MiB");
    }
    pending_.append(piece);
  }

  Parser& parser_;
  const std::string& path_;
  std::string pending_;     // the start of the current line, when it spans feed() calls
  std::size_t number_ = 0;  // lines completed
};

constexpr std::size_t kReadChunk = std::size_t{1} << 18;

// Reads a file in chunks. The buffer holds the bytes [read() - available(), read()) of the
// file not consumed yet.
class FileReader {
 public:
  // "-": standard input.
  explicit FileReader(const std::string& path) : path_(path), buffer_(kReadChunk) {
    errno = 0;
    file_ = path == "-" ? stdin : std::fopen(path.c_str(), "rb");
    if (file_ == nullptr) {
      throw TraceError(path +
                       ": cannot open: " + (errno != 0 ? std::strerror(errno) : "out of memory"));
    }
  }
  ~FileReader() {
    if (file_ != stdin) std::fclose(file_);
  }
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  // Tops the buffer up to `wanted` unconsumed bytes (or what is left of the file); false
  // when not even one byte is left.
  bool fill(std::size_t wanted = 1) {
    if (size_ - start_ >= wanted || end_of_file_) return size_ > start_;
    std::memmove(buffer_.data(), buffer_.data() + start_, size_ - start_);
    size_ -= start_;
    start_ = 0;
    while (size_ < wanted && !end_of_file_) {
      const std::size_t n = std::fread(buffer_.data() + size_, 1, buffer_.size() - size_, file_);
      if (n == 0) {
        if (std::ferror(file_)) {
          throw TraceError(path_ + ": cannot read: " + std::strerror(errno));
        }
        end_of_file_ = true;
      }
      size_ += n;
      read_ += n;
    }
    return size_ > start_;
  }

  unsigned char* data() noexcept { return buffer_.data() + start_; }
  std::size_t available() const noexcept { return size_ - start_; }
  void consume(std::size_t n) noexcept { start_ += n; }
  bool end_of_file() const noexcept { return end_of_file_ && start_ == size_; }
  // File offset of data()[0].
  std::uint64_t offset() const noexcept { return read_ - available(); }

 private:
  const std::string& path_;
  std::FILE* file_ = nullptr;
  std::vector<unsigned char> buffer_;
  std::size_t start_ = 0;
  std::size_t size_ = 0;
  std::uint64_t read_ = 0;  // bytes read from the file so far
  bool end_of_file_ = false;
};

bool at_gzip_magic(FileReader& in) {
  return in.fill(2) && in.available() >= 2 && in.data()[0] == 0x1f && in.data()[1] == 0x8b;
}

// Decompresses gzip members back to back (gzip reads `cat a.gz b.gz` as one stream) into
// `lines`. After a member's end the file must end or another member must start (its magic
// 1f 8b): other bytes there are refused, and so is a member the file ends inside of.
void inflate_members(FileReader& in, LineSplitter& lines, const std::string& path) {
  z_stream z{};
  if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) {
    throw TraceError(path + ": cannot decompress: zlib could not start (out of memory)");
  }
  const std::unique_ptr<z_stream, int (*)(z_stream*)> end_inflate(&z, inflateEnd);
  std::vector<unsigned char> out(kReadChunk);
  std::uint64_t text_bytes = 0;  // decompressed so far
  for (;;) {
    in.fill();
    z.next_in = in.data();
    z.avail_in = static_cast<uInt>(in.available());
    z.next_out = out.data();
    z.avail_out = static_cast<uInt>(out.size());
    const int code = inflate(&z, Z_NO_FLUSH);
    in.consume(in.available() - z.avail_in);
    const std::size_t produced = out.size() - z.avail_out;
    text_bytes += produced;
    lines.feed(std::string_view(reinterpret_cast<const char*>(out.data()), produced));
    if (code == Z_STREAM_END) {
      if (!in.fill()) return;
      if (!at_gzip_magic(in)) {
        throw TraceError(path + ": junk after the end of the gzip data at byte " +
                         std::to_string(in.offset()) + " (not another gzip member)");
      }
      inflateReset(&z);
      continue;
    }
    if (code == Z_OK || code == Z_BUF_ERROR) {
      // Output room left and no input left: the member needs bytes the file does not have.
      if (z.avail_out != 0 && in.end_of_file()) {
        throw TraceError(path + ":" + std::to_string(lines.current_line()) +
                         ": gzip stream is truncated: the file ends inside compressed data (" +
                         std::to_string(text_bytes) + " bytes of text decompressed)");
      }
      continue;
    }
    throw TraceError(path + ":" + std::to_string(lines.current_line()) +
                     (code == Z_MEM_ERROR ? ": cannot decompress: out of memory"
                                          : std::string(": corrupt gzip data (") +
                                                (z.msg != nullptr ? z.msg : "zlib error") + ")"));
  }
}

}  // namespace

Trace parse_trace(std::string_view text, const std::string& name) {
  Trace trace;
  trace.path = name;
  trace.name = base_name(name);
  Parser parser(trace);
  LineSplitter lines(parser, trace.path);
  lines.feed(text);
  lines.finish();
  return trace;
}

Trace read_trace(const std::string& path) {
  Trace trace;
  trace.path = path == "-" ? "standard input" : path;
  trace.name = path == "-" ? "stdin" : base_name(path);
  Parser parser(trace);
  LineSplitter lines(parser, trace.path);
  FileReader in(path);
  if (at_gzip_magic(in)) {
    inflate_members(in, lines, trace.path);
  } else {
    while (in.fill()) {
      lines.feed(std::string_view(reinterpret_cast<const char*>(in.data()), in.available()));
      in.consume(in.available());
    }
  }
  lines.finish();
  return trace;
}

}  // namespace vram::replay
