// Thread heaps (src/device_pool/thread_heap.hpp): a thread's large blocks of any size by best
// fit in chunks of the large tier, under a mutex of its own. The heap alone (its books, what
// it keeps and what it gives back, with which tags), then in a pool: only where threads meet,
// deallocations on other threads, streams, the flush before a tier grows, trim, thread exit,
// a pool destroyed with heap blocks leased, and threads with fresh sizes handing blocks to
// each other. Host memory; validation off, as in release builds.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "device_pool/large_block_cache.hpp"
#include "device_pool/thread_heap.hpp"
#include "steady_stream.hpp"
#include "test_fences.hpp"
#include "test_upstreams.hpp"
#include "vram/device_pool.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;
using detail::kUntagged;
using detail::StreamKey;
using detail::ThreadHeap;

char* fake_chunk(std::uintptr_t n) { return reinterpret_cast<char*>(n << 30); }
constexpr StreamKey kS1 = 0x1001;
constexpr StreamKey kS2 = 0x2002;

std::size_t pieces_bytes(const ThreadHeap::Returned& r) {
  std::size_t sum = 0;
  for (std::size_t i = 0; i < r.pieces.size(); ++i) sum += r.pieces[i].bytes;
  return sum;
}

// ---- the heap alone --------------------------------------------------------------------

TEST(ThreadHeap, BlocksComeFromTheChunkByBestFitButNeverItsFirstBytes) {
  ThreadHeap heap({.chunk_bytes = 64_MiB, .keep_idle = 256_MiB});
  char* chunk = fake_chunk(1);
  EXPECT_EQ(heap.allocate(1_MiB, kUntagged), nullptr) << "no chunk yet";
  void* a = heap.allocate_in_new_chunk(chunk, 64_MiB, 1_MiB, kUntagged, kUntagged);
  EXPECT_EQ(a, chunk + 512) << "no block starts where its chunk starts";
  void* b = heap.allocate(2_MiB, kUntagged);
  EXPECT_EQ(b, chunk + 512 + 1_MiB);
  EXPECT_TRUE(heap.contains(a));
  EXPECT_TRUE(heap.contains(chunk + 64_MiB - 1));
  EXPECT_FALSE(heap.contains(chunk + 64_MiB));
  EXPECT_FALSE(heap.contains(chunk - 1));
  EXPECT_EQ(heap.free_bytes(), 64_MiB - 512 - 3_MiB);
  ThreadHeap::Returned out;
  EXPECT_EQ(heap.deallocate(a, 1_MiB, kUntagged, out), ThreadHeap::Freed::kept);
  EXPECT_EQ(out.block, nullptr);
  // The freed 1 MiB at the front is the best fit for 512 KiB (smaller than the rest).
  EXPECT_EQ(heap.allocate(512_KiB, kUntagged), a);
}

TEST(ThreadHeap, ADeallocationIsCheckedAgainstWhatWasHandedOut) {
  ThreadHeap heap({.chunk_bytes = 64_MiB, .keep_idle = 256_MiB});
  char* chunk = fake_chunk(2);
  void* a = heap.allocate_in_new_chunk(chunk, 64_MiB, 4_MiB, kUntagged, kUntagged);
  ThreadHeap::Returned out;
  EXPECT_EQ(heap.deallocate(a, 8_MiB, kUntagged, out), ThreadHeap::Freed::foreign)
      << "another size";
  EXPECT_EQ(heap.deallocate(chunk, 4_MiB, kUntagged, out), ThreadHeap::Freed::foreign)
      << "the chunk's own address is no block";
  EXPECT_EQ(heap.deallocate(static_cast<char*>(a) + 512, 4_MiB, kUntagged, out),
            ThreadHeap::Freed::foreign)
      << "inside a block";
  EXPECT_EQ(heap.free_bytes(), 64_MiB - 512 - 4_MiB) << "nothing changed";
  EXPECT_EQ(heap.deallocate(a, 4_MiB, kUntagged, out), ThreadHeap::Freed::kept);
  EXPECT_EQ(heap.deallocate(a, 4_MiB, kUntagged, out), ThreadHeap::Freed::foreign)
      << "a double deallocation";
}

TEST(ThreadHeap, WhollyFreeChunksAreKeptUpToKeepIdleThenGoBackWhole) {
  ThreadHeap heap({.chunk_bytes = 32_MiB, .keep_idle = 64_MiB});
  void* a = heap.allocate_in_new_chunk(fake_chunk(3), 32_MiB, 8_MiB, kUntagged, kUntagged);
  void* b = heap.allocate_in_new_chunk(fake_chunk(4), 32_MiB, 30_MiB, kUntagged, kUntagged);
  void* c = heap.allocate_in_new_chunk(fake_chunk(5), 32_MiB, 30_MiB, kUntagged, kUntagged);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(heap.chunk_count(), 3U);
  ThreadHeap::Returned out;
  heap.deallocate(a, 8_MiB, kUntagged, out);
  EXPECT_EQ(out.block, nullptr) << "the first idle chunk is kept";
  heap.deallocate(b, 30_MiB, kUntagged, out);
  EXPECT_EQ(out.block, nullptr) << "64 MiB idle: still within keep_idle";
  heap.deallocate(c, 30_MiB, kUntagged, out);
  ASSERT_EQ(out.block, fake_chunk(5)) << "past keep_idle the chunk goes back";
  EXPECT_EQ(out.bytes, 32_MiB);
  EXPECT_EQ(pieces_bytes(out), 32_MiB) << "its pieces cover it exactly";
  EXPECT_EQ(out.pieces.size(), 2U) << "the guard and one untagged range";
  EXPECT_FALSE(heap.contains(c));
  EXPECT_EQ(heap.chunk_count(), 2U);
  ThreadHeap::Returned idle[4];
  EXPECT_EQ(heap.take_idle(idle, 4), 2U);
  EXPECT_EQ(heap.chunk_count(), 0U);
  EXPECT_EQ(heap.free_bytes(), 0U);
}

TEST(ThreadHeap, AStreamsFreedRangeServesOnlyThatStreamUntilItsChunkGoesBack) {
  ThreadHeap heap({.chunk_bytes = 32_MiB, .keep_idle = 256_MiB});
  void* a = heap.allocate_in_new_chunk(fake_chunk(6), 32_MiB, 4_MiB, kS1, kUntagged);
  void* keep = heap.allocate(4_MiB, kS1);  // keeps the chunk in use
  ThreadHeap::Returned out;
  heap.deallocate(a, 4_MiB, kS1, out);
  // The rest of the chunk is untagged (it came from untagged memory) but larger: a
  // request of 4 MiB on S1 takes S1's own range, on S2 or without a stream the rest.
  void* on_s2 = heap.allocate(4_MiB, kS2);
  EXPECT_NE(on_s2, a) << "S1's range serves no other stream";
  void* plain = heap.allocate(4_MiB, kUntagged);
  EXPECT_NE(plain, a) << "nor a request without a stream";
  EXPECT_EQ(heap.allocate(4_MiB, kS1), a) << "S1 reuses its own at once";
  heap.deallocate(a, 4_MiB, kS1, out);
  heap.deallocate(plain, 4_MiB, kUntagged, out);
  heap.deallocate(on_s2, 4_MiB, kS2, out);
  heap.deallocate(keep, 4_MiB, kS1, out);
  // Wholly free, with S2's range in it, on a deallocation on S1: it goes back at once,
  // its pieces keeping their streams.
  ASSERT_EQ(out.block, fake_chunk(6));
  EXPECT_EQ(pieces_bytes(out), 32_MiB);
  bool s1 = false;
  bool s2 = false;
  for (std::size_t i = 0; i < out.pieces.size(); ++i) {
    s1 = s1 || out.pieces[i].tag == kS1;
    s2 = s2 || out.pieces[i].tag == kS2;
  }
  EXPECT_TRUE(s1 && s2) << "each stream's range goes back with its stream";
  EXPECT_EQ(out.pieces[0].tag, kUntagged) << "the guard was never handed out";
}

