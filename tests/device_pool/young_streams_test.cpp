// YoungStreams: a stream is young for a thread for its first kYoungFrees frees there; the
// warm test reads slot 0 only; an evicted stream is young again; each thread has its own.
// With a pool: a free on a young stream is fenced at once (a marker recorded in the same
// call), so the block reaches another stream once the stream's work ran, with no quiesce,
// even after the stream was destroyed.
#include "device_pool/young_streams.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "gpu_test_policy.hpp"
#include "test_fences.hpp"
#include "test_upstreams.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/device_pool.hpp"
#include "vram/units.hpp"
#include "vram/upstream.hpp"
#ifdef VRAM_HAVE_TEST_KERNELS
#include "test_kernels.hpp"
#endif

namespace vram::testing {
namespace {

using namespace vram::literals;
using detail::StreamKey;
using detail::YoungStreams;

TEST(YoungStreams, AStreamAgesAfterItsFirstFrees) {
  YoungStreams table;
  const StreamKey s = 0x1000;
  for (std::uint32_t i = 0; i < YoungStreams::kYoungFrees; ++i) {
    EXPECT_FALSE(table.aged_front(s));
    EXPECT_TRUE(table.note_free(s)) << "free " << i;
  }
  EXPECT_TRUE(table.aged_front(s));
  EXPECT_FALSE(table.note_free(s));
  EXPECT_EQ(table.frees_of(s), YoungStreams::kYoungFrees + 1);
}

TEST(YoungStreams, AnAgedStreamReadsItsIdentityEveryFewFreesOnly) {
  YoungStreams table;
  const StreamKey s = 0x1000;
  int reads = 0;
  auto identity = [&reads] {
    ++reads;
    return std::uint64_t{7};
  };
  for (std::uint32_t i = 0; i < YoungStreams::kYoungFrees; ++i) table.note_free(s, identity);
  EXPECT_EQ(reads, static_cast<int>(YoungStreams::kYoungFrees)) << "read at every young free";
  reads = 0;
  for (int round = 0; round < 3; ++round) {
    for (std::uint32_t i = 1; i < YoungStreams::kCheckEvery; ++i) {
      EXPECT_TRUE(table.aged_front(s)) << "warm free " << i;
    }
    EXPECT_FALSE(table.aged_front(s)) << "a check is due";
    EXPECT_FALSE(table.note_free(s, identity)) << "the same stream: still aged";
  }
  EXPECT_EQ(reads, 3);
}

TEST(YoungStreams, ANewStreamOnAnAgedHandleIsYoungAndTheHandleChurns) {
  YoungStreams table;
  const StreamKey s = 0x1000;
  std::uint64_t id = 1;
  auto identity = [&id] { return id; };
  for (std::uint32_t i = 0; i < YoungStreams::kYoungFrees; ++i) table.note_free(s, identity);
  EXPECT_FALSE(table.note_free(s, identity));
  id = 2;  // the stream was destroyed and a new one got its handle
  // The pool's order: the warm test, else the table. An aged handle is found out at its
  // next identity check, at most kCheckEvery frees later.
  std::uint32_t warm = 0;
  while (table.aged_front(s)) ++warm;
  EXPECT_LT(warm, YoungStreams::kCheckEvery);
  EXPECT_TRUE(table.note_free(s, identity)) << "the new stream is young";
  EXPECT_TRUE(table.churning(s));
  for (std::uint32_t i = 1; i < YoungStreams::kYoungFrees; ++i) table.note_free(s, identity);
  EXPECT_FALSE(table.aged_front(s)) << "a churning handle reads the identity at every free";
  EXPECT_FALSE(table.note_free(s, identity)) << "aged on its own identity";
  id = 3;
  EXPECT_TRUE(table.note_free(s, identity)) << "the next stream on the handle is young at once";
  for (std::uint32_t i = 1; i < YoungStreams::kSettledFrees; ++i) table.note_free(s, identity);
  EXPECT_FALSE(table.churning(s)) << "settled after kSettledFrees frees of one stream";
  EXPECT_TRUE(table.aged_front(s));
}

TEST(YoungStreams, TheWarmTestSeesOnlyTheLastStreamButAStreamKeepsItsCount) {
  YoungStreams table;
  const StreamKey a = 0x1000;
  const StreamKey b = 0x2000;
  for (std::uint32_t i = 0; i < YoungStreams::kYoungFrees; ++i) table.note_free(a);
  EXPECT_TRUE(table.note_free(b));
  EXPECT_FALSE(table.aged_front(a)) << "b was freed on last";
  EXPECT_FALSE(table.note_free(a)) << "a is still aged";
  EXPECT_TRUE(table.aged_front(a));
}

TEST(YoungStreams, AnEvictedStreamIsYoungAgain) {
  YoungStreams table;
  const StreamKey a = 0x1000;
  for (std::uint32_t i = 0; i < YoungStreams::kYoungFrees; ++i) table.note_free(a);
  for (std::size_t k = 1; k <= YoungStreams::kSlots; ++k) table.note_free(0x1000 + 0x100 * k);
  EXPECT_EQ(table.frees_of(a), 0U) << "the least recently freed on is evicted";
  EXPECT_TRUE(table.note_free(a));
}

TEST(YoungStreams, TheStreamsOfTheDefaultStreamAreNeverInTheTable) {
  // always_recordable streams take the warm path before the table is read.
  EXPECT_TRUE(detail::always_recordable(detail::stream_key(nullptr)));
  EXPECT_TRUE(detail::always_recordable(detail::stream_key(cudaStreamPerThread)));
  EXPECT_FALSE(detail::always_recordable(0x1000));
}

TEST(YoungStreams, EachThreadCountsItsOwn) {
  detail::thread_young_streams().clear();
  const StreamKey s = 0x3000;
  for (std::uint32_t i = 0; i < YoungStreams::kYoungFrees; ++i) {
    detail::thread_young_streams().note_free(s);
  }
  EXPECT_TRUE(detail::thread_young_streams().aged_front(s));
  std::thread([s] {
    EXPECT_FALSE(detail::thread_young_streams().aged_front(s));
    EXPECT_EQ(detail::thread_young_streams().frees_of(s), 0U);
  }).join();
  detail::thread_young_streams().clear();
}

DevicePool::Options emulated(std::shared_ptr<StreamFence> fence) {
  DevicePool::Options options;
  options.fence = std::move(fence);
  options.large_tier.memory = LargeTierMemory::virtual_memory;
  options.small_tier.max_block_bytes = std::size_t{256} << 10;
  options.large_tier.virtual_reservation_bytes = 1_GiB;
  options.large_tier.virtual_map_ahead_bytes = 0;
  options.validate_releases = false;
  return options;
}

// s1 frees a small and a large block (young: fenced at each free) before its work ran, and
// is then synchronized and destroyed: s2 gets both blocks with no quiesce, no growth and no
// record on the destroyed s1. A block s2 takes while s1's work is queued is one whose work
// has run (the pool waited for s1's marker).
TEST(YoungStreams, AYoungStreamsFreeReachesAnotherStreamAfterItsWorkWithNoQuiesce) {
  for (const bool validate : {false, true}) {
    SCOPED_TRACE(validate ? "validated" : "shipped path");
    detail::thread_young_streams().clear();
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto fence = std::make_shared<StreamLifetimeFence>(/*recycle_handles=*/false);
    auto options = emulated(fence);
    options.validate_releases = validate;
    {
      DevicePool pool(upstream, options);
      const cudaStream_t s2 = fence->create();
      const cudaStream_t s1 = fence->create();
      void* large = pool.allocate_async(4_MiB, s1);
      void* small = pool.allocate_async(4096, s1);
      bool ran = false;
      fence->enqueue(s1, [&ran] { ran = true; });  // s1's work on the blocks
      const std::uint64_t records = fence->records();
      pool.deallocate_async(large, 4_MiB, s1);
      pool.deallocate_async(small, 4096, s1);
      EXPECT_EQ(fence->records(), records + 2) << "a marker at each young free";
      EXPECT_FALSE(ran) << "a free does not wait";
      fence->synchronize(s1);
      fence->destroy(s1);
      const std::size_t reserved = pool.stats().bytes_reserved;
      void* l2 = pool.allocate_async(4_MiB, s2);
      void* m2 = pool.allocate_async(4096, s2);
      EXPECT_EQ(l2, large) << "s1's block once its marker completed";
      EXPECT_EQ(m2, small) << "s1's block once its marker completed";
      EXPECT_EQ(pool.stats().bytes_reserved, reserved) << "nothing new taken";
      // Again with s1's work still queued when s2 asks: what s2 gets is free of it.
      const cudaStream_t s3 = fence->create();
      void* l3 = pool.allocate_async(4_MiB, s3);
      bool ran3 = false;
      fence->enqueue(s3, [&ran3] { ran3 = true; });
      pool.deallocate_async(l3, 4_MiB, s3);
      void* l4 = pool.allocate_async(4_MiB, s2);
      if (l4 == l3) EXPECT_TRUE(ran3) << "s3's block handed to s2 before s3's work ran";
      fence->synchronize(s3);
      fence->destroy(s3);
      EXPECT_EQ(pool.stats().quiesces, 0U);
      for (void* b : {l2, l4}) pool.deallocate_async(b, 4_MiB, s2);
      pool.deallocate_async(m2, 4096, s2);
      // A release of a block that is not live is still refused on the fenced path.
      const std::uint64_t refused = pool.stats().invalid_releases;
      const cudaStream_t s4 = fence->create();
      pool.deallocate_async(l4, 4_MiB, s4);
      EXPECT_EQ(pool.stats().invalid_releases, refused + 1);
      fence->destroy(s4);
      fence->synchronize(s2);
      fence->destroy(s2);
      pool.trim(0);
      EXPECT_EQ(pool.stats().bytes_in_use, 0U);
    }
    EXPECT_EQ(fence->records_on_destroyed(), 0U);
    EXPECT_EQ(upstream->live_bytes(), 0U);
    EXPECT_EQ(upstream->bad_frees(), 0U);
    detail::thread_young_streams().clear();
  }
}

// Threads free on streams young for them (a stream per round, destroyed after its work),
// with block sizes of both tiers: every block comes back once, nothing is lost, hardly any
// free waits for a quiesce; then a second release of a large block, on another thread and
// stream, is refused.
TEST(YoungStreams, ThreadsFencingTheirFreesLoseNoBlockAndRefuseSecondReleases) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 200;
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<StreamLifetimeFence>(/*recycle_handles=*/false);
  {
    DevicePool pool(upstream, emulated(fence));
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        detail::thread_young_streams().clear();
        for (int round = 0; round < kRounds; ++round) {
          const cudaStream_t s = fence->create();
          const std::size_t bytes = (round % 3 == 0 ? 1_MiB : 4096) * (1 + (t + round) % 4);
          void* a = pool.allocate_async(bytes, s);
          void* b = pool.allocate_async(bytes, s);
          fence->enqueue(s, [] {});  // the request's work, run when s is synchronized
          pool.deallocate_async(a, bytes, s);
          pool.deallocate_async(b, bytes, s);
          fence->synchronize(s);
          fence->destroy(s);
        }
      });
    }
    for (auto& thread : threads) thread.join();
    const DevicePoolStats stats = pool.stats();
    EXPECT_EQ(stats.bytes_in_use, 0U);
    EXPECT_EQ(stats.acquires, stats.releases);
    // A range found between its filing and its marker may still ask for one (a few, 800
    // streams).
    EXPECT_LE(stats.stream_quiesces, 32U);
    // A second release of a large block on a young stream is refused (the tier finds it
    // free), whichever thread makes it.
    const cudaStream_t s = fence->create();
    void* big = pool.allocate_async(4_MiB, s);
    pool.deallocate_async(big, 4_MiB, s);
    const std::uint64_t refused = pool.stats().invalid_releases;
    std::thread([&] {
      detail::thread_young_streams().clear();
      const cudaStream_t s2 = fence->create();
      pool.deallocate_async(big, 4_MiB, s2);
      fence->destroy(s2);
    }).join();
    EXPECT_EQ(pool.stats().invalid_releases, refused + 1);
    fence->destroy(s);
    pool.trim(0);
  }
  EXPECT_EQ(fence->records_on_destroyed(), 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

#ifdef VRAM_HAVE_TEST_KERNELS
// On a device: a request's stream fills its 4 MiB block, keeps a check of it queued behind a
// 50 ms spin, frees it (young: a marker recorded in that call) and is synchronized and
// destroyed; meanwhile and after, another stream takes 4 MiB blocks and overwrites them. The
// check sees its own tag (the block did not reach the other stream before the check ran),
// and the other stream's requests after the destruction cause no device synchronize.
TEST(YoungStreamsGpu, AYoungStreamsBlockReachesAnotherStreamOnlyAfterItsWorkWithNoQuiesce) {
  VRAM_GPU_TEST_OR_SKIP();
  detail::thread_young_streams().clear();
  constexpr std::size_t kWords = 1_MiB / 4;  // checked, from the block's start
  DevicePool pool(0, DevicePool::Options{});
  unsigned long long* counter = nullptr;
  cuda::check(cudaMalloc(reinterpret_cast<void**>(&counter), sizeof *counter), "cudaMalloc");
  cuda::check(cudaMemset(counter, 0, sizeof *counter), "cudaMemset");
  cuda::Stream other;
  std::vector<void*> others;
  for (std::uint32_t request = 1; request <= 8; ++request) {
    {
      cuda::Stream mine;
      void* a = pool.allocate_async(4_MiB, mine.get());
      launch_fill(a, kWords, request, mine.get());
      launch_spin_then_fill(counter, 0, 0, 50'000'000, mine.get());  // the check stays queued
      launch_count_mismatches(a, kWords, request, counter, mine.get());
      pool.deallocate_async(a, 4_MiB, mine.get());
      void* b = pool.allocate_async(4_MiB, other.get());
      launch_fill(b, kWords, 0xdead0000u + request, other.get());
      others.push_back(b);
      mine.synchronize();
    }  // destroyed after its work, as a request handler does
    for (void* b : others) pool.deallocate_async(b, 4_MiB, other.get());
    others.clear();
  }
  other.synchronize();
  unsigned long long mismatches = 0;
  cuda::check(cudaMemcpy(&mismatches, counter, sizeof mismatches, cudaMemcpyDeviceToHost),
              "cudaMemcpy");
  cuda::check(cudaFree(counter), "cudaFree");
  EXPECT_EQ(mismatches, 0U) << "a block reached the other stream before its owner's check ran";
  EXPECT_EQ(pool.stats().stream_quiesces, 0U) << "a young stream's free waited for a quiesce";
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  detail::thread_young_streams().clear();
}
#endif  // VRAM_HAVE_TEST_KERNELS

}  // namespace
}  // namespace vram::testing
