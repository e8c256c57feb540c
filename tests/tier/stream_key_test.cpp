// The per-thread stream key (src/tier/stream_key.hpp, cudaStreamPerThread): each comment
// states the rule its test holds.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test_policy.hpp"
#include "test_upstreams.hpp"
#include "tier/segment_tier.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/device_pool.hpp"
#include "vram/stream_fence.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;

// A fence that remembers the stream each marker was recorded on; markers complete only
// when waited for (as ManualFence).
class RecordingFence final : public StreamFence {
 public:
  std::uint64_t record(cudaStream_t stream) override {
    std::lock_guard lock(mutex_);
    streams_.push_back(stream);
    return streams_.size();
  }
  bool completed(std::uint64_t marker) noexcept override {
    std::lock_guard lock(mutex_);
    return marker <= completed_;
  }
  void wait(std::uint64_t marker) noexcept override {
    std::lock_guard lock(mutex_);
    if (marker > completed_) completed_ = marker;
  }
  void release(std::uint64_t) noexcept override {}
  void quiesce() noexcept override {
    std::lock_guard lock(mutex_);
    completed_ = streams_.size();
  }
  std::vector<cudaStream_t> streams() const {
    std::lock_guard lock(mutex_);
    return streams_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<cudaStream_t> streams_;
  std::uint64_t completed_ = 0;
};

// Checked, passes: the key of cudaStreamPerThread is per thread, stable within a thread,
// never kUntagged nor a real handle's key, and its fence stream is the legacy stream; a
// real handle's fence stream is the handle itself.
TEST(PerThreadStreamKey, PerThreadKeysAreDistinctStableAndFenceOnTheLegacyStream) {
  const detail::StreamKey mine = detail::stream_key(cudaStreamPerThread);
  EXPECT_EQ(mine, detail::stream_key(cudaStreamPerThread));
  EXPECT_NE(mine, detail::kUntagged);
  EXPECT_NE(mine, detail::stream_key(nullptr));
  EXPECT_NE(mine, detail::stream_key(cudaStreamLegacy));
  detail::StreamKey other = 0;
  std::thread([&] { other = detail::stream_key(cudaStreamPerThread); }).join();
  EXPECT_NE(mine, other);
  EXPECT_EQ(detail::fence_stream_of(mine), cudaStreamLegacy);
  EXPECT_EQ(detail::fence_stream_of(other), cudaStreamLegacy);
  const auto fake = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x7f00'1234'5600});
  EXPECT_EQ(detail::fence_stream_of(detail::stream_key(fake)), fake);
  EXPECT_EQ(detail::fence_stream_of(detail::stream_key(nullptr)), nullptr);
}

// Checked, passes: through a whole DevicePool, the fence for blocks freed on one thread's
// cudaStreamPerThread is recorded on cudaStreamLegacy, never on cudaStreamPerThread (which
// in the fencing thread would name that thread's own stream), large and small tier.
TEST(PerThreadStreamKey, PoolFencesPerThreadFreesOnTheLegacyStream) {
  for (const std::size_t bytes : {std::size_t{4096}, std::size_t{4_MiB}}) {
    SCOPED_TRACE(bytes);
    auto fence = std::make_shared<RecordingFence>();
    DevicePool::Options options;
    options.validate_deallocations = true;
    options.thread_cache.blocks = 0;
    options.fence = fence;
    DevicePool pool(std::make_shared<HostMemoryUpstream>(), options);
    void* keep = pool.allocate(bytes);
    void* freed = nullptr;
    std::thread([&] {
      freed = pool.allocate_async(bytes, cudaStreamPerThread);
      pool.deallocate_async(freed, bytes, cudaStreamPerThread);
    }).join();
    void* got = nullptr;
    std::thread([&] { got = pool.allocate_async(bytes, cudaStreamPerThread); }).join();
    const auto streams = fence->streams();
    for (cudaStream_t s : streams) {
      EXPECT_EQ(s, cudaStreamLegacy) << "fence recorded on " << s;
    }
    if (got == freed) {
      EXPECT_FALSE(streams.empty()) << "A's block went to B's stream with no fence at all";
    }
    pool.deallocate_async(got, bytes, cudaStreamPerThread);
    pool.deallocate(keep, bytes);
    pool.trim(0);
  }
}

}  // namespace
}  // namespace vram::testing
