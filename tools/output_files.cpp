// Output files of `vram bench` and `vram replay` (declared in commands.hpp): the one place
// that decides whether an output path may be written and writes it. Both commands check
// every output with can_create, the outputs against each other with distinct_outputs and
// against their traces with outputs_spare_traces, all before anything runs.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "commands.hpp"

namespace vram::cli {
namespace {

std::string directory_of(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Creates an empty temporary file beside `path`; returns its name, or "" with errno set.
std::string make_temporary_beside(const std::string& path) {
  std::string name = path + ".tmp-XXXXXX";
  const int fd = mkstemp(name.data());
  if (fd < 0) return {};
  // mkstemp creates mode 0600; give the file the mode a plain fopen would (0666 & ~umask).
  const mode_t mask = umask(0);
  umask(mask);
  (void)fchmod(fd, 0666 & ~mask);
  close(fd);
  return name;
}

const char* kind_of(mode_t mode) {
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Whether `a` and `b` name one file: the same device and inode where both exist (hard
// links, symlinks, other spellings), else the same normalized path.
bool same_file(const std::string& a, const std::string& b) {
  std::error_code error;
  if (std::filesystem::equivalent(a, b, error) && !error) return true;
  // weakly_canonical keeps a relative path whose first element does not exist relative
  // ("o.json" but "/cwd/o.json" for "./o.json"): made absolute first, both compare.
  const auto normalized = [](const std::string& path, std::filesystem::path& out) {
    std::error_code failed;
    const auto absolute = std::filesystem::absolute(path, failed);
    if (failed) return false;
    out = std::filesystem::weakly_canonical(absolute, failed);
    return !failed;
  };
  std::filesystem::path normalized_a;
  std::filesystem::path normalized_b;
  return normalized(a, normalized_a) && normalized(b, normalized_b) && normalized_a == normalized_b;
}

// Whether `path` exists and is the file open as standard input (fd 0).
bool is_standard_input(const std::string& path) {
  struct stat input {};
  struct stat target {};
  return fstat(STDIN_FILENO, &input) == 0 && stat(path.c_str(), &target) == 0 &&
         input.st_dev == target.st_dev && input.st_ino == target.st_ino;
}

}  // namespace

bool set_output_path(const char* command, OutputFile& output, const std::string& value) {
  if (value.empty()) {
    std::fprintf(stderr, "%s: %s needs a file name, got an empty one\n", command, output.flag);
    return false;
  }
  output.path = value;
  return true;
}

bool can_create(const char* command, const OutputFile& output) {
  if (output.path.empty() || output.path == "-") return true;
  struct stat info {};
  if (stat(output.path.c_str(), &info) == 0) {
    if (S_ISDIR(info.st_mode)) {
      std::fprintf(stderr, "%s: cannot write %s file '%s': it is a directory\n", command,
                   output.flag, output.path.c_str());
      return false;
    }
    // The finished file is renamed over the target, which would replace a device or FIFO
    // by a regular file: only a regular file (or a new name) is a target.
    if (!S_ISREG(info.st_mode)) {
      std::fprintf(stderr,
                   "%s: cannot write %s file '%s': it is %s, not a regular file, and would be "
                   "replaced by one. Fix: name a regular file or a new one\n",
                   command, output.flag, output.path.c_str(), kind_of(info.st_mode));
      return false;
    }
  }
  const std::string probe = make_temporary_beside(output.path);
  if (probe.empty()) {
    std::fprintf(stderr, "%s: cannot write %s file '%s': cannot create a file in '%s': %s\n",
                 command, output.flag, output.path.c_str(), directory_of(output.path).c_str(),
                 std::strerror(errno));
    return false;
  }
  std::remove(probe.c_str());
  return true;
}

bool distinct_outputs(const char* command, std::initializer_list<const OutputFile*> outputs) {
  for (auto a = outputs.begin(); a != outputs.end(); ++a) {
    if ((*a)->path.empty() || (*a)->path == "-") continue;
    for (auto b = a + 1; b != outputs.end(); ++b) {
      if ((*b)->path.empty() || (*b)->path == "-") continue;
      if (!same_file((*a)->path, (*b)->path)) continue;
      std::fprintf(stderr,
                   "%s: %s file '%s' and %s file '%s' are one file: one output would replace "
                   "the other. Fix: give each its own file\n",
                   command, (*a)->flag, (*a)->path.c_str(), (*b)->flag, (*b)->path.c_str());
      return false;
    }
  }
  return true;
}

bool outputs_spare_traces(const char* command, std::initializer_list<const OutputFile*> outputs,
                          const std::vector<std::string>& traces, const char* read_by) {
  for (const OutputFile* output : outputs) {
    if (output->path.empty() || output->path == "-") continue;
    for (const auto& trace : traces) {
      if (trace == "-" ? !is_standard_input(output->path) : !same_file(output->path, trace)) {
        continue;
      }
      std::fprintf(stderr,
                   "%s: %s file '%s' is the trace '%s'%s%s: it would be overwritten. Fix: name "
                   "another file\n",
                   command, output->flag, output->path.c_str(), trace.c_str(),
                   trace == "-" ? " (standard input)" : "", read_by);
      return false;
    }
  }
  return true;
}

bool write_outputs(const char* command, const std::vector<OutputFile>& outputs, std::FILE* human) {
  std::vector<std::pair<std::string, const OutputFile*>> written;
  auto discard = [&] {
    for (const auto& [temporary, output] : written) std::remove(temporary.c_str());
  };
  for (const auto& output : outputs) {
    if (output.path.empty() || output.path == "-") continue;
    const std::string temporary = make_temporary_beside(output.path);
    std::FILE* file = temporary.empty() ? nullptr : std::fopen(temporary.c_str(), "w");
    bool ok = file != nullptr;
    if (ok) {
      written.emplace_back(temporary, &output);
      ok = std::fwrite(output.content.data(), 1, output.content.size(), file) ==
           output.content.size();
      ok = (std::fclose(file) == 0) && ok;
    }
    if (!ok) {
      std::fprintf(stderr, "%s: writing %s file '%s' failed: %s; no file was replaced\n", command,
                   output.flag, output.path.c_str(), std::strerror(errno));
      discard();
      return false;
    }
  }
  for (const auto& [temporary, output] : written) {
    if (std::rename(temporary.c_str(), output->path.c_str()) != 0) {
      std::fprintf(stderr, "%s: renaming '%s' to '%s' failed: %s\n", command, temporary.c_str(),
                   output->path.c_str(), std::strerror(errno));
      discard();
      return false;
    }
    std::fprintf(human, "wrote %s\n", output->path.c_str());
  }
  for (const auto& output : outputs) {
    if (output.path == "-") std::fputs(output.content.c_str(), stdout);
  }
  std::fflush(stdout);
  return true;
}

}  // namespace vram::cli