TEST(ThreadHeap, AChunkCutFromAStreamsOwnRangeServesOnlyThatStream) {
  ThreadHeap heap({.chunk_bytes = 32_MiB, .keep_idle = 256_MiB});
  void* a = heap.allocate_in_new_chunk(fake_chunk(7), 32_MiB, 4_MiB, kS1, kS1);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(heap.allocate(4_MiB, kS2), nullptr) << "S1's memory is no other stream's";
  EXPECT_EQ(heap.allocate(4_MiB, kUntagged), nullptr);
  EXPECT_NE(heap.allocate(4_MiB, kS1), nullptr);
}

TEST(ThreadHeap, TakeIdleForAStreamLeavesTheChunksThatStreamCanUse) {
  ThreadHeap heap({.chunk_bytes = 32_MiB, .keep_idle = 256_MiB});
  void* a = heap.allocate_in_new_chunk(fake_chunk(8), 32_MiB, 4_MiB, kS1, kUntagged);
  void* b = heap.allocate_in_new_chunk(fake_chunk(9), 32_MiB, 30_MiB, kS2, kUntagged);
  ThreadHeap::Returned out;
  heap.deallocate(a, 4_MiB, kS1, out);
  heap.deallocate(b, 30_MiB, kS2, out);
  EXPECT_EQ(out.block, nullptr) << "both kept idle";
  ThreadHeap::Returned idle[4];
  using Idle = ThreadHeap::Idle;
  ASSERT_EQ(heap.take_idle(idle, 4, Idle::holding_others, kS1), 1U)
      << "S2's chunk is of no use to S1";
  EXPECT_EQ(idle[0].block, fake_chunk(9));
  EXPECT_EQ(heap.take_idle(idle, 4, Idle::holding_others, kS1), 0U);
  EXPECT_EQ(heap.take_idle(idle, 4), 1U);
}

// A growth's flush takes from other threads' heaps only the chunks its request can use:
// those whose free ranges are untagged or the request's stream's.
TEST(ThreadHeap, TakeIdleUsableByAStreamTakesOnlyWhatThatStreamCanUse) {
  ThreadHeap heap({.chunk_bytes = 32_MiB, .keep_idle = 256_MiB});
  void* s1 = heap.allocate_in_new_chunk(fake_chunk(11), 32_MiB, 4_MiB, kS1, kUntagged);
  void* s2 = heap.allocate_in_new_chunk(fake_chunk(12), 32_MiB, 4_MiB, kS2, kUntagged);
  void* plain = heap.allocate_in_new_chunk(fake_chunk(13), 32_MiB, 4_MiB, kUntagged, kUntagged);
  ThreadHeap::Returned out;
  heap.deallocate(s1, 4_MiB, kS1, out);
  heap.deallocate(s2, 4_MiB, kS2, out);
  heap.deallocate(plain, 4_MiB, kUntagged, out);
  EXPECT_EQ(out.block, nullptr) << "all three kept idle";
  ThreadHeap::Returned idle[4];
  using Idle = ThreadHeap::Idle;
  ASSERT_EQ(heap.take_idle(idle, 4, Idle::usable, kS1), 2U) << "S1's and the untagged one";
  EXPECT_NE(idle[0].block, fake_chunk(12));
  EXPECT_NE(idle[1].block, fake_chunk(12));
  EXPECT_EQ(heap.take_idle(idle, 4, Idle::usable, kS1), 0U) << "S2's ranges wait for S2";
  EXPECT_EQ(heap.take_idle(idle, 4, Idle::usable, kUntagged), 0U);
  ASSERT_EQ(heap.take_idle(idle, 4, Idle::usable, kS2), 1U);
  EXPECT_EQ(idle[0].block, fake_chunk(12));
}

TEST(ThreadHeap, AChunkIsAskedBackOnlyWhileWhollyFreeAndOnlyForTheStreamOfItsRanges) {
  ThreadHeap heap({.chunk_bytes = 32_MiB, .keep_idle = 256_MiB});
  void* s1 = heap.allocate_in_new_chunk(fake_chunk(31), 32_MiB, 4_MiB, kS1, kUntagged);
  void* s2 = heap.allocate_in_new_chunk(fake_chunk(32), 32_MiB, 4_MiB, kS2, kUntagged);
  ThreadHeap::Returned out;
  heap.deallocate(s1, 4_MiB, kS1, out);
  heap.deallocate(s2, 4_MiB, kS2, out);
  EXPECT_FALSE(heap.asked());
  ThreadHeap::Returned idle[4];
  using Idle = ThreadHeap::Idle;
  ASSERT_EQ(heap.take_idle(idle, 4, Idle::usable, kUntagged), 0U) << "both hold a stream's";
  EXPECT_TRUE(heap.asked()) << "a growth could not use them";
  // Handed out again: S1's chunk is no longer asked, even once it is wholly free again. S2's
  // chunk is asked, but not for S1's marker: S1's pass leaves it and forgets that ask.
  void* again = heap.allocate(4_MiB, kS1);
  ASSERT_NE(again, nullptr);
  heap.deallocate(again, 4_MiB, kS1, out);
  EXPECT_EQ(heap.take_idle(idle, 4, Idle::asked, kS1), 0U) << "used since it was asked";
  EXPECT_FALSE(heap.asked()) << "no later free asks about either again";
  // Asked again by a growth: S2's pass takes S2's chunk alone and forgets the ask of S1's.
  ASSERT_EQ(heap.take_idle(idle, 4, Idle::usable, kUntagged), 0U);
  ASSERT_EQ(heap.take_idle(idle, 4, Idle::asked, kS2), 1U);
  EXPECT_EQ(idle[0].block, fake_chunk(32));
  EXPECT_FALSE(heap.asked());
  EXPECT_EQ(heap.take_idle(idle, 4, Idle::asked, kS1), 0U) << "S1's stays until a flush";
  ASSERT_EQ(heap.take_idle(idle, 4, Idle::usable, kS1), 1U);
  EXPECT_EQ(idle[0].block, fake_chunk(31));
}

TEST(ThreadHeap, ChunksGrowWithWhatTheThreadUsesUpToChunkBytes) {
  ThreadHeap heap({.chunk_bytes = 64_MiB, .keep_idle = 256_MiB});
  EXPECT_EQ(heap.chunk_bytes_for(1_MiB), 4_MiB) << "twice the request, rounded to 2 MiB";
  heap.allocate_in_new_chunk(fake_chunk(10), 40_MiB, 30_MiB, kUntagged, kUntagged);
  EXPECT_EQ(heap.chunk_bytes_for(1_MiB), 32_MiB) << "as much as the heap has handed out";
  heap.allocate_in_new_chunk(fake_chunk(11), 44_MiB, 40_MiB, kUntagged, kUntagged);
  EXPECT_EQ(heap.chunk_bytes_for(1_MiB), 64_MiB) << "at most chunk_bytes";
  EXPECT_EQ(heap.chunk_bytes_for(40_MiB), 82_MiB) << "but always twice the request";
}

