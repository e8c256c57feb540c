// Child processes of `vram bench` and its tests (child_process.hpp).
#include "bench/child_process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "bench/harness.hpp"

extern char** environ;

namespace vram::bench {
namespace {

void split_lines(std::string& pending, std::vector<std::string>& lines, bool flush) {
  std::size_t start = 0;
  for (std::size_t at = pending.find('\n'); at != std::string::npos;
       at = pending.find('\n', start)) {
    lines.push_back(pending.substr(start, at - start));
    start = at + 1;
  }
  pending.erase(0, start);
  if (flush && !pending.empty()) {
    lines.push_back(pending);
    pending.clear();
  }
}

}  // namespace

ChildRun run_child(const std::vector<std::string>& command, int timeout_s) {
  ChildRun run;
  if (command.empty()) {
    run.error = "no program to run";
    return run;
  }
  const std::string& program = command.front();
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) {
    run.error = std::string("pipe2: ") + std::strerror(errno);
    return run;
  }
  std::vector<std::string> argv_text = command;
  std::vector<char*> argv;
  for (std::string& a : argv_text) argv.push_back(a.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDERR_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  // Its own process group: a child stopped at its limit takes what it started with it.
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attributes, 0);
  pid_t pid = -1;
  const int spawned =
      posix_spawnp(&pid, program.c_str(), &actions, &attributes, argv.data(), environ);
  posix_spawnattr_destroy(&attributes);
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  if (spawned != 0) {
    close(pipe_fds[0]);
    run.error = "cannot start " + program + ": " + std::strerror(spawned);
    return run;
  }

  std::string pending;
  const double deadline = now_seconds() + timeout_s;
  bool timed_out = false;
  std::string failure;
  for (;;) {  // its output, until the end of it (the child exited or closed it)
    const double left = deadline - now_seconds();
    if (left <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{pipe_fds[0], POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(std::min(left, 1.0) * 1000) + 1);
    if (ready == 0 || (ready < 0 && errno == EINTR)) continue;
    if (ready < 0) {
      failure = std::string("poll: ") + std::strerror(errno);
      break;
    }
    char buffer[4096];
    const ssize_t n = read(pipe_fds[0], buffer, sizeof buffer);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) failure = std::string("read: ") + std::strerror(errno);
    if (n <= 0) break;
    pending.append(buffer, static_cast<std::size_t>(n));
    split_lines(pending, run.lines, false);
  }
  close(pipe_fds[0]);
  split_lines(pending, run.lines, true);
  // Its exit, within the same limit (it may have closed its output and run on).
  int status = 0;
  pid_t reaped = 0;
  while (!timed_out && failure.empty()) {
    reaped = waitpid(pid, &status, WNOHANG);
    if (reaped == pid) break;
    if (reaped < 0 && errno != EINTR) {
      failure = std::string("waitpid: ") + std::strerror(errno);
      break;
    }
    if (now_seconds() >= deadline) {
      timed_out = true;
      break;
    }
    usleep(10000);
  }
  if (reaped != pid) {  // stopped at its limit, or lost: the whole group goes
    kill(-pid, SIGKILL);
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  if (timed_out) {
    run.error = program + " was stopped after " + std::to_string(timeout_s) + " s";
  } else if (!failure.empty()) {
    run.error = program + ": " + failure + " (stopped)";
  } else if (WIFEXITED(status)) {
    run.ran = true;
    run.exit_code = WEXITSTATUS(status);
  } else {
    run.error = program + " ended by signal " + std::to_string(WTERMSIG(status));
  }
  return run;
}

}  // namespace vram::bench
