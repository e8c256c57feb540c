// vram/stream_ordered_pool.hpp: the driver's stream-ordered allocator, bound and configured.
//
// By default creates a private CUDA memory pool (cuMemPoolCreate) that this object owns and
// destroys, and drives it with cuMemAllocFromPoolAsync / cuMemFreeAsync. Nothing outside
// the object changes. The device's default pool, shared with every cudaMallocAsync user
// in the process (PyTorch included), is an explicit option (.use_default_pool = true); on
// it the object changes nothing unless asked (.release_threshold set, or a call of
// set_release_threshold / reset_pool_high_water / trim), and at destruction it restores the
// release threshold it found, unless another user changed the threshold after it (then it
// leaves theirs alone). With several objects setting the default pool's threshold, the
// value left at the end is not always the original one: restore is per object, not a
// process-wide stack.
//
//   vram::StreamOrderedPool pool({.device = 0});     // private pool, retains freed memory
//   void* p = pool.allocate_async(1 << 20, stream);
//   kernel<<<..., stream>>>(p);
//   pool.deallocate_async(p, 1 << 20, stream);       // reusable by later work on `stream`
//   pool.trim(0);                                    // hand the reservation back
//
// When a freed block may be handed out again (the driver's rule, which we keep)
//   A block freed with deallocate_async(p, n, s) may back any later allocation on stream s
//   at once (stream order makes it safe). Another stream t gets it only after t waits for
//   an event recorded on s after the free; hand_over(s, t) records and waits for you.
//   A block used on several streams must be freed on a stream that has waited for all of
//   them (hand_over each to the freeing stream first).
//
// Figures
//   bytes_in_use(): bytes allocated through THIS object and not yet freed through it (an
//   atomic counter; deallocation takes the size, as in cuda::mr). The pool_* figures are
//   the driver's, pool-wide: on the default pool they include every other user's blocks,
//   and reset_pool_high_water() / trim() / set_release_threshold() act for all of them.
//
// Bad input: zero bytes -> vram::InvalidArgument (zero-sized buffers are null sentinels);
// null free -> no-op; driver out of memory -> vram::OutOfMemory; a null pointer returned
// with success -> vram::CudaError; ipc_shareable with the default pool, a device below -1
// or not present -> vram::InvalidArgument. The object records every block it hands out
// (a sharded map): a
// release of a pointer it did not hand out (another pool's, cudaMalloc's) or already took back, or
// under another size than allocated, is refused before the driver sees it, reported on stderr and
// counted in invalid_releases() (a wrong-size block stays allocated: release it with its size). A
// moved-from object throws vram::InvalidArgument from every call that needs the pool and ignores
// releases. After cudaDeviceReset() or driver shutdown, calls throw vram::CudaError and
// deallocation/destruction quietly do nothing.
#pragma once

#include <cuda_runtime_api.h>
#include <cuda/memory_resource>
#include <cuda/stream_ref>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>

#include <memory>

namespace vram {
namespace detail {
class BlockRegistry;
}

struct StreamOrderedPoolOptions {
  int device = -1;                // -1: the current device
  bool use_default_pool = false;  // the device's default pool (shared) instead of a private one
  bool ipc_shareable = false;     // private pool: POSIX file-descriptor handles for IPC
  // Unset: a private pool retains all freed memory (kRetainAll); the default pool's
  // threshold is left as it is. Set: applied (on the default pool, restored at destruction).
  std::optional<std::uint64_t> release_threshold = std::nullopt;
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
  // `bytes` must be the size the block was allocated with. Never throws. Shutdown errors
  // are ignored; any other failure is reported on stderr and counted in failed_frees().
  void deallocate_async(void* block, std::size_t bytes, cudaStream_t stream) noexcept;

  // CCCL cuda::mr::async_resource forms (alignment up to 256).
  [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment,
                                     ::cuda::stream_ref stream);
  void deallocate_async(void* block, std::size_t bytes, std::size_t alignment,
                        ::cuda::stream_ref stream) noexcept;
  // Synchronous forms: allocate/free on the per-thread default stream and synchronize it.
  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment = 256);
  void deallocate(void* block, std::size_t bytes, std::size_t alignment = 256) noexcept;

  // Makes `to` wait (without blocking the host) for everything queued on `from` so far:
  // a vram::cuda::Event recorded on `from`, waited on the device (see completion.hpp).
  static void hand_over(cudaStream_t from, cudaStream_t to);

  // This object's own bytes in use (allocated through it, not yet freed through it).
  std::size_t bytes_in_use() const noexcept {
    return bytes_in_use_.load(std::memory_order_relaxed);
  }

  // Pool-wide (every user of the pool; see "Figures").
  void set_release_threshold(std::uint64_t bytes);
  std::uint64_t release_threshold() const;
  std::size_t pool_reserved_bytes() const;
  std::size_t pool_used_bytes() const;
  std::size_t pool_reserved_high_water() const;
  std::size_t pool_used_high_water() const;
  void reset_pool_high_water();
  void trim(std::size_t min_keep_bytes);

  int device() const noexcept { return device_; }
  bool is_private() const noexcept { return owned_; }
  void* native_handle() const noexcept { return pool_; }  // CUmemoryPool
  std::uint64_t failed_frees() const noexcept {
    return failed_frees_.load(std::memory_order_relaxed);
  }
  // Releases refused: unknown pointer, already released, or a size other than allocated.
  std::uint64_t invalid_releases() const noexcept {
    return invalid_releases_.load(std::memory_order_relaxed);
  }

  // Equal only to itself (cuda::mr: equal resources free each other's memory, and a block
  // goes back through the object that recorded it), even when two objects drive the
  // device's default pool. Two moved-from objects compare equal: neither holds anything.
  bool operator==(const StreamOrderedPool& other) const noexcept {
    return blocks_ == other.blocks_;
  }
  friend void get_property(const StreamOrderedPool&, ::cuda::mr::device_accessible) noexcept {}

 private:
  std::uint64_t get_attribute(int attribute, const char* label) const;
  void set_attribute(int attribute, std::uint64_t value, const char* label);
  void destroy() noexcept;
  void* live_pool(const char* call) const;  // pool_, or InvalidArgument when moved from
  // Makes the pool's device context current on this thread; false if it cannot.
  bool bind_context() const noexcept;

  void* pool_ = nullptr;     // CUmemoryPool
  void* context_ = nullptr;  // CUcontext: the device's primary context
  int device_ = 0;
  bool owned_ = false;
  // Default pool only: the release threshold found before this object first changed it.
  std::optional<std::uint64_t> restore_threshold_;
  std::uint64_t threshold_set_ = 0;  // the last threshold this object set
  std::atomic<std::size_t> bytes_in_use_{0};
  std::atomic<std::uint64_t> failed_frees_{0};
  std::atomic<std::uint64_t> invalid_releases_{0};
  std::unique_ptr<detail::BlockRegistry> blocks_;  // null only when moved from
};

}  // namespace vram

// The cuda::mr contracts of StreamOrderedPool (the toolkit's CCCL).
static_assert(::cuda::mr::resource<vram::StreamOrderedPool>);
static_assert(::cuda::mr::async_resource<vram::StreamOrderedPool>);
static_assert(
    ::cuda::mr::async_resource_with<vram::StreamOrderedPool, ::cuda::mr::device_accessible>);