TEST(ThreadHeap, AChunkTakenAfterAQuiesceBeganKeepsItsStreamThroughIt) {
  ThreadHeap heap({.chunk_bytes = 64_MiB, .keep_idle = 256_MiB});
  const std::uint64_t mark = heap.mark_frees();
  // Cut from S1's own range, freed on S1 after the quiesce began: S1's only.
  ASSERT_NE(heap.allocate_in_new_chunk(fake_chunk(60), 32_MiB, 1_MiB, kS1, kS1), nullptr);
  heap.forget_streams(mark);
  EXPECT_EQ(heap.allocate(1_MiB, kUntagged), nullptr) << "S1's work may still use it";
  EXPECT_NE(heap.allocate(1_MiB, kS1), nullptr);
}

TEST(ThreadHeap, EverySlotTakenRefusesAChunkAndChangesNothing) {
  ThreadHeap heap({.chunk_bytes = 4_MiB, .keep_idle = 256_MiB});
  for (std::uintptr_t i = 0; i < ThreadHeap::kMaxChunks; ++i) {
    ASSERT_NE(
        heap.allocate_in_new_chunk(fake_chunk(20 + i), 4_MiB, 4_MiB - 512, kUntagged, kUntagged),
        nullptr);
  }
  EXPECT_EQ(heap.allocate_in_new_chunk(fake_chunk(40), 4_MiB, 1_MiB, kUntagged, kUntagged),
            nullptr);
  EXPECT_FALSE(heap.contains(fake_chunk(40) + 512));
  EXPECT_EQ(heap.chunk_count(), ThreadHeap::kMaxChunks);
}

TEST(ThreadHeap, OverTheSmallTierRangesAndTheGuardAreItsGranularity) {
  ThreadHeap heap({.chunk_bytes = 2_MiB, .keep_idle = 8_MiB, .granularity = 256});
  EXPECT_EQ(heap.guard(), 256U);
  char* chunk = fake_chunk(50);
  void* a = heap.allocate_in_new_chunk(chunk, 2_MiB, 768, kUntagged, kUntagged);
  EXPECT_EQ(a, chunk + 256);
  void* b = heap.allocate(256, kUntagged);
  EXPECT_EQ(b, chunk + 256 + 768) << "768-byte blocks pack at 256-byte steps";
  ThreadHeap::Returned out;
  heap.deallocate(a, 768, kUntagged, out);
  heap.deallocate(b, 256, kUntagged, out);
  EXPECT_EQ(out.block, nullptr) << "kept: within keep_idle";
  ThreadHeap::Returned idle[2];
  ASSERT_EQ(heap.take_idle(idle, 2), 1U);
  EXPECT_EQ(idle[0].pieces[0].bytes, 256U);
  EXPECT_EQ(pieces_bytes(idle[0]), 2_MiB);
}

TEST(LargeBlockCacheKeeping, StopsKeepingWhenSizesDoNotComeBackAndStartsWhenTheyDo) {
  detail::LargeBlockCache cache;
  using detail::LargeBlockCache;
  EXPECT_TRUE(cache.keeps());
  bool stopped = false;
  for (std::uint32_t i = 0; i < LargeBlockCache::kWindow; ++i) {
    stopped = cache.note_request(i % 16 == 0);  // 4 hits in 64: under one in 8
  }
  EXPECT_TRUE(stopped) << "told at the window's end, to drain";
  EXPECT_FALSE(cache.keeps());
  // Not keeping: fresh sizes go past it and never come back.
  for (std::size_t i = 0; i < LargeBlockCache::kWindow; ++i) {
    const std::size_t bytes = (i + 100) << 20;
    EXPECT_FALSE(cache.would_hit(bytes));
    EXPECT_FALSE(cache.note_request(cache.would_hit(bytes)));
    cache.note_passed(nullptr, bytes);
  }
  EXPECT_FALSE(cache.keeps());
  // Sizes that come back: keeping again after one window.
  for (std::size_t i = 0; i < LargeBlockCache::kWindow; ++i) {
    const std::size_t bytes = ((i % 4) + 1) << 20;
    EXPECT_FALSE(cache.note_request(cache.would_hit(bytes)));
    cache.note_passed(nullptr, bytes);
  }
  EXPECT_TRUE(cache.keeps());
}

// ---- in a pool ---------------------------------------------------------------------------

DevicePool::Options heap_options(bool virtual_memory = false) {
  DevicePool::Options options;
  options.validate_deallocations = false;
  options.large_tier.memory =
      virtual_memory ? LargeTierMemory::virtual_memory : LargeTierMemory::segments;
  options.large_tier.virtual_reservation_bytes = 4_GiB;
  options.large_tier.virtual_map_ahead_bytes = 0;
  options.thread_cache.large_from_start = true;  // the heap from the first large request
  return options;
}

std::size_t fresh_size(std::mt19937_64& random, std::size_t max_bytes,
                       std::size_t min_bytes = 2_MiB) {
  std::uniform_real_distribution<double> draw(std::log(min_bytes), std::log(max_bytes));
  return static_cast<std::size_t>(std::exp(draw(random)));
}

// Owner words at both ends of a block (host memory): a block handed to two owners at once
// is seen when the first checks its words.
void stamp(void* block, std::size_t bytes, std::uint64_t word) {
  std::memcpy(block, &word, sizeof word);
  std::memcpy(static_cast<char*>(block) + bytes - sizeof word, &word, sizeof word);
}
bool stamped(const void* block, std::size_t bytes, std::uint64_t word) {
  std::uint64_t front = 0;
  std::uint64_t back = 0;
  std::memcpy(&front, block, sizeof front);
  std::memcpy(&back, static_cast<const char*>(block) + bytes - sizeof back, sizeof back);
  return front == word && back == word;
}

// A pool with nothing leased: trim(0) gives every byte back.
void expect_trimmed_to_nothing(DevicePool& pool) {
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_reserved, 0U);
  EXPECT_EQ(pool.stats().bytes_cached_in_thread_heaps, 0U);
}

// After the pool: the upstream got every byte back, each once.
void expect_all_back(const TestUpstream& upstream) {
  EXPECT_EQ(upstream.live_bytes(), 0U);
  EXPECT_EQ(upstream.bad_frees(), 0U);
}

TEST(DevicePoolThreadHeap, AThreadAloneOnTheLargeTierHasNoHeap) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = heap_options();
  options.thread_cache.large_from_start = false;
  DevicePool pool(upstream, options);
  std::mt19937_64 random(1);
  for (int i = 0; i < 200; ++i) {
    const std::size_t bytes = fresh_size(random, 32_MiB);
    pool.deallocate(pool.allocate(bytes), bytes);
    ASSERT_EQ(pool.stats().bytes_cached_in_threads, 0U) << "nothing held back for the thread";
  }
}

struct Live {
  void* block;
  std::size_t bytes;
  std::uint64_t word;
};

// A thread's bins hold thread_cache.max_bytes while it is alone and the larger of that and
// contended_max_bytes once its heaps are on (it met other threads), so fresh sizes stay in its
// own bins instead of the shared rings; contended_max_bytes 0 keeps max_bytes.
std::uint64_t cached_after_fresh_small_blocks(DevicePool& pool) {
  std::vector<std::pair<void*, std::size_t>> blocks;
  for (std::size_t k = 0; k < 32; ++k) {  // 16 KiB to 264 KiB: about 4.6 MiB over 16 classes
    const std::size_t bytes = 16_KiB + k * 8_KiB;
    blocks.emplace_back(pool.allocate(bytes), bytes);
  }
  for (const auto& [block, bytes] : blocks) pool.deallocate(block, bytes);
  const DevicePoolStats s = pool.stats();  // the bins' bytes (not the heaps' free bytes)
  return s.bytes_cached_in_threads - s.bytes_cached_in_thread_heaps;
}

