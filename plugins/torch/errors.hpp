// errors.hpp: how the plug-in reports a failure: the latest explanation (read back through
// vram_torch_last_error), stderr, and the out-of-memory result of an allocation.
//
// Rules:
// - The entry points never let an exception out to their C caller, except the one an
//   out-of-memory raises in the allocator mode (out_of_memory()).
// - Each error is printed to stderr; an out-of-memory only the first time in the process
//   (the latest one stays readable through vram_torch_last_error).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace vram_torch {

// Keeps `message` as the latest error and prints it (an out-of-memory: once per process).
void note_error(std::string_view message, bool is_oom) noexcept;

// note_error() of the message `make()` returns. Building it may throw (no host memory
// left): then only a fixed line goes to stderr. For entry points, which must not throw.
void note_unexplained_error() noexcept;
template <typename Make>
void note_error_built(Make&& make, bool is_oom) noexcept {
  try {
    note_error(make(), is_oom);
  } catch (...) {
    note_unexplained_error();
  }
}

// `ptr` as a message shows it ("0x7f..."). Throws std::bad_alloc.
std::string pointer_text(const void* ptr);

// Copies the latest error into `buffer` (NUL-terminated, truncated to `size`); returns its
// full length, 0 when there was none.
std::size_t copy_last_error(char* buffer, std::size_t size);

// vram_torch_set_oom_throws: 1 when this build can throw (Torch found), else 0.
int set_oom_throws(int throws) noexcept;

// The result of an allocation that ran out of memory: throws c10::OutOfMemoryError, which
// PyTorch turns into torch.OutOfMemoryError, after set_oom_throws(1) in a build with Torch;
// else null, which PyTorch's caching allocator (MemPool form) and CuPy turn into their own
// out-of-memory errors.
void* out_of_memory(std::string_view message);

}  // namespace vram_torch
