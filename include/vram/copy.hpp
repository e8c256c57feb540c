// vram/copy.hpp: host-to-device copies that produce proof of their completion.
//
// A CopyCompleted witness says "the copy that read this host range has finished on the
// device". Only this layer can mint one, and only after the host has observed the
// completion: copy_to_device() returns it after synchronizing the copy's end event;
// copy_to_device_async() returns a PendingCopy whose wait() synchronizes that event and
// then hands the witness out. PinnedStagingPool takes a buffer back for reuse only with a
// witness that covers it, so reusing a staging buffer while a DMA still reads it cannot
// be written (tests/compile_fail/ proves it does not compile).
//
//   auto staging = pool.acquire(bytes);
//   std::memcpy(staging.data(), weights, bytes);
//   vram::PendingCopy copy = vram::copy_to_device_async(device_ptr, staging, stream);
//   ...                                    // overlap other work
//   staging.retire(std::move(copy).wait()); // back to the pool, provably after the copy
//
// Tests mint witnesses through vram/testing/witness.hpp (test-only).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <optional>

#include "vram/cuda/event.hpp"

namespace vram {

class PooledStaging;
class PendingCopy;
namespace testing {
struct WitnessMint;
}

// Move-only proof that a host-to-device copy reading [source, source + bytes) completed.
class CopyCompleted {
 public:
  CopyCompleted(CopyCompleted&& other) noexcept = default;
  CopyCompleted& operator=(CopyCompleted&& other) noexcept = default;
  CopyCompleted(const CopyCompleted&) = delete;
  CopyCompleted& operator=(const CopyCompleted&) = delete;

  const void* source() const noexcept { return source_; }
  std::size_t bytes() const noexcept { return bytes_; }
  // True when the copied range lies inside [begin, begin + size).
  bool covers_range_in(const void* begin, std::size_t size) const noexcept;

 private:
  friend class PendingCopy;  // the only production minter: PendingCopy::wait()
  friend struct testing::WitnessMint;
  CopyCompleted(const void* source, std::size_t bytes) noexcept : source_(source), bytes_(bytes) {}
  const void* source_;
  std::size_t bytes_;
};

struct CopyResult {
  CopyCompleted completed;
  float elapsed_ms;  // measured with CUDA events around the copy
};

// Queues the copy on `stream`, then blocks until it completed. Throws vram::CudaError.
CopyResult copy_to_device(void* device_destination, const void* host_source, std::size_t bytes,
                          cudaStream_t stream);
CopyResult copy_to_device(void* device_destination, const PooledStaging& source,
                          cudaStream_t stream);

// An enqueued copy. The witness comes only out of wait(), after the host saw the end
// event complete; ready() polls without blocking. Destroying an unwaited PendingCopy
// blocks until the copy ends (the source stays safe) and yields no witness.
class PendingCopy {
 public:
  PendingCopy(PendingCopy&&) noexcept = default;
  PendingCopy& operator=(PendingCopy&&) noexcept = default;
  PendingCopy(const PendingCopy&) = delete;
  PendingCopy& operator=(const PendingCopy&) = delete;
  ~PendingCopy();

  bool ready() const;
  [[nodiscard]] CopyCompleted wait() &&;
  // wait(), plus the copy's elapsed time from its CUDA events.
  [[nodiscard]] CopyResult wait_timed() &&;
  // Elapsed time of the copy in ms; valid after wait().
  float elapsed_ms() const;

 private:
  friend PendingCopy copy_to_device_async(void*, const void*, std::size_t, cudaStream_t);
  PendingCopy(const void* source, std::size_t bytes, cuda::Event start, cuda::Event end)
      : source_(source), bytes_(bytes), start_(std::move(start)), end_(std::move(end)) {}
  const void* source_;
  std::size_t bytes_;
  cuda::Event start_;
  cuda::Event end_;
  bool waited_ = false;
};

PendingCopy copy_to_device_async(void* device_destination, const void* host_source,
                                 std::size_t bytes, cudaStream_t stream);
PendingCopy copy_to_device_async(void* device_destination, const PooledStaging& source,
                                 cudaStream_t stream);

}  // namespace vram
