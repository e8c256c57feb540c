// vram CLI: `vram info` (devices, driver, link, pools, copy engines) and `vram bench`
// (our pools against the peers users would pick instead).
// A new sub-command is one line in kCommands (its function declared in commands.hpp).
// Exit codes: 0 done, 1 run-time failure (an exception), 2 bad usage; a command may add
// its own (vram bench: 3 nothing measured).
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "commands.hpp"

namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args);
};

constexpr Command kCommands[] = {
    {"info", "devices, driver, PCIe link, memory pools, copy engines", vram::cli::run_info},
    {"bench", "our pools vs cudaMalloc, cudaMallocAsync, CUB, pinning (bench --help)",
     vram::cli::run_bench},
    {"replay", "replay allocation traces through our pools and the peers (replay --help)",
     vram::cli::run_replay},
};

void print_usage(std::FILE* out) {
  std::fprintf(out, "usage: vram <command> [options]   (vram --version, vram --help)\n");
  for (const auto& command : kCommands) {
    std::fprintf(out, "  %-8s %s\n", command.name, command.summary);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    print_usage(args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--version" || args[0] == "version") {
    std::printf("%s\n", vram::cli::version_text().c_str());
    return 0;
  }
  const std::string name = args[0];
  args.erase(args.begin());
  for (const auto& command : kCommands) {
    if (name != command.name) continue;
    try {
      return command.run(args);
    } catch (const std::exception& error) {
      std::fprintf(stderr, "vram %s: %s\n", name.c_str(), error.what());
      return 1;
    }
  }
  std::fprintf(stderr, "vram: unknown command '%s'\n", name.c_str());
  print_usage(stderr);
  return 2;
}
