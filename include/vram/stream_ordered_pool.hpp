// vram/stream_ordered_pool.hpp: the driver's stream-ordered allocator, bound and configured.
//
// Binds the device's default CUDA memory pool (owned by the context: nothing to destroy)
// or, on request, a private pool it creates and destroys, and drives it with
// cuMemAllocFromPoolAsync / cuMemFreeAsync. The release threshold is set at construction
// so freed memory stays reserved across stream syncs (default: retain everything).
//
//   vram::StreamOrderedPool pool({.device = 0});
//   void* p = pool.allocate_async(1 << 20, stream);
//   kernel<<<..., stream>>>(p);
//   pool.deallocate_async(p, stream);          // reusable by later work on `stream`
//   pool.trim(0);                              // hand the reservation back
//
// When a freed block may be handed out again (the driver's rule, which we keep)
//   A block freed with deallocate_async(p, s) may back any later allocation on stream s
//   at once (stream order makes it safe). Another stream t gets it only after t waits for
//   an event recorded on s after the free; hand_over(s, t) records and waits for you.
//   A block used on several streams must be freed on a stream that has waited for all of
//   them (hand_over each to the freeing stream first).
//
// Bad input: zero bytes -> vram::InvalidArgument (zero-sized buffers are null sentinels);
// null free -> no-op; driver out of memory -> vram::OutOfMemory; a null pointer returned
// with success -> vram::CudaError. After cudaDeviceReset() or driver shutdown, calls throw
// vram::CudaError and deallocation/destruction quietly do nothing.
#pragma once

#include <cuda_runtime_api.h>
#include <cuda/memory_resource>
#include <cuda/stream_ref>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace vram {

struct StreamOrderedPoolOptions {
  int device = -1;             // -1: the current device
  bool private_pool = false;   // cuMemPoolCreate instead of the device's default pool
  bool ipc_shareable = false;  // private pool: POSIX file-descriptor handles for IPC
  std::uint64_t release_threshold = UINT64_MAX;  // retain all freed memory
};

class StreamOrderedPool {
 public:
  static constexpr std::uint64_t kRetainAll = UINT64_MAX;

  using Options = StreamOrderedPoolOptions;

  explicit StreamOrderedPool(Options options);
  StreamOrderedPool() : StreamOrderedPool(Options{}) {}
  ~StreamOrderedPool();
  StreamOrderedPool(StreamOrderedPool&& other) noexcept;
  StreamOrderedPool& operator=(StreamOrderedPool&& other) noexcept;
  StreamOrderedPool(const StreamOrderedPool&) = delete;
  StreamOrderedPool& operator=(const StreamOrderedPool&) = delete;

  [[nodiscard]] void* allocate_async(std::size_t bytes, cudaStream_t stream);
  // Never throws. Shutdown errors are ignored; any other failure is reported on stderr
  // and counted in failed_frees().
  void deallocate_async(void* block, cudaStream_t stream) noexcept;

  // CCCL cuda::mr::async_resource forms (alignment up to 256).
  [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment,
                                     ::cuda::stream_ref stream);
  void deallocate_async(void* block, std::size_t bytes, std::size_t alignment,
                        ::cuda::stream_ref stream) noexcept;
  // Synchronous forms: allocate/free on the per-thread default stream and synchronize it.
  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment = 256);
  void deallocate(void* block, std::size_t bytes, std::size_t alignment = 256) noexcept;

  // Makes `to` wait (without blocking the host) for everything queued on `from` so far.
  static void hand_over(cudaStream_t from, cudaStream_t to);

  void set_release_threshold(std::uint64_t bytes);
  std::uint64_t release_threshold() const;
  std::size_t reserved_bytes() const;
  std::size_t used_bytes() const;
  std::size_t reserved_high_water() const;
  std::size_t used_high_water() const;
  void reset_high_water();
  void trim(std::size_t min_keep_bytes);

  int device() const noexcept { return device_; }
  bool is_private() const noexcept { return owned_; }
  void* native_handle() const noexcept { return pool_; }  // CUmemoryPool
  std::uint64_t failed_frees() const noexcept {
    return failed_frees_.load(std::memory_order_relaxed);
  }

  bool operator==(const StreamOrderedPool& other) const noexcept { return pool_ == other.pool_; }
  friend void get_property(const StreamOrderedPool&, ::cuda::mr::device_accessible) noexcept {}

 private:
  std::uint64_t get_attribute(int attribute, const char* label) const;
  void set_attribute(int attribute, std::uint64_t value, const char* label);
  void destroy() noexcept;
  // Makes the pool's device context current on this thread; false if it cannot.
  bool bind_context() const noexcept;

  void* pool_ = nullptr;     // CUmemoryPool
  void* context_ = nullptr;  // CUcontext: the device's primary context
  int device_ = 0;
  bool owned_ = false;
  std::atomic<std::uint64_t> failed_frees_{0};
};

}  // namespace vram
