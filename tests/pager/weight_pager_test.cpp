// WeightPager: the pager over a host-memory device (the CUDA seam replaced), and on a GPU
// the bytes delivered in pinned and pageable modes (its plan: pager_plan_test.cpp; its
// schedule: pager_schedule_test.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gpu_test_policy.hpp"
#include "staging/parallel_copy.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/units.hpp"
#include "vram/weight_pager.hpp"

#if defined(VRAM_HAVE_TEST_KERNELS)
#include "test_kernels.hpp"
#endif

namespace vram::testing {
namespace {

using namespace vram::literals;

// ---- the pager over host memory (the CUDA seam replaced) ------------------------------

struct FakeLog {
  std::size_t allocations = 0;
  std::size_t frees = 0;
  std::size_t shutdowns = 0;
  std::size_t page_ins = 0;
  std::size_t order_violations = 0;  // a page-in into a slot still acquired
  bool fail_pin = false;
  bool configured_staged = false;
};

class HostPagerDevice final : public PagerDevice {
 public:
  explicit HostPagerDevice(std::shared_ptr<FakeLog> log) : log_(std::move(log)) {}
  std::string pin_host(std::span<const HostRange> ranges, std::size_t,
                       WeightPagerLoad& load) override {
    if (log_->fail_pin) return "fake: pinning refused";
    for (const auto& range : ranges) load.pinned_bytes += range.bytes;
    load.register_calls = ranges.size();
    return {};
  }
  void* allocate_arena(std::size_t bytes) override {
    ++log_->allocations;
    arena_.assign(bytes, std::byte{0xEE});
    return arena_.data();
  }
  void upload(void* device, const void* host, std::size_t bytes) override {
    std::memcpy(device, host, bytes);
  }
  void configure(std::size_t slots, bool staged, const WeightPagerOptions&) override {
    outstanding_.assign(slots, 0);
    log_->configured_staged = staged;
  }
  void page_in(std::size_t slot, void* device, const void* host, std::size_t bytes) override {
    if (outstanding_[slot] != 0) ++log_->order_violations;
    ++log_->page_ins;
    std::memcpy(device, host, bytes);
  }
  void wait_ready(std::size_t slot, cudaStream_t) override { ++outstanding_[slot]; }
  void record_release(std::size_t slot, cudaStream_t) override { --outstanding_[slot]; }
  void collect(WeightPagerStats&) override {}
  void synchronize() override {}
  void shutdown(void* arena, std::size_t) noexcept override {
    ++log_->shutdowns;
    if (arena != nullptr) ++log_->frees;
  }

