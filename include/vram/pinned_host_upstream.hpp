// vram/pinned_host_upstream.hpp: page-locked host memory, pinned the fast way.
//
// Two ways to pin:
//   host_alloc     cudaHostAlloc: the driver allocates, zero-fills and locks the pages in
//                  one call under a driver-wide lock.
//   touch_register mmap anonymous memory (transparent huge pages requested), fault the
//                  pages in on several threads, then cudaHostRegister the range (one
//                  registration, undone by deallocate()).
// automatic picks touch_register from `register_min_bytes` (64 KiB) upward, where it pins
// and unpins faster (bench/ measures both), and host_alloc below.
//
// A pin that fails (RLIMIT_MEMLOCK, a container memlock cap, no memory) throws
// vram::PinningError saying so and how to raise the limit; never a silent pageable
// fallback.
//
//   auto pinned = std::make_shared<vram::PinnedHostUpstream>();
//   void* staging = pinned->allocate(64 << 20);
#pragma once

#include <cstddef>
#include <string>

#include "vram/upstream.hpp"

namespace vram {

enum class PinningMethod { automatic, host_alloc, touch_register };

struct PinnedHostUpstreamOptions {
  PinningMethod method = PinningMethod::automatic;
  std::size_t register_min_bytes = std::size_t{64} << 10;
  unsigned touch_threads = 0;  // 0: min(hardware threads, 16)
};

class PinnedHostUpstream final : public Upstream {
 public:
  using Options = PinnedHostUpstreamOptions;
  PinnedHostUpstream() : PinnedHostUpstream(Options{}) {}
  explicit PinnedHostUpstream(Options options) : options_(options) {}

  void* allocate(std::size_t bytes) override;
  void deallocate(void* block, std::size_t bytes) noexcept override;
  MemoryKind kind() const noexcept override { return MemoryKind::pinned_host; }
  std::string_view name() const noexcept override { return "pinned host"; }
  std::size_t alignment() const noexcept override { return 4096; }

  PinningMethod method_for(std::size_t bytes) const noexcept;

 private:
  Options options_;
};

// Faults in every page of [data, data + bytes) with up to `threads` threads.
void touch_pages_in_parallel(void* data, std::size_t bytes, unsigned threads);
// The RLIMIT_MEMLOCK soft limit as text ("unlimited" or bytes) for error messages.
std::string memlock_limit_text();

}  // namespace vram
