// Misuse of the staging layer's threads and of host weights: the fill, stager and touch
// threads when the system cannot start them (each case in a death-test child, EXPECT_EXIT, so
// a crash or hang stays in the child and the failure names what happened), and on a GPU,
// device memory as host weights, an absurd staging_buffers and a bad device ordinal.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <sys/mman.h>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "gpu_test_policy.hpp"
#include "null_staged_copy_target.hpp"
#include "staging/pageable_stager.hpp"
#include "staging/parallel_copy.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/pinned_host_upstream.hpp"
#include "vram/units.hpp"
#include "vram/upstream.hpp"
#include "vram/weight_pager.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

// ==== Thread creation failing (memory pressure) ============================================

// Caps the address space of this (death-test child) process at what it maps now plus
// `headroom`, so the next thread stacks (8 MiB each by default) cannot be mapped.
void cap_address_space(std::size_t headroom) {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0;
  statm >> pages;
  const auto limit =
      static_cast<rlim_t>(pages * static_cast<std::size_t>(sysconf(_SC_PAGESIZE)) + headroom);
  const rlimit cap{limit, limit};
  if (setrlimit(RLIMIT_AS, &cap) != 0) std::_Exit(5);
}

// ParallelCopy (the pager's fill threads) and touch_pages_in_parallel (every pinned
// staging buffer of 64 KiB and more) run the work on the threads that started (at least
// the caller's) when the system cannot start one (under memory pressure: exactly when
// HostWeights::automatic falls back to staging); neither hangs nor terminates. The
// children cap their address space, which a sanitizer's shadow memory cannot live with:
// these tests are the plain build's.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MISUSE_SKIP_UNDER_SANITIZERS() \
  GTEST_SKIP() << "caps the address space, which the sanitizer's shadow memory cannot live with"
#else
#define MISUSE_SKIP_UNDER_SANITIZERS() (void)0
#endif

// Runs in a death-test child: exits 0 when `body` returns true, 3 when it throws, 4 when it
// returns false; killed by SIGALRM after 10 s if it hangs.
template <class Body>
[[noreturn]] void exit_zero_if_done(Body&& body) {
  alarm(10);
  try {
    std::_Exit(body() ? 0 : 4);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "threw: %s\n", error.what());
    std::_Exit(3);
  }
}

TEST(StagingThreadsMisuseDeathTest, FillThreadsThatCannotStartLeaveTheCopyToThoseThatDid) {
  MISUSE_SKIP_UNDER_SANITIZERS();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_zero_if_done([] {
                std::vector<std::byte> from(64_MiB, std::byte{0x3C});
                std::vector<std::byte> to(64_MiB);
                cap_address_space(20_MiB);  // room for about two thread stacks
                detail::ParallelCopy copy(64);
                copy.run(to.data(), from.data(), to.size());
                return to.front() == std::byte{0x3C} && to.back() == std::byte{0x3C} &&
                       to[to.size() / 2 + 12345] == std::byte{0x3C};
              }),
              ::testing::ExitedWithCode(0), "");
}

// The same through the pager's stager (the object WeightPager's pageable path builds). The
// stager's own thread (the one that issues the copies) must start: when the fill
// threads took the last room, the constructor throws std::system_error, with every thread
// it started joined.
TEST(StagingThreadsMisuseDeathTest, StagerWhoseThreadsCannotAllStartThrowsAndJoins) {
  MISUSE_SKIP_UNDER_SANITIZERS();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_zero_if_done([] {
                NullTarget target;
                auto upstream = std::make_shared<HostMemoryUpstream>();
                cap_address_space(20_MiB);
                try {
                  detail::PageableStager stager(target, {.slot_count = 2,
                                                         .chunk_bytes = 4096,
                                                         .staging_buffers = 2,
                                                         .fill_threads = 64,
                                                         .staging_upstream = upstream});
                  stager.drain();
                  return stager.pool_stats().free_buffers == 2;  // enough room after all
                } catch (const std::system_error& error) {
                  std::fprintf(stderr, "threw as expected: %s\n", error.what());
                  return true;
                }
              }),
              ::testing::ExitedWithCode(0), "");
}

TEST(StagingThreadsMisuseDeathTest, TouchThreadsThatCannotStartLeaveThePagesToTheCaller) {
  MISUSE_SKIP_UNDER_SANITIZERS();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(exit_zero_if_done([] {
                const std::size_t bytes = 512_MiB;  // 16 parts of 32 MiB: 15 threads wanted
                void* block = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
                if (block == MAP_FAILED) std::_Exit(6);
                std::memset(block, 0x7F, bytes);  // touched pages must be written 0
                cap_address_space(20_MiB);
                touch_pages_in_parallel(block, bytes, 16);
                const auto* bytes_at = static_cast<const unsigned char*>(block);
                for (std::size_t offset = 0; offset < bytes; offset += 4096) {
                  if (bytes_at[offset] != 0) return false;  // a page nobody touched
                }
                return true;
              }),
              ::testing::ExitedWithCode(0), "");
}

