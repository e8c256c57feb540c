// vram CLI: `vram info` (devices, driver, link, pools, copy engines) and `vram bench`
// (our pools against the peers users would pick instead).
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "commands.hpp"

namespace {

void print_usage(std::FILE* out) {
  std::fprintf(out,
               "usage: vram <command> [options]\n"
               "  info                 devices, driver, PCIe link, memory pools, copy engines\n"
               "  bench [options]      our pools vs cudaMalloc, cudaMallocAsync, CUB, pinning\n"
               "                       (vram bench --help for its options)\n"
               "  replay TRACE...      replay allocation traces through our pools and the peers\n"
               "                       (vram replay --help for its options)\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    print_usage(args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  try {
    if (command == "info") return vram::cli::run_info(args);
    if (command == "bench") return vram::cli::run_bench(args);
    if (command == "replay") return vram::cli::run_replay(args);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "vram %s: %s\n", command.c_str(), error.what());
    return 1;
  }
  std::fprintf(stderr, "vram: unknown command '%s'\n", command.c_str());
  print_usage(stderr);
  return 2;
}
