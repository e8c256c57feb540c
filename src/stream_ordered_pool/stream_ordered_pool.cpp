#include "vram/stream_ordered_pool.hpp"

#include <cstdio>
#include <string>
#include <utility>

#include "block_registry.hpp"
#include "cuda/driver_pool.hpp"
#include "cuda/memory.hpp"
#include "vram/cuda/device.hpp"
#include "vram/cuda/driver_api.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/event.hpp"

namespace vram {
namespace {

CUmemoryPool as_pool(void* pool) { return static_cast<CUmemoryPool>(pool); }

void check_alignment(std::size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > 256) {
    throw InvalidArgument("vram::StreamOrderedPool: alignment " + std::to_string(alignment) +
                          " is not a power of two up to 256. Fix: pool blocks are 256-byte "
                          "aligned; ask for 256 or less.");
  }
}

}  // namespace

StreamOrderedPool::StreamOrderedPool(Options options) {
  if (options.use_default_pool && options.ipc_shareable) {
    throw InvalidArgument(
        "vram::StreamOrderedPool: ipc_shareable needs a private pool, but use_default_pool is "
        "set (the default pool's handle types are fixed). Fix: drop one of the two options.");
  }
  if (options.device < -1) {
    throw InvalidArgument("vram::StreamOrderedPool: device " + std::to_string(options.device) +
                          " is not a device. Fix: a device index, or -1 for the current one.");
  }
  if (options.device >= 0) cuda::Device::require_present(options.device, "vram::StreamOrderedPool");
  blocks_ = std::make_unique<detail::BlockRegistry>();
  device_ = options.device < 0 ? cuda::Device::current() : options.device;
  cuda::DeviceGuard guard(device_);
  if (!cuda::Device::memory_pools_supported(device_)) {
    throw CudaError("cudaDeviceGetAttribute(cudaDevAttrMemoryPoolsSupported)",
                    static_cast<int>(cudaErrorNotSupported), false, "cudaErrorNotSupported",
                    "device " + std::to_string(device_) +
                        " does not support stream-ordered memory pools "
                        "(memoryPoolsSupported == 0). Fix: use vram::DevicePool, or a driver "
                        "and GPU with memory-pool support (CUDA 11.2+, not under some vGPU "
                        "or MPS setups).");
  }
  // Make the primary context current on this thread (the runtime does it on first use)
  // and remember it, so calls from threads without a current context can bind it.
  cuda::initialize_context(device_);
  context_ = cuda::current_context();
  CUmemoryPool pool = nullptr;
  if (!options.use_default_pool) {
    pool = cuda::create_memory_pool(device_, options.ipc_shareable);
    owned_ = true;
  } else {
    pool = cuda::default_memory_pool(device_);
  }
  if (pool == nullptr) {
    throw CudaError("cuDeviceGetDefaultMemPool", 0, true, "CUDA_SUCCESS",
                    "cuDeviceGetDefaultMemPool reported success but returned a null pool. Fix: "
                    "update the NVIDIA driver.");
  }
  pool_ = pool;
  try {
    // A private pool retains freed memory unless told otherwise; the default pool is
    // touched only when asked (and restored in destroy()).
    if (options.release_threshold.has_value()) {
      set_release_threshold(*options.release_threshold);
    } else if (owned_) {
      set_release_threshold(kRetainAll);
    }
  } catch (...) {
    destroy();
    throw;
  }
}

StreamOrderedPool::~StreamOrderedPool() { destroy(); }

