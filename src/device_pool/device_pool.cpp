// DevicePool, the public handle: a shared pointer to its DevicePoolCore (pool_core.hpp),
// so that a pool destroyed with blocks still leased keeps its bookkeeping alive for them.
#include "vram/device_pool.hpp"

#include <cstdio>
#include <string>
#include <utility>

#include "platform/observed_memory.hpp"
#include "pool_core.hpp"
#include "pool_options.hpp"
#include "vram/cuda/error.hpp"

namespace vram {

DevicePool::Lease::Lease(Lease&& other) noexcept
    : core_(std::exchange(other.core_, nullptr)),
      block_(std::exchange(other.block_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

DevicePool::Lease& DevicePool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    reset();
    core_ = std::exchange(other.core_, nullptr);
    block_ = std::exchange(other.block_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DevicePool::Lease::reset() noexcept {
  if (block_ != nullptr) core_->deallocate_unstreamed(block_, bytes_);
  core_ = nullptr;
  block_ = nullptr;
  bytes_ = 0;
}

void* DevicePool::Lease::release() noexcept {
  core_ = nullptr;
  bytes_ = 0;
  return std::exchange(block_, nullptr);
}

DevicePool::DevicePool(int device, Options options)
    : DevicePool(std::make_shared<DeviceMemoryUpstream>(device), options) {}

DevicePool::DevicePool(std::shared_ptr<Upstream> upstream, Options options)
    : core_(std::make_shared<detail::DevicePoolCore>(
          detail::observed_upstream(std::move(upstream), options), options)) {}

DevicePool& DevicePool::operator=(DevicePool&& other) noexcept {
  if (this != &other) {
    DevicePool dying(std::move(*this));
    core_ = std::move(other.core_);
  }
  return *this;
}

DevicePool::~DevicePool() {
  if (!core_) return;
  core_->sleep_tags.close();  // sleeping tags drop their backup
  // Graph pools never released: their free blocks go back with the rest; their live ones
  // stay leased (the bookkeeping outlives the pool for them, as for any lease).
  try {
    core_->graph_pools.close();
  } catch (...) {  // out of host memory: those blocks count as still leased below
  }
  core_->drain_graph_returns();
  std::uint64_t blocks = 0;
  std::uint64_t bytes = 0;
  const bool scope_open = core_->graph_routing.any();
  if (core_->close(blocks, bytes)) {
    std::fprintf(stderr,
                 "vram::DevicePool destroyed with %llu block(s), %llu bytes, still leased%s; the "
                 "pool's bookkeeping stays alive until they are deallocated, and each then goes "
                 "straight back to the upstream.\n",
                 static_cast<unsigned long long>(blocks), static_cast<unsigned long long>(bytes),
                 scope_open ? " or held by graph pools until the open capture scope ends" : "");
  }
  core_.reset();
}

namespace {
[[noreturn, gnu::cold, gnu::noinline]] void throw_moved_from(const char* call) {
  throw InvalidArgument(std::string("vram::DevicePool::") + call +
                        ": the pool was moved from. Fix: use the DevicePool it was moved to.");
}
}  // namespace

// A moved-from pool has no core: calls that hand out memory throw, the others do nothing
// (see the header's "Bad input"). The check is one test of a pointer the call loads anyway;
// the throw is out of line, so that the check stays inline in the warm paths.
detail::DevicePoolCore& DevicePool::live_core(const char* call) const {
  if (!core_) [[unlikely]]
    throw_moved_from(call);
  return *core_;
}

// Each call tests kGraphsOn first (graph_routing.hpp): while no graph pool or sleep tag exists
// and no capture scope is open, one load from the cache line the warm path reads anyway.
void* DevicePool::allocate(std::size_t bytes, std::size_t alignment) {
  detail::DevicePoolCore& core = live_core("allocate");
  if (core.graphs_active()) [[unlikely]]
    return core.allocate_with_graphs(bytes, alignment, detail::kUntagged, nullptr);
  return core.allocate(bytes, alignment, detail::kUntagged);
}

void DevicePool::deallocate(void* block, std::size_t bytes, std::size_t /*alignment*/) noexcept {
  if (core_) [[likely]]
    core_->deallocate_unstreamed(block, bytes);
}

DevicePool::Lease DevicePool::acquire(std::size_t bytes) {
  detail::DevicePoolCore& core = live_core("acquire");
  void* block = core.graphs_active() ? core.allocate_with_graphs(bytes, kDefaultAlignment,
                                                                 detail::kUntagged, nullptr)
                                     : core.allocate(bytes, kDefaultAlignment, detail::kUntagged);
  return Lease(core_.get(), block, bytes);
}

namespace {
// The stream-ordered calls when stream_checks_needed(), in this order: the marker another
// stream's request wants on `stream` (this call proves it alive, stream_wants.hpp), the
// graph pools, then one driver query (no GPU work): a block a capture without a scope
// touches must stay that graph's (device_pool.hpp, "CUDA graphs"). Out of line, so that the
// warm path keeps no registers for them.
[[gnu::noinline]] void* allocate_async_checked(detail::DevicePoolCore& core, std::size_t bytes,
                                               detail::StreamKey key, cudaStream_t stream) {
  core.serve_want_of(key);
  if (core.graphs_active())
    return core.allocate_with_graphs(bytes, DevicePool::kDefaultAlignment, key, stream);
  if (const std::uint64_t capture = core.capture_of(stream); capture != 0) [[unlikely]]
    return core.allocate_captured(bytes, DevicePool::kDefaultAlignment,
                                  core.unscoped_pool_of(capture));
  return core.allocate(bytes, DevicePool::kDefaultAlignment, key);
}

[[gnu::noinline]] void deallocate_async_checked(detail::DevicePoolCore& core, void* block,
                                                std::size_t bytes, detail::StreamKey key,
                                                cudaStream_t stream) noexcept {
  core.serve_want_of(key);
  if (core.graphs_active()) return core.deallocate_with_graphs(block, bytes, key, stream);
  if (const std::uint64_t capture = core.capture_of(stream); capture != 0) [[unlikely]]
    return core.deallocate_captured(block, bytes, core.unscoped_pool_of(capture));
  core.deallocate(block, bytes, key);
}
}  // namespace

void* DevicePool::allocate_async(std::size_t bytes, cudaStream_t stream) {
  detail::DevicePoolCore& core = live_core("allocate_async");
  const detail::StreamKey key = detail::stream_key(stream);
  if (core.stream_checks_needed()) [[unlikely]]
    return allocate_async_checked(core, bytes, key, stream);
  return core.allocate(bytes, kDefaultAlignment, key);
}

void DevicePool::deallocate_async(void* block, std::size_t bytes, cudaStream_t stream) noexcept {
  if (core_) [[likely]] {
    const detail::StreamKey key = detail::stream_key(stream);
    if (core_->stream_checks_needed()) [[unlikely]]
      return deallocate_async_checked(*core_, block, bytes, key, stream);
    core_->deallocate(block, bytes, key);
  }
}

bool DevicePool::uses_virtual_memory() const noexcept {
  return core_ && core_->virtual_memory != nullptr;
}

std::size_t DevicePool::block_bytes(std::size_t bytes) const noexcept {
  return core_ ? core_->block_bytes(bytes) : 0;
}

void DevicePool::trim(std::size_t keep_bytes) {
  if (!core_) return;
  core_->drain_graph_returns();
  core_->trim(keep_bytes, nullptr, true);
  core_->sleep_tags.trim();
  // The growth budget restarts from what is in use now: a caller that trims wants the
  // memory held to follow today's use, not the all-time peak.
  core_->small.restart_peak();
  core_->large.restart_peak();
}

DevicePoolStats DevicePool::stats() const { return core_ ? core_->stats() : DevicePoolStats{}; }

std::vector<DevicePoolSegment> DevicePool::memory_map() const {
  std::vector<DevicePoolSegment> segments;
  if (!core_) return segments;
  core_->small.describe(false, segments);
  core_->large.describe(true, segments);
  return segments;
}

void DevicePool::reset_peak() noexcept {
  if (!core_) return;
  core_->gauge.restart_peaks();
  core_->in_use.reset();
}

namespace {
// What a moved-from pool's options() and upstream() refer to: defaults, and an upstream
// that hands out nothing.
class MovedFromUpstream final : public Upstream {
 public:
  void* allocate(std::size_t) override {
    throw InvalidArgument(
        "vram::DevicePool::upstream: the pool was moved from. Fix: use the DevicePool it was "
        "moved to.");
  }
  void deallocate(void*, std::size_t) noexcept override {}
  MemoryKind kind() const noexcept override { return MemoryKind::device; }
  std::string_view name() const noexcept override { return "none (moved-from DevicePool)"; }
};
}  // namespace

const DevicePool::Options& DevicePool::options() const noexcept {
  static const Options defaults{};
  return core_ ? core_->options : defaults;
}

Upstream& DevicePool::upstream() const noexcept {
  static MovedFromUpstream none;
  // The upstream given, also when an observer wraps it (pool_options.hpp).
  return core_ ? detail::underlying(*core_->upstream) : none;
}

}  // namespace vram
