// tools/bench/child_process.hpp: a program run as a child process whose output is read back,
// with a time limit (Python peers of `vram bench`, the tests' second processes).
//
// The child's standard output and error come back as lines, nothing it prints reaches ours;
// its standard input is /dev/null. It runs in a process group of its own: stopped at its
// limit (its output and its exit both count), the whole group is killed. The pipe is
// close-on-exec (other descriptors are the caller's to mark); a signal that interrupts a
// wait is waited through.
#pragma once

#include <string>
#include <vector>

namespace vram::bench {

struct ChildRun {
  bool ran = false;                // the program started and exited by itself
  int exit_code = -1;              // its exit status when it ran
  std::vector<std::string> lines;  // standard output and error, in arrival order
  std::string error;               // why it did not run or was stopped; empty otherwise
};

// Runs command[0] (a path, or a name looked up in PATH) with the rest as its arguments;
// stops it after `timeout_s` seconds. Never throws for a failure of the child: see ChildRun.
ChildRun run_child(const std::vector<std::string>& command, int timeout_s);

}  // namespace vram::bench
