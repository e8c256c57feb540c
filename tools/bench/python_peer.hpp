// tools/bench/python_peer.hpp: a peer measured by a Python script in a child process, for
// peers whose only supported interface is a Python package (torch_memory_saver).
//
// The script's text is carried inside the binary (written to a private temporary file for
// the run), so `vram bench` needs no source tree.
#pragma once

#include <string>
#include <vector>

#include "bench/child_process.hpp"

namespace vram::bench {

// A file holding `text` in a private folder (mode 0700) under $TMPDIR (or /tmp), both removed
// with the object; error() says why when it could not be written (path() empty when it
// could not be made).
class TemporaryFile {
 public:
  TemporaryFile(const std::string& text, const std::string& suffix);
  ~TemporaryFile();
  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;
  const std::string& path() const { return path_; }
  const std::string& error() const { return error_; }

 private:
  std::string directory_;
  std::string path_;
  std::string error_;
};

// Runs `python` (a path or a name looked up in PATH) on a temporary file holding `script`,
// with `arguments` (run_child: the same limits and results).
ChildRun run_python(const std::string& python, const std::string& script,
                    const std::vector<std::string>& arguments, int timeout_s);

// The interpreter `vram bench` runs Python peers with: $VRAM_BENCH_PYTHON, else python3.
std::string bench_python();

// bench/torch_sleep.py, carried in the binary (generated at configure time).
const char* torch_sleep_script();

}  // namespace vram::bench