TEST(DevicePoolThreadHeap, ABinsByteBoundRisesToContendedMaxBytesOnceItsHeapsAreOn) {
  for (const std::size_t contended : {std::size_t{0}, 512_KiB, 4_MiB}) {
    SCOPED_TRACE("contended_max_bytes " + std::to_string(contended));
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    auto options = heap_options();
    options.thread_cache.large_from_start = false;  // the heaps start below, on purpose
    options.thread_cache.blocks = 16;
    options.thread_cache.max_bytes = 1_MiB;
    options.thread_cache.contended_max_bytes = contended;
    {
      DevicePool pool(upstream, options);
      const std::uint64_t alone = cached_after_fresh_small_blocks(pool);
      EXPECT_GT(alone, 0U);
      EXPECT_LE(alone, 1_MiB);
      pool.trim(0);
      // Its heaps turn on with the first large request (large_from_start), as when it meets
      // another thread on the large tier.
      options.thread_cache.large_from_start = true;
      DevicePool met(upstream, options);
      met.deallocate(met.allocate(4_MiB), 4_MiB);
      met.trim(0);  // the large block's cache is empty again; the heaps stay on
      ASSERT_EQ(met.stats().bytes_cached_in_threads, 0U);
      const std::uint64_t contending = cached_after_fresh_small_blocks(met);
      if (contended <= 1_MiB) {  // never below max_bytes
        EXPECT_GT(contending, 512_KiB);
        EXPECT_LE(contending, 1_MiB);
      } else {  // filled up to the bound, less than the next block
        EXPECT_GT(contending, contended - 512_KiB);
        EXPECT_LE(contending, contended);
      }
      expect_trimmed_to_nothing(met);
      expect_trimmed_to_nothing(pool);
    }
    expect_all_back(*upstream);
  }
}

// A thread that adopts the cache of one whose heaps were on starts alone again: its bins hold
// max_bytes until it, too, meets other threads.
TEST(DevicePoolThreadHeap, AnAdoptedCachesBinsStartAtMaxBytesAgain) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = heap_options();  // large_from_start: the first large request starts the heaps
  options.thread_cache.blocks = 16;
  options.thread_cache.max_bytes = 1_MiB;
  options.thread_cache.contended_max_bytes = 4_MiB;
  {
    DevicePool pool(upstream, options);
    std::uint64_t first = 0;
    std::thread([&] {
      pool.deallocate(pool.allocate(4_MiB), 4_MiB);
      pool.trim(0);
      first = cached_after_fresh_small_blocks(pool);
    }).join();  // its cache is parked at its exit, emptied
    EXPECT_GT(first, 1_MiB);
    std::uint64_t second = 0;
    std::thread([&] { second = cached_after_fresh_small_blocks(pool); }).join();
    EXPECT_GT(second, 0U);
    EXPECT_LE(second, 1_MiB);
    expect_trimmed_to_nothing(pool);
  }
  expect_all_back(*upstream);
}

TEST(DevicePoolThreadHeap, FreshSizesOnOneThreadStopGrowingOnceItsChunksAreTaken) {
  for (const bool virtual_memory : {false, true}) {
    SCOPED_TRACE(virtual_memory ? "virtual memory" : "segments");
    auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
    std::uint64_t grown_after_warmup = 0;
    {
      DevicePool pool(upstream, heap_options(virtual_memory));
      std::mt19937_64 random(2);
      std::vector<Live> live;
      std::uint64_t word = 0;
      std::uint64_t reserved_after_warmup = 0;
      for (int batch = 0; batch < 300; ++batch) {
        if (batch == 50) reserved_after_warmup = pool.stats().peak_bytes_reserved;
        for (int i = 0; i < 16; ++i) {
          const std::size_t bytes = fresh_size(random, 16_MiB);
          void* block = pool.allocate(bytes);
          stamp(block, bytes, ++word);
          live.push_back({block, bytes, word});
        }
        std::shuffle(live.begin(), live.end(), random);
        for (const Live& l : live) {
          ASSERT_TRUE(stamped(l.block, l.bytes, l.word)) << "a block had two owners";
          pool.deallocate(l.block, l.bytes);
        }
        live.clear();
      }
      const DevicePoolStats stats = pool.stats();
      grown_after_warmup = stats.peak_bytes_reserved - reserved_after_warmup;
      EXPECT_EQ(stats.bytes_in_use, 0U);
      EXPECT_GT(stats.bytes_cached_in_thread_heaps, 0U) << "the heap keeps its idle chunks";
      EXPECT_EQ(stats.invalid_deallocations, 0U);
      pool.trim(0);
      EXPECT_EQ(pool.stats().bytes_cached_in_threads, 0U) << "trim takes every idle chunk";
      EXPECT_EQ(pool.stats().bytes_reserved, 0U);
    }
    // 16 blocks of at most 16 MiB live: the chunks cover them after a few batches; a later
    // peak comes only from an unlucky batch, never from chunks piling up.
    EXPECT_LE(grown_after_warmup, 64_MiB);
    EXPECT_EQ(upstream->live_bytes(), 0U);
    EXPECT_EQ(upstream->bad_frees(), 0U);
  }
}

TEST(DevicePoolThreadHeap, ABlockDeallocatedOnAnotherThreadGoesBackToItsHeapOnce) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  {
    DevicePool pool(upstream, heap_options());
    pool.deallocate(pool.allocate(2_MiB), 2_MiB);  // the first large request starts the heap
    void* a = pool.allocate(6_MiB);
    void* b = pool.allocate(3_MiB);
    stamp(a, 6_MiB, 1);
    std::thread([&] {
      pool.deallocate(a, 6_MiB);
      pool.deallocate(a, 6_MiB);  // a double deallocation, on the other thread
      pool.deallocate(b, 5_MiB);  // another size
    }).join();
    EXPECT_EQ(pool.stats().invalid_deallocations, 2U);
    EXPECT_EQ(pool.stats().bytes_in_use, 3_MiB) << "b is still leased";
    void* c = pool.allocate(6_MiB);
    EXPECT_EQ(c, a) << "back in the first thread's heap, best fit again";
    std::thread([&] { pool.deallocate(b, 3_MiB); }).join();
    pool.deallocate(c, 6_MiB);
    expect_trimmed_to_nothing(pool);
  }
  expect_all_back(*upstream);
}

// Sizes that repeat keep the cache of exact sizes in front of the heap (no lock at all);
// a block it holds is still refused when another thread deallocates it again.
TEST(DevicePoolThreadHeap, RepeatedSizesAreServedByTheCacheOfExactSizesInFrontOfTheHeap) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  {
    DevicePool pool(upstream, heap_options());
    pool.deallocate(pool.allocate(2_MiB), 2_MiB);  // the heaps start
    void* first = pool.allocate(5_MiB);
    pool.deallocate(first, 5_MiB);
    EXPECT_GE(pool.stats().bytes_cached_in_threads - pool.stats().bytes_cached_in_thread_heaps,
              5_MiB)
        << "held by exact size";
    for (int i = 0; i < 200; ++i) {
      void* again = pool.allocate(5_MiB);
      ASSERT_EQ(again, first);
      pool.deallocate(again, 5_MiB);
    }
    std::thread([&] { pool.deallocate(first, 5_MiB); }).join();  // cached: a double one
    EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
    void* other = pool.allocate(5_MiB);
    EXPECT_EQ(other, first) << "still the thread's to hand out, once";
    void* second = pool.allocate(5_MiB);
    EXPECT_NE(second, first);
    std::thread([&] { pool.deallocate(other, 5_MiB); }).join();  // leased: revokes the record
    pool.deallocate(other, 5_MiB);                               // so this one is refused
    EXPECT_EQ(pool.stats().invalid_deallocations, 2U);
    pool.deallocate(second, 5_MiB);
    expect_trimmed_to_nothing(pool);
  }
  expect_all_back(*upstream);
}

