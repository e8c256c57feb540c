// Allocation traces for `vram replay`: RMM logging_resource_adaptor CSV, plain or gzip.
//
//   Thread,Time,Action,Pointer,Size,Stream
//   140202240513856,08:18:14:612,allocate,0x7f8f46000000,256,0x0
//   140202240513856,08:18:14:613,deallocate,0x7f8f46000000,256,0x0
//
// Columns are found by their header names (Action, Pointer and Size are required; Thread,
// Time and Stream optional, Stream 0 when absent), so column order does not matter.
// Actions: `allocate`, `deallocate`, `free` (older logs) and `allocate failure` (counted,
// not replayed). Pointers and streams are hex (0x...) or decimal. Blank lines are skipped.
// A file that starts with the gzip magic (1f 8b) is decompressed with zlib's inflate, any
// other file is read as it is. Gzip members may follow each other (as `cat a.gz b.gz`
// writes); bytes after a member that do not start another member are an error, and so is a
// file that ends inside a member (truncated). Lines end at '\n' only; a NUL byte anywhere is
// an error naming its line. Messages that quote file content show every byte that is not
// printable ASCII as \xNN (a backslash doubled).
//
// What parsing guarantees about the event list (the replay relies on it)
//   Every deallocate refers to a live allocation of the same trace (its `slot`), so the
//   replay needs no pointer lookups. Events are kept in file order; `row` is the 0-based
//   index of the data row (every non-blank line after the header, skipped ones included),
//   which is what `failed_at` reports.
//   A free of an unknown pointer (never allocated, or already freed) is counted, the first
//   few are kept as examples, and the event is dropped. An allocation of a pointer that is
//   still live (the trace lost a free) is counted and reported; the earlier block is freed
//   implicitly just before it, so the replay stays consistent. A free whose size differs
//   from the allocation's is counted and replayed with the allocation's size.
// A malformed line throws TraceError "FILE:LINE: what is wrong"; a file that cannot be read
// or has junk after its gzip data, "FILE: what is wrong".
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace vram::replay {

class TraceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct TraceEvent {
  bool allocate = true;
  std::size_t bytes = 0;           // the allocation's size (also for its free)
  std::uint64_t stream = 0;        // the trace's stream tag
  std::uint32_t slot = 0;          // dense id of the allocation this event allocates or frees
  std::uint32_t stream_index = 0;  // dense index of `stream` in Trace::streams
  std::size_t row = 0;             // 0-based data row in the file
  std::size_t line = 0;            // 1-based line in the file
};

struct Trace {
  std::string name;  // file name without directories and .csv/.csv.gz
  std::string path;
  std::vector<TraceEvent> events;
  std::vector<std::uint64_t> streams;  // distinct stream tags, first-seen order
  std::size_t slots = 0;               // allocations in the trace
  std::size_t rows = 0;                // data rows read
  std::size_t allocate_failures = 0;   // `allocate failure` rows (not replayed)
  std::size_t unknown_frees = 0;
  std::vector<std::string> unknown_free_examples;  // "FILE:LINE: free of unknown pointer 0x..."
  std::size_t reused_live_pointers = 0;
  std::vector<std::string> reused_live_examples;
  std::size_t free_size_mismatches = 0;
  std::size_t live_at_end = 0;      // allocations never freed
  std::size_t peak_live_bytes = 0;  // high-water of the sum of live requested sizes
  std::size_t peak_live_row = 0;    // row where it was reached
  std::size_t allocations() const noexcept { return slots; }
};

// Reads a trace file (.csv or .csv.gz; "-": standard input). Throws TraceError on a
// malformed line or an unreadable file.
Trace read_trace(const std::string& path);
// Parses CSV text already in memory; `name` is used in messages as the file name.
Trace parse_trace(std::string_view text, const std::string& name);

// Parses "0x1f" or "31"; false when it is neither.
bool parse_number(std::string_view text, std::uint64_t& value);

// `text` safe and short enough to quote in a message (control bytes escaped, cut past 48
// bytes with its length said).
std::string printable(std::string_view text);

}  // namespace vram::replay