// ==== On a GPU (skip without one) =========================================================

// GPU-only. A WeightLayer whose host pointer is device memory (a cudaMalloc pointer) is
// an InvalidArgument naming the layer in pinned mode, not a PinningError advising to
// raise RLIMIT_MEMLOCK.
TEST(StagingMisuseGpu, DevicePointerAsHostWeightIsInvalidArgumentInPinnedMode) {
  VRAM_GPU_TEST_OR_SKIP();
  void* device_weights = nullptr;
  ASSERT_EQ(cudaMalloc(&device_weights, 4 * 64_KiB), cudaSuccess);
  std::vector<WeightLayer> layers;
  for (int i = 0; i < 4; ++i) {
    layers.push_back(
        {"d" + std::to_string(i),
         static_cast<std::byte*>(device_weights) + static_cast<std::size_t>(i) * 64_KiB, 64_KiB});
  }
  try {
    WeightPager pager(layers, {.plan = {.budget_bytes = 2 * 64_KiB},
                               .host = HostWeights::pinned,
                               .print_plan_warnings = false});
    ADD_FAILURE() << "device memory accepted as host weights";
  } catch (const InvalidArgument&) {
  } catch (const std::exception& error) {
    ADD_FAILURE() << "wrong error type: " << error.what();
  }
  (void)cudaFree(device_weights);
}

// GPU-only. The automatic and pageable modes refuse device memory as "host" weights at
// construction too, naming the layer: their fill threads would memcpy from a device
// address on the host.
TEST(StagingMisuseGpu, DevicePointerAsHostWeightIsRefusedInEveryMode) {
  VRAM_GPU_TEST_OR_SKIP();
  void* device_weights = nullptr;
  ASSERT_EQ(cudaMalloc(&device_weights, 4 * 64_KiB), cudaSuccess);
  std::vector<std::vector<std::byte>> host(3, std::vector<std::byte>(64_KiB, std::byte{1}));
  std::vector<WeightLayer> layers;
  for (std::size_t i = 0; i < 3; ++i)
    layers.push_back({"h" + std::to_string(i), host[i].data(), 64_KiB});
  layers.push_back({"on-device", device_weights, 64_KiB});  // the last one only
  for (const auto mode : {HostWeights::automatic, HostWeights::pageable, HostWeights::pinned}) {
    try {
      WeightPager pager(
          layers,
          {.plan = {.budget_bytes = 2 * 64_KiB}, .host = mode, .print_plan_warnings = false});
      ADD_FAILURE() << "device memory accepted as host weights";
    } catch (const InvalidArgument& error) {
      EXPECT_NE(std::string(error.what()).find("'on-device'"), std::string::npos) << error.what();
    }
  }
  EXPECT_EQ(cudaFree(device_weights), cudaSuccess);
}

// GPU-only: the absurd staging_buffers through the public option (see the CPU case).
TEST(StagingMisuseGpu, AbsurdStagingBufferCountIsInvalidArgumentFromThePager) {
  VRAM_GPU_TEST_OR_SKIP();
  std::vector<std::vector<std::byte>> data(4, std::vector<std::byte>(64_KiB, std::byte{1}));
  std::vector<WeightLayer> layers;
  for (std::size_t i = 0; i < 4; ++i)
    layers.push_back({"p" + std::to_string(i), data[i].data(), 64_KiB});
  try {
    WeightPager pager(layers, {.plan = {.budget_bytes = 2 * 64_KiB},
                               .host = HostWeights::pageable,
                               .staging_buffers = SIZE_MAX,
                               .print_plan_warnings = false});
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument&) {
  } catch (const std::exception& error) {
    ADD_FAILURE() << "wrong error type: " << error.what();
  }
}

// GPU-only: a bad device ordinal is a CudaError naming the call with a Fix, and nothing
// is pinned or leaked.
TEST(StagingMisuseGpu, BadDeviceOrdinalIsACudaErrorWithAFix) {
  VRAM_GPU_TEST_OR_SKIP();
  std::vector<std::byte> data(64_KiB, std::byte{1});
  try {
    WeightPager pager(
        {{"x", data.data(), data.size()}},
        {.plan = {.budget_bytes = 1_MiB}, .device = 4096, .print_plan_warnings = false});
    ADD_FAILURE() << "device 4096 accepted";
  } catch (const CudaError& error) {
    EXPECT_NE(std::string(error.what()).find("Fix:"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace vram::testing