// A chunk's own address (its first block less the guard), at the chunk's size, is no block:
// refused, and the chunk stays the heap's.
TEST(DevicePoolThreadHeap, AChunksOwnAddressIsRefusedAndTheChunkStaysTheHeaps) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  {
    DevicePool pool(upstream, heap_options());
    pool.deallocate(pool.allocate(2_MiB), 2_MiB);  // the heap starts
    char* a = static_cast<char*>(pool.allocate(6_MiB));
    stamp(a, 6_MiB, 42);
    const std::size_t chunk = 14_MiB;  // twice 6 MiB and the guard, rounded to 2 MiB
    pool.deallocate(a - 512, chunk);
    EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
    void* b = nullptr;
    std::thread([&] { b = pool.allocate(chunk); }).join();
    EXPECT_NE(b, a - 512) << "the chunk was handed out again while a is live";
    EXPECT_TRUE(stamped(a, 6_MiB, 42));
    std::thread([&] { pool.deallocate(b, chunk); }).join();
    pool.deallocate(a, 6_MiB);
    expect_trimmed_to_nothing(pool);
  }
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// Every chunk slot taken: the tier serves the thread's requests, still filed with its cache
// of exact sizes as their owner, so a second deallocation on another thread is refused.
TEST(DevicePoolThreadHeap, WithEverySlotTakenADoubleDeallocationIsStillRefused) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  {
    auto options = heap_options();
    options.thread_cache.large_chunk_bytes = 2_MiB;  // small chunks: the slots fill
    DevicePool pool(upstream, options);
    const std::size_t n = 3_MiB / 2;
    std::vector<void*> live;
    for (int i = 0; i < 40; ++i) live.push_back(pool.allocate(n));
    void* x = live.back();
    live.pop_back();
    pool.deallocate(x, n);                               // into the cache of exact sizes
    std::thread([&] { pool.deallocate(x, n); }).join();  // a double deallocation
    EXPECT_EQ(pool.stats().invalid_deallocations, 1U);
    void* y = pool.allocate(n);
    void* z = nullptr;
    std::thread([&] { z = pool.allocate(n); }).join();
    EXPECT_NE(y, z) << "one block, two owners";
    std::thread([&] { pool.deallocate(z, n); }).join();
    pool.deallocate(y, n);
    for (void* p : live) pool.deallocate(p, n);
    expect_trimmed_to_nothing(pool);
  }
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// The calling thread's heap starts and serves `s` (kHeapStreak requests in a row on it), and
// sizes that do not come back stop the cache of exact sizes in front of the heap from keeping
// its blocks (kWindow).
void make_heap_stream(DevicePool& pool, cudaStream_t s) {
  pool.deallocate(pool.allocate(2_MiB), 2_MiB);  // the first large request starts the heap
  free_often_on(pool, s);  // a steady stream (a young one's blocks stay out of chunks)
  for (std::size_t i = 0; i < 2 * detail::LargeBlockCache::kWindow; ++i) {
    const std::size_t bytes = 3_MiB + i * 4_KiB;
    pool.deallocate_async(pool.allocate_async(bytes, s), bytes, s);
  }
}

