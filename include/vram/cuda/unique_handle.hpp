// vram/cuda/unique_handle.hpp: the move-only ownership of one CUDA handle (stream, event),
// destroyed by `Destroy` when the owner goes. Destroy must tolerate a shut-down runtime.
#pragma once

#include <utility>

namespace vram::cuda::detail {

template <class Handle, void (*Destroy)(Handle) noexcept>
class UniqueHandle {
 public:
  UniqueHandle() = default;
  explicit UniqueHandle(Handle handle) noexcept : handle_(handle) {}
  UniqueHandle(UniqueHandle&& other) noexcept : handle_(std::exchange(other.handle_, Handle{})) {}
  UniqueHandle& operator=(UniqueHandle&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, Handle{});
    }
    return *this;
  }
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;
  ~UniqueHandle() { reset(); }

  Handle get() const noexcept { return handle_; }
  void reset() noexcept {
    if (handle_ != Handle{}) Destroy(handle_);
    handle_ = Handle{};
  }

 private:
  Handle handle_{};
};

}  // namespace vram::cuda::detail
