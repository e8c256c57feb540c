// src/device_pool/sleep_copier.hpp: the copies of one sleep or wake, and the proof that the
// host observed their end.
//
// Rule: a tag's physical memory is unmapped (sleep) and its backup counted reusable (wake)
// only with a CopiesCompleted of the copier that queued the copies: the witness comes only
// out of wait(), after the host observed an event recorded behind the copier's last copy
// (at seal(), or at wait() when not sealed; over host memory, after the last memcpy
// returned). Copies queued later on the same stream by another copier are not waited for.
// A witness names its batch and is minted once per copier; check() accepts only the
// copier's own (not one of another copier or an earlier cycle, not a moved-from one), so a
// witness can be neither forged nor reused.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <utility>

#include "vram/cuda/event.hpp"
#include "vram/cuda/stream.hpp"

namespace vram::detail {

class SleepCopier;

class CopiesCompleted {
 public:
  CopiesCompleted(CopiesCompleted&& other) noexcept : batch_(std::exchange(other.batch_, 0)) {}
  CopiesCompleted& operator=(CopiesCompleted&& other) noexcept {
    batch_ = std::exchange(other.batch_, 0);
    return *this;
  }
  CopiesCompleted(const CopiesCompleted&) = delete;
  CopiesCompleted& operator=(const CopiesCompleted&) = delete;
  ~CopiesCompleted() {}  // NOLINT(modernize-use-equals-default): not trivially copyable
  std::uint64_t batch() const noexcept { return batch_; }

 private:
  friend class SleepCopier;
  explicit CopiesCompleted(std::uint64_t batch) noexcept : batch_(batch) {}
  std::uint64_t batch_ = 0;
};

// One batch of copies between a tag's device memory and its host backup.
class SleepCopier {
 public:
  // Over the host emulation: memcpy, no stream. Over a device: copies queued on `stream`;
  // null: the device is synchronized here and `own_stream` (the pool's, made on first use)
  // carries them.
  static std::unique_ptr<SleepCopier> for_host();
  static std::unique_ptr<SleepCopier> for_device(int device, cudaStream_t stream,
                                                 std::optional<cuda::Stream>& own_stream);
  virtual ~SleepCopier() = default;
  SleepCopier(const SleepCopier&) = delete;
  SleepCopier& operator=(const SleepCopier&) = delete;

  std::uint64_t batch() const noexcept { return batch_; }
  // The stream the copies are queued on (null over the host emulation): a copier made for
  // it queues its copies behind these.
  virtual cudaStream_t stream() const noexcept = 0;
  // Queue one copy; throw vram::CudaError, std::logic_error after seal().
  void to_host(void* host, const void* device, std::size_t bytes) {
    refuse_if_sealed();
    queue_to_host(host, device, bytes);
  }
  void to_device(void* device, const void* host, std::size_t bytes) {
    refuse_if_sealed();
    queue_to_device(device, host, bytes);
  }
  // The batch is complete: wait() proves the copies queued so far and no later one. Throws
  // vram::CudaError (not sealed then; seal may be called again).
  void seal() {
    if (sealed_) return;
    mark_end();
    sealed_ = true;
  }
  // Seals the batch and blocks until its copies (and the work queued before them) completed.
  // Throws vram::CudaError when that cannot be observed (nothing is then proven; wait may be
  // called again). One witness per copier: a second wait after one succeeded throws
  // std::logic_error.
  CopiesCompleted wait() {
    if (witnessed_) {
      throw std::logic_error(
          "vram sleep copier: wait() called again after its copies were proven complete "
          "(one witness per batch)");
    }
    seal();
    wait_for_copies();
    witnessed_ = true;
    return CopiesCompleted(batch_);
  }
  // Throws std::logic_error unless `proof` is this copier's witness (a moved-from one names
  // no batch); nothing changes either way.
  void check(const CopiesCompleted& proof) const {
    if (proof.batch() == 0 || proof.batch() != batch_) {
      throw std::logic_error(
          "vram sleep copier: the witness does not prove this batch's copies (another "
          "copier's, an earlier cycle's, or moved from)");
    }
  }

 protected:
  SleepCopier();
  virtual void queue_to_host(void* host, const void* device, std::size_t bytes) = 0;
  virtual void queue_to_device(void* device, const void* host, std::size_t bytes) = 0;
  virtual void mark_end() = 0;         // behind the copies queued so far
  virtual void wait_for_copies() = 0;  // until the end marked

 private:
  void refuse_if_sealed() const {
    if (sealed_) {
      throw std::logic_error(
          "vram sleep copier: a copy queued after seal() (its batch's end is recorded)");
    }
  }
  std::uint64_t batch_;
  bool sealed_ = false;
  bool witnessed_ = false;
};

}  // namespace vram::detail