TEST(DevicePoolThreadHeap, AStreamsFreedBlockServesOnlyThatStreamFromTheHeap) {
  auto fence = std::make_shared<StreamLifetimeFence>();
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = heap_options();
  options.fence = fence;
  {
    DevicePool pool(upstream, options);
    const cudaStream_t s1 = fence->create();
    const cudaStream_t s2 = fence->create();
    pool.deallocate(pool.allocate(2_MiB), 2_MiB);  // the first large request starts the heap
    free_often_on(pool, s1);  // a steady stream (a young one's blocks stay out of chunks)
    fence->synchronize(s1);
    // The heap serves a stream once the thread asked on it kHeapStreak times in a row.
    for (std::size_t i = 0; i < 17; ++i) {
      const std::size_t bytes = 3_MiB + i * 4_KiB;  // sizes that do not repeat: the heap's
      pool.deallocate_async(pool.allocate_async(bytes, s1), bytes, s1);
    }
    EXPECT_GT(pool.stats().bytes_cached_in_thread_heaps, 0U) << "s1's blocks are the heap's now";
    void* keep = pool.allocate_async(8_MiB, s1);
    void* a = pool.allocate_async(4_MiB, s1);
    std::atomic<bool> ran{false};
    fence->enqueue(s1, [&ran] { ran = true; });  // s1's work on `a`, queued, not run yet
    pool.deallocate_async(a, 4_MiB, s1);
    void* on_s2 = pool.allocate_async(4_MiB, s2);
    EXPECT_NE(on_s2, a) << "s1's work may still use it";
    void* plain = pool.allocate(4_MiB);
    EXPECT_NE(plain, a);
    // s1 may take its own range back at once, in stream order (the heap alone:
    // ThreadHeap.AStreamsFreedRangeServesOnlyThatStreamUntilItsChunkGoesBack).
    void* again = pool.allocate_async(4_MiB, s1);
    EXPECT_NE(again, on_s2);
    EXPECT_NE(again, plain);
    for (auto [block, bytes, stream] :
         {std::tuple{again, 4_MiB, s1}, {on_s2, 4_MiB, s2}, {keep, 8_MiB, s1}}) {
      pool.deallocate_async(block, bytes, stream);
    }
    pool.deallocate(plain, 4_MiB);
    fence->synchronize(s1);
    fence->synchronize(s2);
    EXPECT_TRUE(ran.load());
    fence->destroy(s1);
    fence->destroy(s2);
    expect_trimmed_to_nothing(pool);
  }
  EXPECT_EQ(fence->records_on_destroyed(), 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// A free on the heap's stream that leaves a chunk wholly free past keep_idle sends the chunk
// back to the tier under a marker recorded on that stream by the same call: once the
// stream's work before it has run, another stream's request takes the memory without a
// quiesce and without the tier growing; before, it does not take it.
TEST(DevicePoolThreadHeap, AChunkLeftWhollyFreeOnItsStreamGoesBackUnderAMarkerOfThatStream) {
  auto fence = std::make_shared<StreamLifetimeFence>();
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = heap_options();
  options.fence = fence;
  options.thread_cache.large_bytes = 32_MiB;  // keep_idle 32 MiB, blocks to 8 MiB
  {
    DevicePool pool(upstream, options);
    const cudaStream_t s1 = fence->create();
    const cudaStream_t s2 = fence->create();
    make_heap_stream(pool, s1);
    fence->synchronize(s1);
    std::vector<void*> blocks;
    auto size_of = [](std::size_t i) { return 7_MiB - i * 64_KiB; };
    for (std::size_t i = 0; i < 8; ++i) blocks.push_back(pool.allocate_async(size_of(i), s1));
    std::atomic<bool> ran{false};
    fence->enqueue(s1, [&ran] { ran = true; });  // s1's work on the blocks, not run yet
    const std::uint64_t markers = pool.stats().stream_markers;
    const std::uint64_t records = fence->records();
    for (std::size_t i = 0; i < blocks.size(); ++i)
      pool.deallocate_async(blocks[i], size_of(i), s1);
    ASSERT_GT(pool.stats().stream_markers, markers) << "a chunk went back under a marker";
    EXPECT_GT(fence->records(), records);
    // s2's request, whichever memory it lands in, gets none of the blocks' memory unless the
    // pool first waited for s1's work (StreamLifetimeFence::wait runs it) or quiesced.
    const std::uint64_t waits_before = fence->waits();
    const std::uint64_t quiesces_before = fence->quiesces();
    void* early = pool.allocate_async(7_MiB, s2);
    const bool waited = fence->waits() > waits_before || fence->quiesces() > quiesces_before;
    for (void* b : blocks) {
      const bool overlaps = static_cast<char*>(early) < static_cast<char*>(b) + 7_MiB &&
                            static_cast<char*>(b) < static_cast<char*>(early) + 7_MiB;
      EXPECT_TRUE(!overlaps || (waited && ran.load())) << "s1's work may still use it";
    }
    fence->synchronize(s1);  // the marker completes
    EXPECT_TRUE(ran.load());
    const std::uint64_t grown = upstream->allocations();
    const std::uint64_t quiesces = fence->quiesces();
    // What went back to the tier (not what s1's heap keeps) now serves s2 as it is.
    const DevicePoolStats now = pool.stats();
    const std::size_t in_tier = now.bytes_cached - now.bytes_cached_in_threads;
    std::vector<void*> on_s2;
    for (std::size_t taken = 7_MiB; taken <= in_tier / 2; taken += 7_MiB) {
      on_s2.push_back(pool.allocate_async(7_MiB, s2));
    }
    ASSERT_GE(on_s2.size(), 2U);
    EXPECT_EQ(upstream->allocations(), grown) << "no growth";
    EXPECT_EQ(fence->quiesces(), quiesces) << "no device-wide quiesce";
    const bool reused = std::any_of(on_s2.begin(), on_s2.end(), [&](void* a) {
      return std::any_of(blocks.begin(), blocks.end(), [a](void* b) {
        return static_cast<char*>(a) < static_cast<char*>(b) + 7_MiB &&
               static_cast<char*>(b) < static_cast<char*>(a) + 7_MiB;
      });
    });
    EXPECT_TRUE(reused) << "s2 runs in the memory s1's blocks had";
    for (void* b : on_s2) pool.deallocate_async(b, 7_MiB, s2);
    pool.deallocate_async(early, 7_MiB, s2);
    fence->synchronize(s2);
    fence->destroy(s1);
    fence->destroy(s2);
    expect_trimmed_to_nothing(pool);
  }
  EXPECT_EQ(fence->released(), fence->records()) << "every marker released once";
  EXPECT_EQ(fence->records_on_destroyed(), 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// A thread that runs the steps given to it one at a time, in order (its thread cache and heaps
// stay its own between steps); joined when it goes.
class StepThread {
 public:
  StepThread()
      : thread_([this] {
          for (std::unique_lock lock(mutex_);;) {
            cv_.wait(lock, [this] { return stop_ || step_; });
            if (!step_) return;
            step_();
            step_ = nullptr;
            cv_.notify_all();
          }
        }) {}
  ~StepThread() {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void run(std::function<void()> step) {
    std::unique_lock lock(mutex_);
    step_ = std::move(step);
    cv_.notify_all();
    cv_.wait(lock, [this] { return !step_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::function<void()> step_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members it reads exist
};

// A growth for another stream's request leaves a heap's wholly free chunk of its own stream
// there, and asks it back: at its thread's next deallocation on that stream the chunk goes to
// the tier under a marker of the stream, and once the stream's work before it ran, the other
// stream's next request takes that memory without the tier growing and without a quiesce. A
// chunk that held a block when the ask came stays with the heap.
TEST(DevicePoolThreadHeap, AGrowthAsksOtherHeapsForTheirIdleChunksWhichComeBackUnderAMarker) {
  auto fence = std::make_shared<StreamLifetimeFence>();
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = heap_options();
  options.fence = fence;
  {
    DevicePool pool(upstream, options);
    const cudaStream_t s1 = fence->create();
    const cudaStream_t s2 = fence->create();
    void* kept_live = nullptr;
    void* other = nullptr;
    {
      StepThread owner;  // its heap serves s1
      owner.run([&] {
        make_heap_stream(pool, s1);
        // A chunk with one block live, and another wholly free, kept.
        kept_live = pool.allocate_async(20_MiB, s1);
        other = pool.allocate_async(24_MiB, s1);  // more than the first chunk has left
        pool.deallocate_async(other, 24_MiB, s1);
      });
      const std::size_t idle_in_heaps = pool.stats().bytes_cached_in_thread_heaps;
      ASSERT_GE(idle_in_heaps, 24_MiB) << "the owner's heap keeps s1's chunks";
      std::atomic<bool> ran{false};
      fence->enqueue(s1, [&ran] { ran = true; });  // s1's work, queued, not run yet
      const std::uint64_t quiesces = fence->quiesces();
      // s2 asks for more than the tier holds: the tier grows, the owner's chunks stay.
      std::uint64_t grown = upstream->allocations();
      const std::size_t live = upstream->live_bytes();
      void* first = pool.allocate_async(6_MiB, s2);
      ASSERT_GT(upstream->allocations(), grown);
      ASSERT_LT(upstream->live_bytes() - live, 6_MiB + 16_MiB) << "`early` below needs more";
      EXPECT_EQ(pool.stats().bytes_cached_in_thread_heaps, idle_in_heaps) << "s1's, not s2's";
      const std::uint64_t markers = pool.stats().stream_markers;
      owner.run([&] { pool.deallocate_async(kept_live, 20_MiB, s1); });
      EXPECT_GT(pool.stats().stream_markers, markers) << "back under a marker of s1";
      const std::size_t after = pool.stats().bytes_cached_in_thread_heaps;
      EXPECT_LT(after, idle_in_heaps) << "the asked chunk went back";
      EXPECT_GE(after, 20_MiB) << "the chunk that held a block when asked stays";
      auto in_other = [&](const void* b, std::size_t bytes) {
        return static_cast<const char*>(b) < static_cast<const char*>(other) + 24_MiB &&
               static_cast<const char*>(other) < static_cast<const char*>(b) + bytes;
      };
      // Before s1's work ran, s2 gets none of that memory without waiting for it (more than
      // the tier's growth for s2 has left: it grew by less than 6 + 16 MiB).
      const std::uint64_t waits = fence->waits();
      void* early = pool.allocate_async(16_MiB, s2);
      const bool waited = fence->waits() > waits;  // a quiesce fails the check below
      EXPECT_TRUE(!in_other(early, 16_MiB) || (waited && ran.load())) << "s1's work may use it";
      fence->synchronize(s1);
      ASSERT_TRUE(ran.load());
      grown = upstream->allocations();
      void* second = pool.allocate_async(16_MiB, s2);
      EXPECT_EQ(upstream->allocations(), grown) << "s1's memory serves s2: no growth";
      EXPECT_EQ(fence->quiesces(), quiesces) << "no device-wide quiesce";
      EXPECT_TRUE(in_other(second, 16_MiB)) << "s2 runs in the memory s1's block had";
      pool.deallocate_async(first, 6_MiB, s2);
      for (void* b : {early, second}) pool.deallocate_async(b, 16_MiB, s2);
      fence->synchronize(s2);
    }
    fence->destroy(s1);
    fence->destroy(s2);
    expect_trimmed_to_nothing(pool);
  }
  EXPECT_EQ(fence->released(), fence->records()) << "every marker released once";
  EXPECT_EQ(fence->records_on_destroyed(), 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// Stream churn: a stream per four requests, then destroyed. No stream is the thread's
// steady one, so its blocks stay in the tier: nothing of a destroyed stream waits in a chunk.
TEST(DevicePoolThreadHeap, AThreadWithAStreamPerFewRequestsKeepsItsStreamsBlocksInTheTier) {
  auto fence = std::make_shared<StreamLifetimeFence>(/*recycle_handles=*/false);
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = heap_options();
  options.fence = fence;
  {
    DevicePool pool(upstream, options);
    pool.deallocate(pool.allocate(2_MiB), 2_MiB);  // the heap exists
    for (int round = 0; round < 50; ++round) {
      const cudaStream_t s = fence->create();
      void* blocks[4];
      for (void*& b : blocks) b = pool.allocate_async(3_MiB, s);
      for (void* b : blocks) pool.deallocate_async(b, 3_MiB, s);
      fence->synchronize(s);
      fence->destroy(s);
      ASSERT_EQ(pool.stats().bytes_cached_in_thread_heaps, 0U) << "no chunk holds a stream's range";
    }
    // Without a stream the heap still serves the thread.
    pool.deallocate(pool.allocate(3_MiB), 3_MiB);
    EXPECT_GT(pool.stats().bytes_cached_in_thread_heaps, 0U);
    pool.trim(0);
    EXPECT_EQ(pool.stats().bytes_reserved, 0U);
  }
  EXPECT_EQ(fence->records_on_destroyed(), 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// Small classes on the thread's own stream: what its bins do not hold goes to its heap over
// the small tier, not to the tier's mutex.
TEST(DevicePoolThreadHeap, SmallClassesOnTheThreadsStreamThatMissTheBinsUseItsSmallHeap) {
  auto fence = std::make_shared<StreamLifetimeFence>();
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = heap_options();
  options.fence = fence;
  options.thread_cache.max_bytes = 256_KiB;      // bins overflow at once
  options.thread_cache.contended_max_bytes = 0;  // also with the heaps on
  {
    DevicePool pool(upstream, options);
    const cudaStream_t s = fence->create();
    pool.deallocate(pool.allocate(2_MiB), 2_MiB);  // the heaps start
    std::mt19937_64 random(5);
    std::vector<Live> live;
    std::uint64_t word = 0;
    for (int round = 0; round < 40; ++round) {
      for (int i = 0; i < 32; ++i) {
        const std::size_t bytes = fresh_size(random, 512_KiB, 256);
        void* block = pool.allocate_async(bytes, s);
        stamp(block, bytes, ++word);
        live.push_back({block, bytes, word});
      }
      std::shuffle(live.begin(), live.end(), random);
      for (const Live& l : live) {
        ASSERT_TRUE(stamped(l.block, l.bytes, l.word));
        pool.deallocate_async(l.block, l.bytes, s);
      }
      live.clear();
    }
    EXPECT_GT(pool.stats().bytes_cached_in_thread_heaps, 0U);
    EXPECT_EQ(pool.stats().bytes_in_use, 0U);
    fence->synchronize(s);
    pool.trim(0);
    EXPECT_EQ(pool.stats().bytes_cached_in_thread_heaps, 0U);
    EXPECT_EQ(pool.stats().bytes_reserved, 0U);
    fence->destroy(s);
  }
  expect_all_back(*upstream);
}

// Stream churn where the driver hands a destroyed stream's handle to the next stream: the
// handle repeats, the stream behind it does not. The heap tells them apart by the stream's id
// and serves none of them.
TEST(DevicePoolThreadHeap, StreamsMadeAndDestroyedBehindOneHandleNeverBecomeTheHeapsStream) {
  auto fence = std::make_shared<StreamLifetimeFence>(/*recycle_handles=*/true);
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = heap_options();
  options.fence = fence;
  {
    DevicePool pool(upstream, options);
    pool.deallocate(pool.allocate(2_MiB), 2_MiB);  // the heap exists
    cudaStream_t first = nullptr;
    for (int round = 0; round < 100; ++round) {
      const cudaStream_t s = fence->create();
      if (round == 0) first = s;
      ASSERT_EQ(s, first) << "the emulated driver reuses the handle";
      void* blocks[4];
      for (std::size_t i = 0; i < 4; ++i) {
        blocks[i] = pool.allocate_async(3_MiB + i * 4_KiB, s);
      }
      for (std::size_t i = 0; i < 4; ++i) pool.deallocate_async(blocks[i], 3_MiB + i * 4_KiB, s);
      fence->synchronize(s);
      fence->destroy(s);
      ASSERT_EQ(pool.stats().bytes_cached_in_thread_heaps, 0U) << "round " << round;
    }
    pool.trim(0);
    EXPECT_EQ(pool.stats().bytes_reserved, 0U);
  }
  EXPECT_EQ(fence->ids_of_destroyed(), 0U) << "a destroyed stream was asked its id";
  EXPECT_EQ(fence->records_on_destroyed(), 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// One stream the thread keeps: its id never changes and the heap serves it past every check.
TEST(DevicePoolThreadHeap, AThreadsSteadyStreamStaysTheHeapsStreamPastItsIdentityChecks) {
  auto fence = std::make_shared<StreamLifetimeFence>();
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto options = heap_options();
  options.fence = fence;
  {
    DevicePool pool(upstream, options);
    const cudaStream_t s = fence->create();
    pool.deallocate(pool.allocate(2_MiB), 2_MiB);  // the heap exists
    free_often_on(pool, s);  // a steady stream (a young one's blocks stay out of chunks)
    fence->synchronize(s);
    for (std::size_t i = 0; i < 1000; ++i) {
      const std::size_t bytes = 3_MiB + (i % 97) * 4_KiB;
      pool.deallocate_async(pool.allocate_async(bytes, s), bytes, s);
    }
    EXPECT_GT(pool.stats().bytes_cached_in_thread_heaps, 0U) << "still the heap's";
    fence->synchronize(s);
    pool.trim(0);
    EXPECT_EQ(pool.stats().bytes_reserved, 0U);
    fence->destroy(s);
  }
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// The upstream holds room for one heap's chunks: another thread's request fits only once
// the idle chunks went back (the flush before a tier grows).
TEST(DevicePoolThreadHeap, IdleChunksGoBackBeforeAnotherThreadsRequestGrowsTheTier) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(),
                                                 TestUpstream::Options{.capacity_bytes = 96_MiB});
  auto options = heap_options();
  options.thread_cache.large_chunk_bytes = 64_MiB;
  DevicePool pool(upstream, options);
  std::thread([&] {
    std::vector<void*> blocks;
    for (int i = 0; i < 8; ++i) blocks.push_back(pool.allocate(6_MiB));
    for (void* block : blocks) pool.deallocate(block, 6_MiB);
  }).join();
  void* big = nullptr;
  EXPECT_NO_THROW(big = pool.allocate(80_MiB));
  if (big != nullptr) pool.deallocate(big, 80_MiB);
  pool.trim(0);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(DevicePoolThreadHeap, AnExitedThreadsHeapIsAdoptedAndItsBlocksStayValid) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  {
    DevicePool pool(upstream, heap_options());
    void* kept = nullptr;
    std::thread([&] {
      kept = pool.allocate(5_MiB);
      stamp(kept, 5_MiB, 7);
      void* gone = pool.allocate(9_MiB);
      pool.deallocate(gone, 9_MiB);
    }).join();
    std::thread([&] {
      void* next = pool.allocate(9_MiB);  // the adopted cache's heap serves it
      EXPECT_TRUE(stamped(kept, 5_MiB, 7));
      pool.deallocate(next, 9_MiB);
    }).join();
    EXPECT_TRUE(stamped(kept, 5_MiB, 7));
    pool.deallocate(kept, 5_MiB);
    EXPECT_EQ(pool.stats().invalid_deallocations, 0U);
    pool.trim(0);
    EXPECT_EQ(pool.stats().bytes_reserved, 0U);
  }
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

TEST(DevicePoolThreadHeap, APoolDestroyedWithHeapBlocksLeasedTakesThemBackLater) {
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Lease a;
  DevicePool::Lease b;
  {
    DevicePool pool(upstream, heap_options());
    a = pool.acquire(7_MiB);
    b = pool.acquire(3_MiB);
    pool.deallocate(pool.allocate(2_MiB), 2_MiB);  // something idle in the heap
    stamp(a.data(), 7_MiB, 11);
    ::testing::internal::CaptureStderr();
  }
  const std::string warning = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(warning.find("still leased"), std::string::npos) << warning;
  EXPECT_GT(upstream->live_bytes(), 0U) << "a and b are still leased";
  std::thread([&] { b.reset(); }).join();
  EXPECT_GT(upstream->live_bytes(), 0U);
  EXPECT_TRUE(stamped(a.data(), 7_MiB, 11));
  a.reset();  // the last: every chunk and segment back upstream
  expect_all_back(*upstream);
}

// Threads with fresh sizes (2-32 MiB, drawn for every block) keep blocks live, hand some
// to the next thread, which deallocates them, and check owner words at both ends of every
// block before it goes: a block handed to two owners, or a chunk going back while a block
// of it is leased, shows as a changed word. With heaps from the first request and with the
// default (a heap once a thread meets another on the large tier).
void run_threads_with_fresh_sizes(bool from_start, bool virtual_memory, bool on_streams) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 150;
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  auto fence = std::make_shared<StreamLifetimeFence>();
  std::atomic<std::uint64_t> bad_words{0};
  {
    auto options = heap_options(virtual_memory);
    options.thread_cache.large_from_start = from_start;
    options.thread_cache.large_chunk_bytes = 32_MiB;  // several chunks per thread
    options.fence = fence;
    DevicePool pool(upstream, options);
    std::vector<cudaStream_t> streams;
    for (int t = 0; t < kThreads; ++t) streams.push_back(on_streams ? fence->create() : nullptr);
    // Each thread's own stream (or none): a block goes back on the deallocating thread's.
    auto allocate = [&](std::size_t bytes, int t) {
      return on_streams ? pool.allocate_async(bytes, streams[static_cast<std::size_t>(t)])
                        : pool.allocate(bytes);
    };
    auto deallocate = [&](const Live& l, int t) {
      if (on_streams) {
        pool.deallocate_async(l.block, l.bytes, streams[static_cast<std::size_t>(t)]);
      } else {
        pool.deallocate(l.block, l.bytes);
      }
    };
    std::mutex handoff_mutex;
    std::vector<std::vector<Live>> handoffs(kThreads);
    std::atomic<int> finished{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 random(100 + static_cast<std::uint64_t>(t));
        std::uint64_t word = static_cast<std::uint64_t>(t + 1) << 48;
        std::vector<Live> live;
        for (int round = 0; round < kRounds; ++round) {
          for (int i = 0; i < 6; ++i) {
            // Small classes too (bins, rings, the small tier's heap), a third large.
            const std::size_t bytes =
                i % 3 == 0 ? fresh_size(random, 32_MiB) : fresh_size(random, 1_MiB, 256);
            void* block = allocate(bytes, t);
            stamp(block, bytes, ++word);
            live.push_back({block, bytes, word});
          }
          std::vector<Live> mine;
          {
            const std::lock_guard lock(handoff_mutex);
            mine.swap(handoffs[static_cast<std::size_t>(t)]);
          }
          for (const Live& l : mine) live.push_back(l);
          std::shuffle(live.begin(), live.end(), random);
          // Keep a few, hand one on, deallocate the rest.
          while (live.size() > 3) {
            const Live l = live.back();
            live.pop_back();
            if (!stamped(l.block, l.bytes, l.word)) bad_words.fetch_add(1);
            if (random() % 6 == 0) {
              const std::lock_guard lock(handoff_mutex);
              handoffs[static_cast<std::size_t>((t + 1) % kThreads)].push_back(l);
            } else {
              deallocate(l, t);
            }
          }
        }
        for (const Live& l : live) {
          if (!stamped(l.block, l.bytes, l.word)) bad_words.fetch_add(1);
          deallocate(l, t);
        }
        // Blocks handed to this thread after its last round: deallocated here until every
        // thread is done, so that none piles up.
        finished.fetch_add(1);
        for (bool last = false; !last;) {
          last = finished.load() == kThreads;
          std::vector<Live> mine;
          {
            const std::lock_guard lock(handoff_mutex);
            mine.swap(handoffs[static_cast<std::size_t>(t)]);
          }
          for (const Live& l : mine) {
            if (!stamped(l.block, l.bytes, l.word)) bad_words.fetch_add(1);
            deallocate(l, t);
          }
          std::this_thread::yield();
        }
      });
    }
    for (auto& thread : threads) thread.join();
    for (auto& list : handoffs) {
      for (const Live& l : list) {
        if (!stamped(l.block, l.bytes, l.word)) bad_words.fetch_add(1);
        pool.deallocate(l.block, l.bytes);
      }
    }
    const DevicePoolStats stats = pool.stats();
    EXPECT_EQ(stats.bytes_in_use, 0U);
    EXPECT_EQ(stats.acquires, stats.deallocations);
    EXPECT_EQ(stats.invalid_deallocations, 0U);
    for (cudaStream_t s : streams) {
      if (s != nullptr) fence->synchronize(s);
    }
    pool.trim(0);
    EXPECT_EQ(pool.stats().bytes_reserved, 0U);
    for (cudaStream_t s : streams) {
      if (s != nullptr) fence->destroy(s);
    }
  }
  EXPECT_EQ(bad_words.load(), 0U) << "a block had two owners";
  expect_all_back(*upstream);
}

TEST(DevicePoolThreadHeapThreads, FreshSizesAndHandoffsNeverGiveABlockTwoOwnersSegments) {
  run_threads_with_fresh_sizes(true, false, false);
  run_threads_with_fresh_sizes(false, false, false);
}

TEST(DevicePoolThreadHeapThreads, FreshSizesAndHandoffsNeverGiveABlockTwoOwnersVirtual) {
  run_threads_with_fresh_sizes(true, true, false);
  run_threads_with_fresh_sizes(false, true, false);
}

// Each thread on its own stream; a handed-over block goes back on the receiver's stream.
TEST(DevicePoolThreadHeapThreads, FreshSizesAndHandoffsOnEachThreadsStreamSegments) {
  run_threads_with_fresh_sizes(true, false, true);
  run_threads_with_fresh_sizes(false, false, true);
}

TEST(DevicePoolThreadHeapThreads, FreshSizesAndHandoffsOnEachThreadsStreamVirtual) {
  run_threads_with_fresh_sizes(true, true, true);
  run_threads_with_fresh_sizes(false, true, true);
}

}  // namespace
}  // namespace vram::testing
