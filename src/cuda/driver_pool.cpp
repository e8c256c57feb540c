#include "cuda/driver_pool.hpp"

#include "vram/cuda/driver_api.hpp"
#include "vram/cuda/error.hpp"

namespace vram::cuda {
namespace {

CUdevice driver_device(int device) {
  const auto& api = driver_api();
  CUdevice result = 0;
  check_driver(api.require(api.device_get)(&result, device), "cuDeviceGet");
  return result;
}

}  // namespace

CUcontext current_context() {
  const auto& api = driver_api();
  CUcontext context = nullptr;
  check_driver(api.require(api.ctx_get_current)(&context), "cuCtxGetCurrent");
  return context;
}

bool bind_context(CUcontext context) noexcept {
  auto set = driver_api().ctx_set_current.function;
  return context != nullptr && set != nullptr && set(context) == CUDA_SUCCESS;
}

CUmemoryPool create_memory_pool(int device, bool ipc_shareable) {
  const auto& api = driver_api();
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.handleTypes =
      ipc_shareable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = driver_device(device);
  CUmemoryPool pool = nullptr;
  check_driver(api.require(api.mem_pool_create)(&pool, &props), "cuMemPoolCreate");
  return pool;
}

CUmemoryPool default_memory_pool(int device) {
  const auto& api = driver_api();
  const CUdevice cu_device = driver_device(device);
  CUmemoryPool pool = nullptr;
  check_driver(api.require(api.device_get_default_mem_pool)(&pool, cu_device),
               "cuDeviceGetDefaultMemPool");
  return pool;
}

void destroy_memory_pool(CUmemoryPool pool) noexcept {
  if (auto f = driver_api().mem_pool_destroy.function; f != nullptr) (void)f(pool);
}

std::uint64_t pool_attribute(CUmemoryPool pool, CUmemPool_attribute attribute, const char* label) {
  const auto& api = driver_api();
  cuuint64_t value = 0;
  check_driver(api.require(api.mem_pool_get_attribute)(pool, attribute, &value), label);
  return value;
}

void set_pool_attribute(CUmemoryPool pool, CUmemPool_attribute attribute, std::uint64_t value,
                        const char* label) {
  const auto& api = driver_api();
  cuuint64_t raw = value;
  check_driver(api.require(api.mem_pool_set_attribute)(pool, attribute, &raw), label);
}

CUresult try_set_pool_attribute(CUmemoryPool pool, CUmemPool_attribute attribute,
                                std::uint64_t value) noexcept {
  auto set = driver_api().mem_pool_set_attribute.function;
  if (set == nullptr) return CUDA_ERROR_DEINITIALIZED;
  cuuint64_t raw = value;
  return set(pool, attribute, &raw);
}

void trim_pool(CUmemoryPool pool, std::size_t keep_bytes) {
  const auto& api = driver_api();
  check_driver(api.require(api.mem_pool_trim_to)(pool, keep_bytes), "cuMemPoolTrimTo");
}

CUresult allocate_from_pool_async(CUdeviceptr& block, std::size_t bytes, CUmemoryPool pool,
                                  cudaStream_t stream) {
  // Resolved once: the warm allocation pays one guard check, not a table look-up.
  static const auto alloc = driver_api().require(driver_api().mem_alloc_from_pool_async);
  return alloc(&block, bytes, pool, stream);
}

CUresult free_async(CUdeviceptr block, cudaStream_t stream) noexcept {
  static const auto free = driver_api().mem_free_async.function;
  return free != nullptr ? free(block, stream) : CUDA_ERROR_DEINITIALIZED;
}

}  // namespace vram::cuda