 private:
  std::shared_ptr<FakeLog> log_;
  std::vector<std::byte> arena_;
  std::vector<long> outstanding_;
};

struct HostLayers {
  std::vector<std::vector<std::uint32_t>> data;
  std::vector<WeightLayer> layers;
  HostLayers(std::size_t count, std::size_t words) {
    for (std::size_t i = 0; i < count; ++i) {
      data.emplace_back(words + i, static_cast<std::uint32_t>(0xA5000000U + i));
    }
    for (std::size_t i = 0; i < count; ++i) {
      layers.push_back(
          {"layer." + std::to_string(i), data[i].data(), data[i].size() * sizeof(std::uint32_t)});
    }
  }
};

WeightPager make_host_pager(const HostLayers& host, WeightPagerOptions options,
                            const std::shared_ptr<FakeLog>& log) {
  options.print_plan_warnings = false;
  return WeightPager(host.layers, options, std::make_unique<HostPagerDevice>(log));
}

TEST(WeightPagerHost, DeliversEachLayersBytesUnderABudgetOfThreeLayers) {
  HostLayers host(8, 1024);  // 4 KiB + i words each
  auto log = std::make_shared<FakeLog>();
  auto pager =
      make_host_pager(host, {.plan = {.budget_bytes = 3 * 5_KiB, .prefetch_depth = 1}}, log);
  const std::size_t streamed = pager.plan().streamed_layers();
  ASSERT_GT(streamed, 0U);
  for (int step = 0; step < 3; ++step) {
    for (std::size_t i = 0; i < 8; ++i) {
      const void* device = pager.acquire(i, nullptr);
      EXPECT_EQ(std::memcmp(device, host.data[i].data(), host.layers[i].bytes), 0)
          << "layer " << i << " step " << step;
      pager.release(i, nullptr);
    }
  }
  EXPECT_EQ(log->order_violations, 0U);
  const auto stats = pager.stats();
  EXPECT_EQ(stats.acquires, 24U);
  EXPECT_EQ(log->page_ins, stats.page_ins);
  // Every streamed layer once a step, plus layer 0 (streamed here) prefetched for step 4
  // by the last acquire.
  ASSERT_FALSE(pager.plan().resident[0]);
  EXPECT_EQ(stats.page_ins, 3 * streamed + 1);
  EXPECT_GE(stats.hits, 24U - streamed);  // only the first step's first streamed acquire misses
  std::size_t streamed_bytes = 0;
  for (std::size_t i = 0; i < 8; ++i) {
    if (!pager.plan().resident[i]) streamed_bytes += host.layers[i].bytes;
  }
  EXPECT_EQ(stats.bytes_paged_in, 3 * streamed_bytes + host.layers[0].bytes);
  EXPECT_TRUE(pager.load().pinned);
}

TEST(WeightPagerHost, EverythingResidentMeansNoPageInsAndNoPin) {
  HostLayers host(4, 256);
  auto log = std::make_shared<FakeLog>();
  auto pager =
      make_host_pager(host, {.plan = {.budget_bytes = 1_MiB}, .host = HostWeights::pinned}, log);
  EXPECT_EQ(pager.plan().slot_count, 0U);
  for (int step = 0; step < 2; ++step) {
    for (std::size_t i = 0; i < 4; ++i) {
      const void* device = pager.acquire(i, nullptr);
      EXPECT_EQ(std::memcmp(device, host.data[i].data(), host.layers[i].bytes), 0);
      pager.release(i, nullptr);
    }
  }
  EXPECT_EQ(pager.stats().page_ins, 0U);
  EXPECT_EQ(pager.stats().hits, 8U);
  EXPECT_EQ(pager.load().register_calls, 0U);  // resident layers are copied once, not pinned
  EXPECT_FALSE(pager.load().pinned);
}

TEST(WeightPagerHost, AcquireByNameAndUnknownNames) {
  HostLayers host(4, 256);
  auto log = std::make_shared<FakeLog>();
  auto pager = make_host_pager(host, {.plan = {.budget_bytes = 2_KiB + 1024}}, log);
  EXPECT_EQ(pager.index_of("layer.2"), 2U);
  const void* device = pager.acquire("layer.2", nullptr);
  EXPECT_EQ(std::memcmp(device, host.data[2].data(), host.layers[2].bytes), 0);
  pager.release("layer.2", nullptr);
  EXPECT_THROW((void)pager.acquire("nope", nullptr), InvalidArgument);
  EXPECT_THROW(pager.release("nope", nullptr), InvalidArgument);
}

TEST(WeightPagerHost, ReleasingALayerNotAcquiredIsAnErrorAndChangesNothing) {
  HostLayers host(4, 256);
  auto log = std::make_shared<FakeLog>();
  auto pager = make_host_pager(host, {.plan = {.budget_bytes = 3_KiB}}, log);
  EXPECT_THROW(pager.release(1, nullptr), InvalidArgument);
  EXPECT_THROW(pager.release(9, nullptr), InvalidArgument);
  (void)pager.acquire(1, nullptr);
  pager.release(1, nullptr);
  EXPECT_THROW(pager.release(1, nullptr), InvalidArgument);
  EXPECT_EQ(pager.stats().acquires, 1U);
  (void)pager.acquire(1, nullptr);  // still usable
  pager.release(1, nullptr);
}

TEST(WeightPagerHost, BadConstructionInputAllocatesNothing) {
  HostLayers host(3, 256);
  auto log = std::make_shared<FakeLog>();
  EXPECT_THROW(make_host_pager(host, {.plan = {.budget_bytes = 0}}, log), InvalidArgument);
  EXPECT_THROW(make_host_pager(host, {.plan = {.budget_bytes = 512}}, log),
               InvalidArgument);  // < layer
  auto duplicate = host;
  duplicate.layers[1].name = "layer.0";
  EXPECT_THROW(make_host_pager(duplicate, {.plan = {.budget_bytes = 1_MiB}}, log), InvalidArgument);
  auto null_layer = host;
  null_layer.layers[2].host = nullptr;
  EXPECT_THROW(make_host_pager(null_layer, {.plan = {.budget_bytes = 1_MiB}}, log),
               InvalidArgument);
  EXPECT_THROW(make_host_pager(HostLayers(0, 1), {.plan = {.budget_bytes = 1_MiB}}, log),
               InvalidArgument);
  EXPECT_EQ(log->allocations, 0U);
}

TEST(WeightPagerHost, HandleSaysPagerDestroyed) {
  HostLayers host(4, 256);
  auto log = std::make_shared<FakeLog>();
  std::optional<WeightPager::Handle> handle;
  {
    auto pager = make_host_pager(host, {.plan = {.budget_bytes = 3_KiB}}, log);
    handle.emplace(pager.handle());
    EXPECT_TRUE(handle->alive());
    (void)handle->acquire(0, nullptr);
    handle->release(0, nullptr);
  }
  EXPECT_FALSE(handle->alive());
  try {
    (void)handle->acquire(0, nullptr);
    FAIL() << "acquire on a destroyed pager did not throw";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("pager destroyed"), std::string::npos);
  }
  EXPECT_THROW(handle->release(0, nullptr), InvalidArgument);
  EXPECT_EQ(log->shutdowns, 1U);
  EXPECT_EQ(log->frees, 1U);  // the arena went back exactly once
}

TEST(WeightPagerHost, PinFailureFallsBackWithOneWarningOrThrowsWhenPinnedWasAsked) {
  HostLayers host(8, 256);
  auto log = std::make_shared<FakeLog>();
  log->fail_pin = true;
  ::testing::internal::CaptureStderr();
  {
    auto pager = make_host_pager(
        host, {.plan = {.budget_bytes = 3_KiB}, .host = HostWeights::automatic}, log);
    EXPECT_FALSE(pager.load().pinned);
    EXPECT_NE(pager.load().fallback_reason.find("refused"), std::string::npos);
    EXPECT_TRUE(log->configured_staged);
    for (std::size_t i = 0; i < 8; ++i) {
      (void)pager.acquire(i, nullptr);
      pager.release(i, nullptr);
    }
  }
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  std::size_t count = 0;
  for (std::size_t at = warnings.find("WARNING"); at != std::string::npos;
       at = warnings.find("WARNING", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1U) << warnings;
  const std::size_t allocations = log->allocations;
  EXPECT_THROW(
      make_host_pager(host, {.plan = {.budget_bytes = 3_KiB}, .host = HostWeights::pinned}, log),
      PinningError);
  EXPECT_EQ(log->allocations, allocations);  // nothing allocated for the failed pager
}

TEST(WeightPagerHost, MovedFromPagerThrows) {
  HostLayers host(2, 256);
  auto log = std::make_shared<FakeLog>();
  auto pager = make_host_pager(host, {.plan = {.budget_bytes = 4_KiB}}, log);
  WeightPager other = std::move(pager);
  EXPECT_THROW((void)pager.acquire(0, nullptr),
               InvalidArgument);  // NOLINT(bugprone-use-after-move)
  (void)other.acquire(0, nullptr);
  other.release(0, nullptr);
}

// ---- a Handle used from other threads while the owner destroys the pager -------------

// Threads hammer Handle::acquire/release while the owner destroys the pager and then frees
// the host weights. Each call either completes on the live pager or throws "pager
// destroyed"; the teardown runs in the owner's destructor (the device is shut down when
// it returns), and no call reads the weights or the arena after it.
TEST(WeightPagerThreads, HandleCallsRacingThePagersDestructionCompleteOrThrow) {
  constexpr int kIterations = 150;
  constexpr std::size_t kThreads = 4;
  constexpr std::size_t kLayers = 2 * kThreads;
  std::uint64_t completed_total = 0;
  ::testing::internal::CaptureStderr();  // the destructor warns about layers still acquired
  for (int iteration = 0; iteration < kIterations; ++iteration) {
    auto host = std::make_unique<HostLayers>(kLayers, 8192);  // 32 KiB + i words a layer
    auto log = std::make_shared<FakeLog>();
    std::optional<WeightPager> pager(
        make_host_pager(*host, {.plan = {.budget_bytes = 4 * 33_KiB, .prefetch_depth = 2}}, log));
    const WeightPager::Handle handle = pager->handle();
    std::atomic<std::size_t> running{0};
    std::atomic<std::uint64_t> completed{0};
    std::atomic<std::uint64_t> refused{0};
    std::atomic<std::uint64_t> unexpected{0};
    auto count_refusal = [&](const InvalidArgument& error) {
      const bool destroyed = std::string(error.what()).find("pager destroyed") != std::string::npos;
      (destroyed ? refused : unexpected).fetch_add(1);
    };
    std::vector<std::thread> threads;
    for (std::size_t t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        running.fetch_add(1);
        for (std::size_t call = 0;; ++call) {
          const std::size_t layer = t + kThreads * (call % 2);
          try {
            (void)handle.acquire(layer, nullptr);
          } catch (const OutOfMemory&) {
            std::this_thread::yield();  // every slot acquired by the other threads
            continue;
          } catch (const InvalidArgument& error) {
            count_refusal(error);
            return;
          }
          try {
            handle.release(layer, nullptr);
          } catch (const InvalidArgument& error) {
            count_refusal(error);
            return;
          }
          completed.fetch_add(1);
        }
      });
    }
    while (running.load() < kThreads || completed.load() < 8) std::this_thread::yield();
    pager.reset();  // the owner destroys the pager while the threads are calling
    EXPECT_EQ(log->shutdowns, 1U) << "the teardown must be done when the destructor returns";
    EXPECT_EQ(log->frees, 1U);
    EXPECT_FALSE(handle.alive());
    host.reset();  // the weights are gone: no call may read them any more
    for (auto& thread : threads) thread.join();
    EXPECT_EQ(refused.load(), kThreads);
    EXPECT_EQ(unexpected.load(), 0U);
    completed_total += completed.load();
  }
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  for (std::size_t at = 0; at < warnings.size();) {
    const std::size_t end = std::min(warnings.find('\n', at), warnings.size());
    EXPECT_NE(warnings.substr(at, end - at).find("still acquired"), std::string::npos)
        << warnings.substr(at, end - at);
    at = end + 1;
  }
  EXPECT_GE(completed_total, 8U * kIterations);
}

