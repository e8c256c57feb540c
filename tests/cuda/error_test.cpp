// The error layer on the CPU: messages, Fix hints, mapping, OutOfMemory as bad_alloc.
#include <gtest/gtest.h>

#include <cuda.h>

#include "vram/cuda/driver_api.hpp"
#include "vram/cuda/error.hpp"

namespace vram {
namespace {

TEST(CudaError, NamesTheCallTheErrorAndAFix) {
  try {
    cuda::check(cudaErrorNoDevice, "cudaSetDevice");
    FAIL() << "check must throw";
  } catch (const CudaError& error) {
    const std::string what = error.what();
    EXPECT_EQ(error.call(), "cudaSetDevice");
    EXPECT_EQ(error.error_name(), "cudaErrorNoDevice");
    EXPECT_EQ(error.code(), static_cast<int>(cudaErrorNoDevice));
    EXPECT_FALSE(error.is_driver_error());
    EXPECT_NE(what.find("cudaSetDevice failed: cudaErrorNoDevice"), std::string::npos) << what;
    EXPECT_NE(what.find("Fix:"), std::string::npos) << what;
  }
}

TEST(CudaError, CommonErrorsHaveFixHints) {
  for (auto result : {cudaErrorNoDevice, cudaErrorInsufficientDriver, cudaErrorMemoryAllocation,
                      cudaErrorNotSupported, cudaErrorInvalidDevice, cudaErrorInvalidValue,
                      cudaErrorCudartUnloading}) {
    EXPECT_EQ(cuda::fix_hint(result).rfind("Fix:", 0), 0U) << cudaGetErrorName(result);
  }
  EXPECT_TRUE(cuda::fix_hint(cudaErrorLaunchTimeout).empty());
  const std::string message = cuda::make_error(cudaErrorLaunchTimeout, "k").what();
  EXPECT_EQ(message.find("Fix:"), std::string::npos);
}

TEST(CudaError, SuccessDoesNotThrow) { EXPECT_NO_THROW(cuda::check(cudaSuccess, "x")); }

TEST(CudaError, DriverErrorsAreDescribedEvenWithoutADriver) {
  try {
    cuda::check_driver(CUDA_ERROR_OUT_OF_MEMORY, "cuMemAllocFromPoolAsync");
    FAIL();
  } catch (const CudaError& error) {
    EXPECT_TRUE(error.is_driver_error());
    EXPECT_EQ(error.call(), "cuMemAllocFromPoolAsync");
    const std::string what = error.what();
    EXPECT_NE(what.find("cuMemAllocFromPoolAsync failed"), std::string::npos);
    EXPECT_NE(what.find("Fix:"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(cuda::check_driver(CUDA_SUCCESS, "x"));
}

TEST(CudaError, MissingDriverEntryPointNamesTheFunctionAndVersion) {
  cuda::DriverEntry<PFN_cuMemPoolCreate_v11020> missing{nullptr, "cuMemPoolCreate", 11020};
  try {
    (void)cuda::driver_api().require(missing);
    FAIL();
  } catch (const CudaError& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("cuMemPoolCreate"), std::string::npos);
    EXPECT_NE(what.find("CUDA 11.2"), std::string::npos) << what;
    EXPECT_NE(what.find("Fix:"), std::string::npos);
  }
}

TEST(OutOfMemory, IsABadAllocCarryingTheSizes) {
  try {
    throw OutOfMemory(1 << 20, 4096, 8192, "detail here");
  } catch (const std::bad_alloc& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("1048576 bytes requested"), std::string::npos) << what;
    EXPECT_NE(what.find("4096 bytes cached"), std::string::npos);
    EXPECT_NE(what.find("8192 bytes in use"), std::string::npos);
    EXPECT_NE(what.find("detail here"), std::string::npos);
    const auto* oom = dynamic_cast<const OutOfMemory*>(&error);
    ASSERT_NE(oom, nullptr);
    EXPECT_EQ(oom->requested_bytes(), 1U << 20);
  }
}

TEST(CudaError, ShutdownResultsAreRecognized) {
  EXPECT_TRUE(cuda::is_shutdown_error(cudaErrorCudartUnloading));
  EXPECT_FALSE(cuda::is_shutdown_error(cudaErrorInvalidValue));
  EXPECT_TRUE(cuda::is_driver_shutdown_error(CUDA_ERROR_DEINITIALIZED));
  EXPECT_FALSE(cuda::is_driver_shutdown_error(CUDA_ERROR_OUT_OF_MEMORY));
}

}  // namespace
}  // namespace vram
