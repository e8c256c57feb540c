// Python peers in a child process (python_peer.hpp).
#include "bench/python_peer.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace vram::bench {

TemporaryFile::TemporaryFile(const std::string& text, const std::string& suffix) {
  // A private directory (mode 0700): Python puts a script's directory first on its path, so
  // nothing another user left in a shared temporary directory is imported.
  const char* dir = std::getenv("TMPDIR");
  std::string base =
      std::string(dir != nullptr && *dir != '\0' ? dir : "/tmp") + "/vram-bench-XXXXXX";
  if (mkdtemp(base.data()) == nullptr) {
    error_ = "cannot create a temporary folder " + base + ": " + std::strerror(errno);
    return;
  }
  directory_ = base;
  const std::string path = directory_ + "/file" + suffix;
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    error_ = "cannot create " + path + ": " + std::strerror(errno);
    return;
  }
  path_ = path;
  std::size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = write(fd, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      error_ = "cannot write " + path_ + (n < 0 ? std::string(": ") + std::strerror(errno) : "");
      break;
    }
    written += static_cast<std::size_t>(n);
  }
  close(fd);
}

TemporaryFile::~TemporaryFile() {
  if (!path_.empty()) unlink(path_.c_str());
  if (!directory_.empty()) rmdir(directory_.c_str());
}

std::string bench_python() {
  const char* python = std::getenv("VRAM_BENCH_PYTHON");
  return python != nullptr && *python != '\0' ? python : "python3";
}

ChildRun run_python(const std::string& python, const std::string& script,
                    const std::vector<std::string>& arguments, int timeout_s) {
  TemporaryFile file(script, ".py");
  if (file.path().empty() || !file.error().empty()) {
    ChildRun run;
    run.error = file.error();
    return run;
  }
  std::vector<std::string> argv = {python, file.path()};
  argv.insert(argv.end(), arguments.begin(), arguments.end());
  return run_child(argv, timeout_s);
}

}  // namespace vram::bench
