#include "stream_key.hpp"

#include <atomic>

namespace vram::detail {

StreamKey per_thread_stream_key() noexcept {
  static std::atomic<StreamKey> next{1};
  thread_local const StreamKey key = kPerThreadKey | next.fetch_add(1, std::memory_order_relaxed);
  return key;
}

}  // namespace vram::detail
