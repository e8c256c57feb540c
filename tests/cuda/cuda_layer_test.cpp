// The CUDA layer: streams, events, guards and driver entry points on the GPU, and the rule that
// every CUDA call is made under src/cuda/.
#include <gtest/gtest.h>

#include <cuda.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "gpu_test_policy.hpp"
#include "source_tree.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/driver_api.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/event.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

TEST(CudaLayerGpu, StreamsCreateQueryAndSynchronize) {
  VRAM_GPU_TEST_OR_SKIP();
  cuda::Stream stream;
  EXPECT_NE(stream.get(), nullptr);
  stream.synchronize();
  EXPECT_TRUE(stream.ready());
  cuda::Stream moved(std::move(stream));
  EXPECT_EQ(stream.get(), nullptr);
  moved.synchronize();
}

TEST(CudaLayerGpu, EventsRecordQueryAndTime) {
  VRAM_GPU_TEST_OR_SKIP();
  cuda::Stream stream;
  cuda::Event start(cuda::Event::Timing::enabled);
  cuda::Event stop(cuda::Event::Timing::enabled);
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 64 << 20), cudaSuccess);
  start.record(stream.get());
  ASSERT_EQ(cudaMemsetAsync(device, 1, 64 << 20, stream.get()), cudaSuccess);
  stop.record(stream.get());
  stop.wait();
  EXPECT_TRUE(stop.ready());
  EXPECT_GT(cuda::Event::elapsed_ms(start, stop), 0.0F);
  cuda::Event untimed;  // timing off by default: elapsed time is an error
  untimed.record(stream.get());
  untimed.wait();
  EXPECT_THROW((void)cuda::Event::elapsed_ms(untimed, untimed), CudaError);
  cudaFree(device);
}

TEST(CudaLayerGpu, InvalidOrdinalBecomesACudaErrorWithAFix) {
  VRAM_GPU_TEST_OR_SKIP();
  try {
    (void)cuda::Device::properties(cuda::Device::count() + 7);
    FAIL() << "an invalid ordinal must throw";
  } catch (const CudaError& error) {
    EXPECT_EQ(error.error_name(), "cudaErrorInvalidDevice");
    EXPECT_NE(std::string(error.what()).find("Fix: the device ordinal is out of range"),
              std::string::npos)
        << error.what();
  }
  EXPECT_THROW(cuda::DeviceGuard guard(999), CudaError);
}

TEST(CudaLayerGpu, DeviceGuardRestoresThePreviousDevice) {
  VRAM_GPU_TEST_OR_SKIP();
  // Needs a device other than the current one, or the test could not fail.
  if (cuda::Device::count() < 2) GTEST_SKIP() << "needs 2 GPUs to switch between";
  const int before = cuda::Device::current();
  const int other = before == 0 ? 1 : 0;
  {
    cuda::DeviceGuard guard(other);
    EXPECT_EQ(cuda::Device::current(), other);
  }
  EXPECT_EQ(cuda::Device::current(), before);
}

TEST(CudaLayerGpu, PropertiesDescribeTheDevice) {
  VRAM_GPU_TEST_OR_SKIP();
  const auto p = cuda::Device::properties(0);
  EXPECT_FALSE(p.name.empty());
  EXPECT_GE(p.compute_major, 7);
  EXPECT_GT(p.total_memory_bytes, p.free_memory_bytes / 2);
  EXPECT_GT(p.copy_engines, 0);
  EXPECT_FALSE(p.pci_bus_id.empty());
  EXPECT_GT(p.driver_version, 0);
}

TEST(CudaLayerGpu, DriverEntryPointsResolveAndCanBeCalled) {
  VRAM_GPU_TEST_OR_SKIP();
  const auto& api = cuda::driver_api();
  ASSERT_NE(api.mem_alloc_from_pool_async.function, nullptr);
  ASSERT_NE(api.device_get_default_mem_pool.function, nullptr);
  ASSERT_EQ(cudaFree(nullptr), cudaSuccess);  // make the primary context current
  CUdevice device = 0;
  cuda::check_driver(api.require(api.device_get)(&device, 0), "cuDeviceGet");
  CUmemoryPool pool = nullptr;
  cuda::check_driver(api.require(api.device_get_default_mem_pool)(&pool, device),
                     "cuDeviceGetDefaultMemPool");
  EXPECT_NE(pool, nullptr);
  EXPECT_EQ(cuda::driver_error_name(CUDA_ERROR_OUT_OF_MEMORY), "CUDA_ERROR_OUT_OF_MEMORY");
}

// The layer rule: every CUDA runtime or driver call of the library and its plug-in is made
// under src/cuda/ (or by the inline checks of include/vram/cuda/). Comments and string
// literals are not calls; kernels launched (<<<) count as calls.
TEST(CudaLayer, EveryCudaCallLivesInTheCudaLayer) {
  const std::regex call(R"((\b(cuda|cu)[A-Z][A-Za-z0-9]*\s*\()|(\bdriver_api\s*\()|(<<<))");
  const std::regex literal(R"("([^"\\]|\\.)*")");
  std::vector<std::string> found;
  std::size_t files = 0;
  for (const char* root : {"src", "include/vram", "plugins"}) {
    const std::filesystem::path base = source_path(root);
    ASSERT_TRUE(std::filesystem::is_directory(base)) << base;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(base)) {
      if (!entry.is_regular_file()) continue;
      const std::string path = entry.path().generic_string();
      if (path.find("/src/cuda/") != std::string::npos ||
          path.find("/include/vram/cuda/") != std::string::npos) {
        continue;
      }
      const std::string ext = entry.path().extension().string();
      if (ext != ".cpp" && ext != ".hpp" && ext != ".h" && ext != ".cu" && ext != ".cuh") continue;
      ++files;
      std::ifstream in(entry.path());
      std::string line;
      for (int number = 1; std::getline(in, line); ++number) {
        const auto first = line.find_first_not_of(" \t");
        if (first != std::string::npos &&
            (line[first] == '*' || line.compare(first, 2, "/*") == 0)) {
          continue;  // a block comment's line
        }
        std::string code = std::regex_replace(line, literal, "\"\"");
        if (const auto comment = code.find("//"); comment != std::string::npos) {
          code.erase(comment);
        }
        if (std::regex_search(code, call)) {
          found.push_back(path + ":" + std::to_string(number) + ": " + line);
        }
      }
    }
  }
  EXPECT_GT(files, 10U);
  std::string report;
  for (const auto& f : found) report += f + "\n";
  EXPECT_TRUE(found.empty()) << found.size() << " CUDA calls outside src/cuda/:\n" << report;
}

}  // namespace
}  // namespace vram::testing
