#include "replay/trace.hpp"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <unordered_map>

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

constexpr std::size_t kExamples = 5;

// Builds a Trace line by line; see trace.hpp for the invariants it establishes.
class Parser {
 public:
  explicit Parser(Trace& trace) : trace_(trace) {}

  void line(std::string_view text, std::size_t number) {
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
               joined() + "'");
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
      fail(number, std::string("bad ") + what + " '" + std::string(fields_[column]) +
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
      fail(number, "unknown action '" + std::string(fields_[action_]) +
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

Trace parse_trace(std::string_view text, const std::string& name) {
  Trace trace;
  trace.path = name;
  trace.name = base_name(name);
  Parser parser(trace);
  std::size_t number = 0;
  while (!text.empty()) {
    const std::size_t end = text.find('\n');
    parser.line(text.substr(0, end), ++number);
    if (end == std::string_view::npos) break;
    text.remove_prefix(end + 1);
  }
  parser.finish(number);
  return trace;
}

Trace read_trace(const std::string& path) {
  Trace trace;
  trace.path = path;
  trace.name = base_name(path);
  errno = 0;
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) {
    throw TraceError(path +
                     ": cannot open: " + (errno != 0 ? std::strerror(errno) : "out of memory"));
  }
  gzbuffer(file, 1 << 20);
  Parser parser(trace);
  std::string pending;  // a line longer than the buffer, assembled across reads
  char buffer[4096];
  std::size_t number = 0;
  try {
    while (gzgets(file, buffer, sizeof buffer) != nullptr) {
      const std::size_t n = std::strlen(buffer);
      if (n > 0 && buffer[n - 1] != '\n' && !gzeof(file)) {
        pending.append(buffer, n);
        if (pending.size() > (1 << 20)) {
          throw TraceError(path + ":" + std::to_string(number + 1) + ": line longer than 1 MiB");
        }
        continue;
      }
      ++number;
      if (!pending.empty()) {
        pending.append(buffer, n);
        parser.line(pending, number);
        pending.clear();
      } else {
        parser.line(std::string_view(buffer, n), number);
      }
    }
    if (!pending.empty()) parser.line(pending, ++number);
    int code = Z_OK;
    const char* message = gzerror(file, &code);
    if (code != Z_OK && code != Z_STREAM_END) {
      throw TraceError(path + ":" + std::to_string(number + 1) +
                       ": cannot decompress: " + (message ? message : "zlib error") +
                       (code == Z_BUF_ERROR ? " (truncated gzip file?)" : ""));
    }
    parser.finish(number);
  } catch (...) {
    gzclose(file);
    throw;
  }
  gzclose(file);
  return trace;
}

}  // namespace vram::replay
