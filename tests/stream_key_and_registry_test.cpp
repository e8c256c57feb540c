// The per-thread stream key (cudaStreamPerThread), the block registry of StreamOrderedPool,
// the pager plan's overflow message and the default pool's equality: each comment states
// the rule its test holds.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test_policy.hpp"
#include "stream_ordered_pool/block_registry.hpp"
#include "test_upstreams.hpp"
#include "tier/segment_tier.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/detail/pointer_map.hpp"
#include "vram/device_pool.hpp"
#include "vram/pager_plan.hpp"
#include "vram/stream_fence.hpp"
#include "vram/stream_ordered_pool.hpp"
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
    options.validate_releases = true;
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

// Checked, passes: PointerMap (sizes encoded as pointers in BlockRegistry) against a
// reference map under random insert/erase with clustered, aligned keys (long probe runs
// and wrap-around exercise the backward-shift deletion).
TEST(BlockRegistry, PointerMapMatchesAReferenceMap) {
  detail::PointerMap<std::byte> map;
  std::map<std::uintptr_t, std::uintptr_t> reference;
  std::mt19937_64 rng(9);
  for (int step = 0; step < 200000; ++step) {
    const std::uintptr_t key = (1 + rng() % 512) << 8;
    const auto* k = reinterpret_cast<const void*>(key);
    if (rng() % 3 != 0) {
      if (reference.count(key) == 0) {
        const std::uintptr_t value = 1 + rng() % 100000;
        map.reserve_one();
        map.insert(k, reinterpret_cast<std::byte*>(value));
        reference[key] = value;
      }
    } else {
      const auto* erased = map.erase(k);
      const auto it = reference.find(key);
      ASSERT_EQ(reinterpret_cast<std::uintptr_t>(erased), it == reference.end() ? 0 : it->second);
      if (it != reference.end()) reference.erase(it);
    }
    if (step % 997 == 0) {
      ASSERT_EQ(map.size(), reference.size());
      for (const auto& [key2, value] : reference) {
        ASSERT_EQ(reinterpret_cast<std::uintptr_t>(map.find(reinterpret_cast<const void*>(key2))),
                  value);
      }
    }
  }
}

// Checked, passes: racing releases of one block: exactly one takes it; wrong size leaves
// it recorded; sizes of any magnitude round-trip.
TEST(BlockRegistry, RacingTakesOfOneBlockTakeItOnce) {
  detail::BlockRegistry registry;
  std::size_t recorded = 0;
  registry.add(reinterpret_cast<void*>(0x100000), SIZE_MAX);
  EXPECT_EQ(registry.take(reinterpret_cast<void*>(0x100000), 1, recorded),
            detail::BlockRegistry::Release::wrong_size);
  EXPECT_EQ(recorded, SIZE_MAX);
  EXPECT_EQ(registry.take(reinterpret_cast<void*>(0x100000), SIZE_MAX, recorded),
            detail::BlockRegistry::Release::taken);
  for (int round = 0; round < 200; ++round) {
    std::vector<void*> blocks;
    for (std::uintptr_t i = 1; i <= 64; ++i) {
      blocks.push_back(reinterpret_cast<void*>(i << 12 | std::uintptr_t(round) << 24));
      registry.add(blocks.back(), 4096);
    }
    std::atomic<int> taken{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        for (void* b : blocks) {
          std::size_t r = 0;
          if (registry.take(b, 4096, r) == detail::BlockRegistry::Release::taken) ++taken;
        }
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_EQ(taken.load(), 64);
    ASSERT_EQ(registry.size(), 0U);
  }
}

// A layer whose rounding to the arena alignment overflows is refused, and the message
// never prints the wrapped rounded size ("18446744073709551605 bytes, 0 at the arena's
// 256-byte alignment").
TEST(PagerPlanMessages, OverflowingAlignmentMessageDoesNotPrintAWrappedSize) {
  try {
    (void)plan_residency({SIZE_MAX - 10}, {}, {.budget_bytes = SIZE_MAX, .alignment = 256});
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& error) {
    const std::string what = error.what();
    EXPECT_EQ(what.find(", 0 at the arena"), std::string::npos) << what;
  }
}

// Two objects over the device's default pool share one CUmemoryPool, but each records its
// own blocks and refuses the other's; in cuda::mr, equal resources free each other's
// memory. So an object is equal only to itself, and a refused release loses nothing.
TEST(StreamOrderedPoolIdentityGpu, DefaultPoolObjectsAreEqualOnlyToThemselves) {
  VRAM_GPU_TEST_OR_SKIP();
  StreamOrderedPool a({.use_default_pool = true});
  StreamOrderedPool b({.use_default_pool = true});
  EXPECT_TRUE(a == a);
  EXPECT_FALSE(a == b) << "equal objects must accept each other's blocks";
  EXPECT_EQ(a.native_handle(), b.native_handle());
  cuda::Stream stream;
  void* block = a.allocate_async(1_MiB, stream.get());
  stream.synchronize();
  const std::size_t used = a.pool_used_bytes();
  ::testing::internal::CaptureStderr();
  b.deallocate_async(block, 1_MiB, stream.get());
  (void)::testing::internal::GetCapturedStderr();
  stream.synchronize();
  EXPECT_EQ(b.invalid_releases(), 1U);
  EXPECT_EQ(a.pool_used_bytes(), used) << "refused, so still allocated";
  a.deallocate_async(block, 1_MiB, stream.get());
  stream.synchronize();
  EXPECT_EQ(a.bytes_in_use(), 0U);
  EXPECT_EQ(a.invalid_releases(), 0U);
  StreamOrderedPool moved(std::move(a));
  EXPECT_TRUE(moved == moved);
  EXPECT_FALSE(moved == b);
}

}  // namespace
}  // namespace vram::testing