StreamOrderedPool::StreamOrderedPool(StreamOrderedPool&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      context_(std::exchange(other.context_, nullptr)),
      device_(other.device_),
      owned_(std::exchange(other.owned_, false)),
      restore_threshold_(std::exchange(other.restore_threshold_, std::nullopt)),
      threshold_set_(other.threshold_set_),
      bytes_in_use_(other.bytes_in_use_.exchange(0, std::memory_order_relaxed)),
      failed_frees_(other.failed_frees_.load(std::memory_order_relaxed)),
      invalid_releases_(other.invalid_releases_.load(std::memory_order_relaxed)),
      blocks_(std::move(other.blocks_)) {}

StreamOrderedPool& StreamOrderedPool::operator=(StreamOrderedPool&& other) noexcept {
  if (this != &other) {
    destroy();
    pool_ = std::exchange(other.pool_, nullptr);
    context_ = std::exchange(other.context_, nullptr);
    device_ = other.device_;
    owned_ = std::exchange(other.owned_, false);
    restore_threshold_ = std::exchange(other.restore_threshold_, std::nullopt);
    threshold_set_ = other.threshold_set_;
    bytes_in_use_.store(other.bytes_in_use_.exchange(0, std::memory_order_relaxed),
                        std::memory_order_relaxed);
    failed_frees_.store(other.failed_frees_.load(std::memory_order_relaxed));
    invalid_releases_.store(other.invalid_releases_.load(std::memory_order_relaxed));
    blocks_ = std::move(other.blocks_);
  }
  return *this;
}

void StreamOrderedPool::destroy() noexcept {
  // The default pool belongs to the context: nothing to destroy, but the release threshold
  // this object changed goes back to what it found (errors, e.g. after shutdown, ignored).
  // A private pool with blocks still allocated is released by the driver once they are
  // freed.
  // Restored only while the threshold is still the one this object set: if another user of
  // the default pool changed it since, restoring would undo their setting.
  bool still_ours = false;
  if (!owned_ && pool_ != nullptr && restore_threshold_.has_value()) {
    try {
      still_ours = release_threshold() == threshold_set_;
    } catch (...) {  // context gone: nothing to restore
    }
  }
  if (still_ours) {
    const auto restore = [this] {
      return cuda::try_set_pool_attribute(as_pool(pool_), CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                          *restore_threshold_);
    };
    if (restore() == CUDA_ERROR_INVALID_CONTEXT && bind_context()) (void)restore();
  }
  if (owned_ && pool_ != nullptr) cuda::destroy_memory_pool(as_pool(pool_));
  pool_ = nullptr;
  owned_ = false;
  restore_threshold_.reset();
}

bool StreamOrderedPool::bind_context() const noexcept {
  // A thread's first call may find no current context: bind the device's primary context.
  return cuda::bind_context(static_cast<CUcontext>(context_));
}

void* StreamOrderedPool::allocate_async(std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) {
    throw InvalidArgument(
        "vram::StreamOrderedPool::allocate_async: zero bytes requested. Fix: keep zero-sized "
        "buffers as null sentinels and ask for at least one byte.");
  }
  CUmemoryPool pool = as_pool(live_pool("allocate_async"));
  CUdeviceptr block = 0;
  CUresult result = cuda::allocate_from_pool_async(block, bytes, pool, stream);
  if (result == CUDA_ERROR_INVALID_CONTEXT && bind_context()) {
    result = cuda::allocate_from_pool_async(block, bytes, pool, stream);
  }
  if (result == CUDA_ERROR_OUT_OF_MEMORY) {
    const std::size_t used = pool_used_bytes();
    const std::size_t reserved = pool_reserved_bytes();
    throw OutOfMemory(bytes, reserved > used ? reserved - used : 0, used,
                      "cuMemAllocFromPoolAsync on device " + std::to_string(device_) +
                          " returned CUDA_ERROR_OUT_OF_MEMORY");
  }
  cuda::check_driver(result, "cuMemAllocFromPoolAsync");
  if (block == 0) {
    throw CudaError("cuMemAllocFromPoolAsync", 0, true, "CUDA_SUCCESS",
                    "cuMemAllocFromPoolAsync returned a null device pointer after reporting "
                    "success for " +
                        std::to_string(bytes) + " bytes. Fix: update the NVIDIA driver.");
  }
  try {
    blocks_->add(reinterpret_cast<void*>(block), bytes);
  } catch (...) {  // no host memory to record it: the block goes back, nothing is lost
    (void)cuda::free_async(block, stream);
    throw;
  }
  bytes_in_use_.fetch_add(bytes, std::memory_order_relaxed);
  return reinterpret_cast<void*>(block);
}

void StreamOrderedPool::deallocate_async(void* block, std::size_t bytes,
                                         cudaStream_t stream) noexcept {
  if (block == nullptr || !blocks_) return;  // null, or a moved-from object
  // Taken out of the record before the driver frees it, so that two racing deallocations of
  // one block cannot both reach cuMemFreeAsync.
  std::size_t recorded = 0;
  switch (blocks_->take(block, bytes, recorded)) {
    case detail::BlockRegistry::Deallocation::taken:
      break;
    case detail::BlockRegistry::Deallocation::unknown:
      invalid_releases_.fetch_add(1, std::memory_order_relaxed);
      std::fprintf(stderr,
                   "vram::StreamOrderedPool: deallocation of %p refused: this pool did not hand "
                   "it out, or it was deallocated already\n",
                   block);
      return;
    case detail::BlockRegistry::Deallocation::wrong_size:
      invalid_releases_.fetch_add(1, std::memory_order_relaxed);
      std::fprintf(stderr,
                   "vram::StreamOrderedPool: deallocation of %p refused: %zu bytes given, it was "
                   "allocated with %zu (it stays allocated)\n",
                   block, bytes, recorded);
      return;
  }
  const auto device_pointer = reinterpret_cast<CUdeviceptr>(block);
  CUresult result = cuda::free_async(device_pointer, stream);
  if (result == CUDA_ERROR_INVALID_CONTEXT && bind_context()) {
    result = cuda::free_async(device_pointer, stream);
  }
  if (result != CUDA_SUCCESS && !cuda::is_driver_shutdown_error(result)) {
    failed_frees_.fetch_add(1, std::memory_order_relaxed);
    std::fprintf(stderr, "vram::StreamOrderedPool: cuMemFreeAsync(%p) failed: %s\n", block,
                 cuda::driver_error_name(result).c_str());
    try {  // not freed: still allocated, and counted in use
      blocks_->add(block, recorded);
    } catch (...) {  // no host memory: it can no longer be deallocated through this object
    }
    return;
  }
  bytes_in_use_.fetch_sub(recorded, std::memory_order_relaxed);
}

