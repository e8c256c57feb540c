#include "errors.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>

#ifdef VRAM_TORCH_WITH_C10
// The allocator mode (vram_torch.enable()) needs an exception: PyTorch's
// CUDAPluggableAllocator wraps a null pointer into a tensor instead of raising.
#include <c10/util/Exception.h>
#endif

namespace vram_torch {

namespace {

std::mutex g_error_mutex;
// Under g_error_mutex. Made on first use (a static initialiser of another file may note an
// error first) and never destroyed: a free during the process's exit (a daemon thread, a
// tensor of a static) may still note one after static destructors ran.
std::string& last_error_text() {
  static std::string* const text = new std::string;
  return *text;
}
std::atomic<bool> g_oom_printed{false};
// 1 after vram_torch_set_oom_throws(1) (vram_torch.enable()): PyTorch calls the allocator
// directly and needs an exception; 0 (MemPool form, CuPy): null.
[[maybe_unused]] std::atomic<int> g_oom_throws{0};

}  // namespace

void note_error(std::string_view message, bool is_oom) noexcept {
  try {
    {
      std::lock_guard<std::mutex> lock(g_error_mutex);
      last_error_text().assign(message);
    }
    if (!is_oom) {
      std::fprintf(stderr, "vram_torch: %.*s\n", static_cast<int>(message.size()), message.data());
      return;
    }
    if (!g_oom_printed.exchange(true)) {
      std::fprintf(stderr,
                   "vram_torch: out of device memory; PyTorch will raise its error.\n"
                   "  vram: %.*s\n"
                   "  (printed once per process; vram_torch.last_error() has the latest)\n",
                   static_cast<int>(message.size()), message.data());
    }
  } catch (...) {
  }
}

void note_unexplained_error() noexcept {
  std::fputs("vram_torch: an error, with no host memory left to explain it\n", stderr);
}

std::string pointer_text(const void* ptr) {
  char text[2 + 2 * sizeof(void*) + 1];
  std::snprintf(text, sizeof text, "%p", ptr);
  return text;
}

std::size_t copy_last_error(char* buffer, std::size_t size) {
  std::lock_guard<std::mutex> lock(g_error_mutex);
  if (buffer != nullptr && size > 0) {
    const std::size_t n = std::min(size - 1, last_error_text().size());
    std::memcpy(buffer, last_error_text().data(), n);
    buffer[n] = '\0';
  }
  return last_error_text().size();
}

int set_oom_throws(int throws) noexcept {
#ifdef VRAM_TORCH_WITH_C10
  g_oom_throws.store(throws != 0 ? 1 : 0, std::memory_order_relaxed);
  return 1;
#else
  (void)throws;
  return 0;  // built without Torch: out of memory is always a null pointer
#endif
}

void* out_of_memory(std::string_view message) {
#ifdef VRAM_TORCH_WITH_C10
  if (g_oom_throws.load(std::memory_order_relaxed) != 0) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory (vram): ", message);
  }
#endif
  (void)message;
  return nullptr;
}

}  // namespace vram_torch
