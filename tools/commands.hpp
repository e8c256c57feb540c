// The CLI's sub-commands. Each returns the process exit code (0 done, 1 run-time failure,
// 2 bad usage; `vram bench` adds 3: nothing measured).
#pragma once

#include <cstddef>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace vram::cli {
int run_info(const std::vector<std::string>& args);
int run_bench(const std::vector<std::string>& args);
int run_replay(const std::vector<std::string>& args);

// "vram 0.1.0 (commit ..., CUDA runtime 13.0, static)".
std::string version_text();
// Why no CUDA device is usable, in the library's words, with its "Fix:" hint: e.g. "no
// NVIDIA driver found (cudaErrorInsufficientDriver). Fix: ...". Only meaningful when
// vram::cuda::Device::count() == 0.
std::string no_device_explanation();

// Option handling shared by `vram bench` and `vram replay` (defined in bench/bench_main.cpp;
// the output files in output_files.cpp).
// Every message is printed to stderr as "<command>: ..."; the caller then exits 2 (usage),
// or 1 (run-time failure) when write_outputs fails.

// One command-line argument. An option named in `valued` takes a value, after '=' in the
// same argument ("--json=F") or as the next argument ("--json F"); one named in `flags`
// takes none ("--quick=yes" is refused). An argument not starting with "--" is positional;
// an unknown "--x" is returned as it is, for the caller to refuse.
struct CommandArgument {
  std::string name;   // "--json"; the whole argument when positional or unknown
  std::string value;  // the value of a `valued` option
  bool positional = false;
  bool known = false;  // named in `valued` or `flags`
};
// Splits args[i]; i advances past a separate value. False (message printed) when a valued
// option has no value or a flag has one.
bool next_argument(const char* command, const std::vector<std::string>& args, std::size_t& i,
                   std::initializer_list<std::string_view> valued,
                   std::initializer_list<std::string_view> flags, CommandArgument& out);

// A --device value: decimal digits only, fitting an int ("abc", "-1", "1e3", "0x1", "",
// " 1" and 2147483648 are refused). False (message printed) otherwise.
bool parse_device_ordinal(const char* command, const std::string& text, int& device);
// Whether `device` is one of the `visible` devices (vram::cuda::Device::availability().count);
// false (message printed: the ordinal, how many devices are visible and, with none, why)
// otherwise.
bool device_is_visible(const char* command, int device, int visible);

// An output file, replaced only after the whole run succeeded: written to a temporary
// beside it, renamed over it at the end.
struct OutputFile {
  const char* flag;  // "--json"
  std::string path;  // empty: not requested; "-": stdout (where the caller allows it)
  std::string content;
};
// Sets output.path from the option's value; an empty value is refused (false, printed).
bool set_output_path(const char* command, OutputFile& output, const std::string& value);
// Checked before anything runs: `output.path` is new or an existing regular file (not a
// directory, device, FIFO or socket, which the rename at the end would replace) and its
// directory takes a new file. The target itself is not opened, so an existing file is left
// as it is. False (printed) otherwise. "-" passes.
bool can_create(const char* command, const OutputFile& output);
// Checked before anything runs: no two of `outputs` (not empty, not "-") are one file (the
// same device and inode, or the same normalized path). False (printed, naming both) otherwise.
bool distinct_outputs(const char* command, std::initializer_list<const OutputFile*> outputs);
// Checked before anything runs: no output (not empty, not "-") is one of `traces`, a trace
// "-" being whatever file is open as standard input (a file redirected in). False (printed,
// naming both, `read_by` after the trace's name) otherwise.
bool outputs_spare_traces(const char* command, std::initializer_list<const OutputFile*> outputs,
                          const std::vector<std::string>& traces, const char* read_by);
// Writes every requested file to a temporary beside it, then renames them all ("wrote F" to
// `human`) and finally writes the "-" ones to stdout. On a failure nothing is renamed, the
// temporaries are removed and false is returned (printed).
bool write_outputs(const char* command, const std::vector<OutputFile>& outputs, std::FILE* human);
}  // namespace vram::cli