void* StreamOrderedPool::allocate_async(std::size_t bytes, std::size_t alignment,
                                        ::cuda::stream_ref stream) {
  check_alignment(alignment);
  return allocate_async(bytes, stream.get());
}

void StreamOrderedPool::deallocate_async(void* block, std::size_t bytes, std::size_t /*alignment*/,
                                         ::cuda::stream_ref stream) noexcept {
  deallocate_async(block, bytes, stream.get());
}

void* StreamOrderedPool::allocate(std::size_t bytes, std::size_t alignment) {
  check_alignment(alignment);
  void* block = allocate_async(bytes, cudaStreamPerThread);
  cuda::synchronize_stream(cudaStreamPerThread);
  return block;
}

void StreamOrderedPool::deallocate(void* block, std::size_t bytes,
                                   std::size_t /*alignment*/) noexcept {
  deallocate_async(block, bytes, cudaStreamPerThread);
  (void)cuda::try_synchronize_stream(cudaStreamPerThread);
}

void StreamOrderedPool::hand_over(cudaStream_t from, cudaStream_t to) {
  cuda::Event handed_over;
  handed_over.record(from);
  handed_over.make_wait(to);
}

void* StreamOrderedPool::live_pool(const char* call) const {
  if (pool_ == nullptr) [[unlikely]] {
    throw InvalidArgument(std::string("vram::StreamOrderedPool: ") + call +
                          " on a moved-from object. Fix: use the StreamOrderedPool it was "
                          "moved to.");
  }
  return pool_;
}

std::uint64_t StreamOrderedPool::get_attribute(int attribute, const char* label) const {
  return cuda::pool_attribute(as_pool(live_pool(label)),
                              static_cast<CUmemPool_attribute>(attribute), label);
}

void StreamOrderedPool::set_attribute(int attribute, std::uint64_t value, const char* label) {
  cuda::set_pool_attribute(as_pool(live_pool(label)), static_cast<CUmemPool_attribute>(attribute),
                           value, label);
}

void StreamOrderedPool::set_release_threshold(std::uint64_t bytes) {
  if (!owned_ && !restore_threshold_.has_value()) restore_threshold_ = release_threshold();
  set_attribute(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, bytes,
                "cuMemPoolSetAttribute(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)");
  threshold_set_ = bytes;
}

std::uint64_t StreamOrderedPool::release_threshold() const {
  return get_attribute(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                       "cuMemPoolGetAttribute(CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)");
}

std::size_t StreamOrderedPool::pool_reserved_bytes() const {
  return get_attribute(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                       "cuMemPoolGetAttribute(CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)");
}

std::size_t StreamOrderedPool::pool_used_bytes() const {
  return get_attribute(CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
                       "cuMemPoolGetAttribute(CU_MEMPOOL_ATTR_USED_MEM_CURRENT)");
}

std::size_t StreamOrderedPool::pool_reserved_high_water() const {
  return get_attribute(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                       "cuMemPoolGetAttribute(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)");
}

std::size_t StreamOrderedPool::pool_used_high_water() const {
  return get_attribute(CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                       "cuMemPoolGetAttribute(CU_MEMPOOL_ATTR_USED_MEM_HIGH)");
}

void StreamOrderedPool::reset_pool_high_water() {
  set_attribute(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0,
                "cuMemPoolSetAttribute(CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)");
  set_attribute(CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0,
                "cuMemPoolSetAttribute(CU_MEMPOOL_ATTR_USED_MEM_HIGH)");
}

void StreamOrderedPool::trim(std::size_t min_keep_bytes) {
  cuda::trim_pool(as_pool(live_pool("trim")), min_keep_bytes);
}

}  // namespace vram