// ---- on a GPU ---------------------------------------------------------------------------

#if defined(VRAM_HAVE_TEST_KERNELS)

struct GpuLayers {
  std::vector<std::vector<std::uint32_t>> data;
  std::vector<WeightLayer> layers;
  GpuLayers(std::size_t count, std::size_t words) {
    for (std::size_t i = 0; i < count; ++i) {
      data.emplace_back(words, pattern(i));
      layers.push_back({"layer." + std::to_string(i), nullptr, words * sizeof(std::uint32_t)});
    }
    for (std::size_t i = 0; i < count; ++i) layers[i].host = data[i].data();
  }
  static std::uint32_t pattern(std::size_t i) {
    return 0x5EED0000U + static_cast<std::uint32_t>(i) * 7919U;
  }
};

// 8 layers cycling 3 steps under a budget of 3 layers: checks every word on the device.
void run_and_verify(WeightPagerOptions options, std::size_t words) {
  GpuLayers host(8, words);
  options.plan.budget_bytes = 3 * words * sizeof(std::uint32_t);
  options.print_plan_warnings = false;
  WeightPager pager(host.layers, options);
  ASSERT_GT(pager.plan().streamed_layers(), 0U);
  cuda::Stream stream;
  unsigned long long* mismatches = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches), cudaSuccess);
  // Zeroed on the test's own (non-blocking) stream, which does not wait for the legacy one.
  ASSERT_EQ(cudaMemsetAsync(mismatches, 0, sizeof *mismatches, stream.get()), cudaSuccess);
  for (int step = 0; step < 3; ++step) {
    for (std::size_t i = 0; i < 8; ++i) {
      const void* device = pager.acquire(i, stream.get());
      launch_count_mismatches(device, words, GpuLayers::pattern(i), mismatches, stream.get());
      pager.release(i, stream.get());
    }
  }
  stream.synchronize();
  unsigned long long found = 1;
  ASSERT_EQ(cudaMemcpy(&found, mismatches, sizeof found, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(mismatches);
  EXPECT_EQ(found, 0U);
  const auto stats = pager.stats();
  EXPECT_EQ(stats.acquires, 24U);
  // The same decisions, replayed on the host: the page-ins the pager had to issue.
  PagerSchedule replay(pager.plan());
  std::size_t expected_page_ins = 0;
  for (int step = 0; step < 3; ++step) {
    for (std::size_t i = 0; i < 8; ++i) {
      expected_page_ins += replay.acquire(i).page_ins.size();
      replay.release(i);
    }
  }
  EXPECT_GE(expected_page_ins, 3 * pager.plan().streamed_layers());
  EXPECT_EQ(stats.page_ins, expected_page_ins);
  EXPECT_GT(stats.timed_page_ins, 0U);  // sampled every page-in, read after the sync
  EXPECT_GT(stats.effective_gbps, 0.0);
  EXPECT_EQ(stats.staging_pin_calls, 0U);
}

TEST(WeightPagerGpu, PinnedWeightsDeliverEveryByte) {
  VRAM_GPU_TEST_OR_SKIP();
  run_and_verify(
      {.plan = {.prefetch_depth = 1}, .host = HostWeights::pinned, .stall_sample_period = 1},
      (1_MiB + 4096) / 4);
}

TEST(WeightPagerGpu, PageableWeightsDeliverEveryByteThroughStaging) {
  VRAM_GPU_TEST_OR_SKIP();
  // Chunks smaller than a layer and a layer that is not a multiple of the chunk.
  run_and_verify({.plan = {.prefetch_depth = 1},
                  .host = HostWeights::pageable,
                  .staging_chunk_bytes = 256_KiB,
                  .staging_buffers = 3,
                  .fill_threads = 3,
                  .stall_sample_period = 1},
                 (1_MiB + 4096) / 4);
}

TEST(WeightPagerGpu, DeeperPrefetchAndAutomaticPinning) {
  VRAM_GPU_TEST_OR_SKIP();
  run_and_verify(
      {.plan = {.prefetch_depth = 2}, .host = HostWeights::automatic, .stall_sample_period = 1},
      256_KiB / 4);
}

TEST(WeightPagerGpu, StepsAlternatingBetweenTwoStreamsSeeTheRightBytes) {
  VRAM_GPU_TEST_OR_SKIP();
  // Eviction after a release on stream A must wait for A even when the next user is B.
  const std::size_t words = 512_KiB / 4;
  GpuLayers host(8, words);
  WeightPager pager(host.layers, {.plan = {.budget_bytes = 3 * 512_KiB, .prefetch_depth = 1},
                                  .host = HostWeights::pinned,
                                  .print_plan_warnings = false});
  cuda::Stream streams[2];
  unsigned long long* mismatches = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches), cudaSuccess);
  ASSERT_EQ(cudaMemset(mismatches, 0, sizeof *mismatches), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the streams do not wait for the legacy one
  for (int step = 0; step < 4; ++step) {
    const cudaStream_t stream = streams[step % 2].get();
    for (std::size_t i = 0; i < 8; ++i) {
      const void* device = pager.acquire(i, stream);
      // A slow reader: a later page-in into its slot must not overwrite it early.
      launch_spin_then_fill(nullptr, 0, 0, 20000, stream);  // spins 20 us, writes nothing
      launch_count_mismatches(device, words, GpuLayers::pattern(i), mismatches, stream);
      pager.release(i, stream);
    }
  }
  streams[0].synchronize();
  streams[1].synchronize();
  unsigned long long found = 1;
  ASSERT_EQ(cudaMemcpy(&found, mismatches, sizeof found, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(mismatches);
  EXPECT_EQ(found, 0U);
}

TEST(WeightPagerGpu, PinsOnlyTheStreamedLayersAndReportsIt) {
  VRAM_GPU_TEST_OR_SKIP();
  GpuLayers host(8, 1_MiB / 4);
  WeightPager pager(host.layers, {.plan = {.budget_bytes = 3_MiB, .prefetch_depth = 1},
                                  .host = HostWeights::pinned,
                                  .print_plan_warnings = false});
  const auto& load = pager.load();
  EXPECT_TRUE(load.pinned);
  EXPECT_GE(load.pinned_bytes, pager.plan().streamed_layers() * 1_MiB);
  EXPECT_GE(load.register_calls, 1U);
  EXPECT_GT(load.pin_seconds, 0.0);
}

// Layers packed in one host buffer at offsets that are not page-aligned: a resident layer
// shares its first and last pages with streamed (pinned) ones, so its upload and their
// page-ins each cross the edge of a registration.
TEST(WeightPagerGpu, PackedLayersSharingPagesUploadAndStreamEveryByte) {
  VRAM_GPU_TEST_OR_SKIP();
  constexpr std::size_t kLayers = 8;
  const std::size_t words = (1_MiB + 100) / 4;
  std::vector<std::uint32_t> packed(kLayers * words + 64);
  std::vector<WeightLayer> layers;
  for (std::size_t i = 0; i < kLayers; ++i) {
    std::uint32_t* at = packed.data() + 25 + i * words;  // 100 bytes in: never page-aligned
    std::fill(at, at + words, GpuLayers::pattern(i));
    layers.push_back({"layer." + std::to_string(i), at, words * sizeof(std::uint32_t)});
  }
  WeightPager pager(
      layers, {.plan = {.budget_bytes = 5 * words * sizeof(std::uint32_t), .prefetch_depth = 1},
               .host = HostWeights::pinned,
               .print_plan_warnings = false});
  ASSERT_GT(pager.plan().streamed_layers(), 0U);
  ASSERT_LT(pager.plan().streamed_layers(), kLayers);
  cuda::Stream stream;
  unsigned long long* mismatches = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof *mismatches), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(mismatches, 0, sizeof *mismatches, stream.get()), cudaSuccess);
  for (int step = 0; step < 2; ++step) {
    for (std::size_t i = 0; i < kLayers; ++i) {
      const void* device = pager.acquire(i, stream.get());
      launch_count_mismatches(device, words, GpuLayers::pattern(i), mismatches, stream.get());
      pager.release(i, stream.get());
    }
  }
  stream.synchronize();
  unsigned long long found = 1;
  ASSERT_EQ(cudaMemcpy(&found, mismatches, sizeof found, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(mismatches);
  EXPECT_EQ(found, 0U);
}

#endif  // VRAM_HAVE_TEST_KERNELS

}  // namespace
}  // namespace vram::testing
