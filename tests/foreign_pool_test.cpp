// The plug-in's pool over a MemPool's own allocator (plugins/torch/foreign_pool.hpp) on the
// host: PyTorch's segment sizes and cuts, reuse only on the segment's stream, segments back
// only whole, the listener's order, an allocator that fails, races with the release of free
// segments, and the pool's end.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "foreign_pool.hpp"

namespace {

using vram_torch::ForeignPool;
constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

cudaStream_t stream_n(std::uintptr_t n) { return reinterpret_cast<cudaStream_t>(n); }

// Host memory standing in for a MemPool's allocator; counts its calls, fails on demand.
struct CountingAllocator final : vram_torch::PoolAllocator {
  std::mutex mutex;                // the pool calls it from any thread, outside its own mutex
  std::vector<std::size_t> sizes;  // of each allocate that succeeded
  std::set<void*> live;
  int frees = 0;
  std::size_t fail_above = SIZE_MAX;  // live bytes past which it fails
  bool fail_by_null = false;
  std::size_t live_bytes = 0;
  std::vector<std::pair<void*, std::size_t>> made;
  void* allocate(std::size_t size, cudaStream_t) override {
    std::lock_guard lock(mutex);
    if (live_bytes + size > fail_above) {
      if (fail_by_null) return nullptr;
      throw std::runtime_error("out of memory");
    }
    void* p = std::aligned_alloc(512, size);
    if (p == nullptr) throw std::bad_alloc();
    sizes.push_back(size);
    live.insert(p);
    made.emplace_back(p, size);
    live_bytes += size;
    return p;
  }
  void deallocate(void* p) noexcept override {
    std::lock_guard lock(mutex);
    ++frees;
    for (const auto& [q, size] : made) {
      if (q == p) live_bytes -= size;
    }
    live.erase(p);
    std::free(p);
  }
};

struct Event {
  std::uintptr_t address;
  std::size_t bytes;
  bool made;
};

struct Fixture {
  std::shared_ptr<CountingAllocator> source = std::make_shared<CountingAllocator>();
  std::mutex events_mutex;
  std::vector<Event> events;
  std::shared_ptr<ForeignPool> pool = std::make_shared<ForeignPool>(
      ForeignPool::Id{1, 7}, source,
      [this](std::uintptr_t a, std::size_t b, cudaStream_t, bool made) {
        std::lock_guard lock(events_mutex);
        events.push_back({a, b, made});
      });
};

TEST(ForeignPool, RoundsAndSizesSegmentsAsPyTorchDoes) {
  EXPECT_EQ(ForeignPool::round(1), 512u);
  EXPECT_EQ(ForeignPool::round(513), 1024u);
  EXPECT_EQ(ForeignPool::segment_bytes(ForeignPool::round(MiB)), 2 * MiB);
  EXPECT_EQ(ForeignPool::segment_bytes(ForeignPool::round(MiB + 1)), 20 * MiB);
  EXPECT_EQ(ForeignPool::segment_bytes(ForeignPool::round(10 * MiB - 512)), 20 * MiB);
  EXPECT_EQ(ForeignPool::segment_bytes(ForeignPool::round(10 * MiB)), 10 * MiB);
  EXPECT_EQ(ForeignPool::segment_bytes(ForeignPool::round(11 * MiB)), 12 * MiB);
}

TEST(ForeignPool, AFreeBlockKeepsTheRequestOfTheBlockFreedLastIntoIt) {
  // PyTorch's snapshot: a freed block's requested bytes stay on the free block it leaves, also
  // once merged with a free neighbour before it.
  Fixture f;
  const auto a = f.pool->allocate(300 * KiB, stream_n(1));
  const auto b = f.pool->allocate(100 * KiB + 3, stream_n(1));
  ASSERT_NE(a.ptr, nullptr);
  ASSERT_NE(b.ptr, nullptr);
  ASSERT_EQ(f.pool->segment_count(), 1u);
  auto free_request = [&f](std::uintptr_t at) {
    for (const auto& segment : f.pool->segments()) {
      for (const auto& block : segment.blocks) {
        if (!block.live && block.address <= at && at < block.address + block.bytes) {
          return block.requested;
        }
      }
    }
    return std::size_t{SIZE_MAX};  // no free block there
  };
  EXPECT_TRUE(f.pool->deallocate(a.ptr));
  EXPECT_EQ(free_request(reinterpret_cast<std::uintptr_t>(a.ptr)), 300 * KiB);
  EXPECT_TRUE(f.pool->deallocate(b.ptr));  // joins a's block before it and the rest after it
  EXPECT_EQ(free_request(reinterpret_cast<std::uintptr_t>(a.ptr)), 100 * KiB + 3);
  // The head handed out again: the rest keeps that request (PyTorch's remainder does).
  const auto c = f.pool->allocate(50 * KiB, stream_n(1));
  ASSERT_EQ(c.ptr, a.ptr);
  EXPECT_EQ(free_request(reinterpret_cast<std::uintptr_t>(a.ptr) + 50 * KiB), 100 * KiB + 3);
  EXPECT_TRUE(f.pool->deallocate(c.ptr));
  std::size_t live_requested = 0;
  for (const auto& segment : f.pool->segments()) {
    for (const auto& block : segment.blocks) live_requested += block.live ? block.requested : 0;
  }
  EXPECT_EQ(live_requested, 0u);
}

TEST(ForeignPool, PacksSmallRequestsIntoTwoMiBSegments) {
  // PyTorch's test_mempool_with_allocator: two 1 MiB tensors share one 2 MiB segment, a third
  // needs a second one.
  Fixture f;
  const auto a = f.pool->allocate(MiB, stream_n(1));
  const auto b = f.pool->allocate(MiB, stream_n(1));
  ASSERT_NE(a.ptr, nullptr);
  ASSERT_NE(b.ptr, nullptr);
  EXPECT_EQ(a.bytes, MiB);
  EXPECT_EQ(static_cast<char*>(b.ptr), static_cast<char*>(a.ptr) + MiB);
  EXPECT_EQ(f.pool->segment_count(), 1u);
  const auto c = f.pool->allocate(MiB, stream_n(1));
  EXPECT_EQ(f.pool->segment_count(), 2u);
  EXPECT_EQ(f.source->sizes, (std::vector<std::size_t>{2 * MiB, 2 * MiB}));
  EXPECT_EQ(f.pool->reserved_bytes(), 4 * MiB);
  auto segments = f.pool->segments();  // by address
  ASSERT_EQ(segments.size(), 2u);
  if (segments[0].address != reinterpret_cast<std::uintptr_t>(a.ptr)) {
    std::swap(segments[0], segments[1]);
  }
  ASSERT_EQ(segments[0].address, reinterpret_cast<std::uintptr_t>(a.ptr));
  EXPECT_LT(segments[0].order, segments[1].order);
  ASSERT_EQ(segments[0].blocks.size(), 2u);
  EXPECT_TRUE(segments[0].blocks[0].live && segments[0].blocks[1].live);
  EXPECT_EQ(segments[0].blocks[0].requested, MiB);
  ASSERT_EQ(segments[1].blocks.size(), 2u);  // c and the free rest
  EXPECT_EQ(segments[1].blocks[0].address, reinterpret_cast<std::uintptr_t>(c.ptr));
  EXPECT_FALSE(segments[1].blocks[1].live);
  EXPECT_EQ(segments[1].blocks[1].bytes, MiB);
  EXPECT_TRUE(f.pool->deallocate(a.ptr));
  EXPECT_TRUE(f.pool->deallocate(b.ptr));
  EXPECT_TRUE(f.pool->deallocate(c.ptr));
  EXPECT_EQ(f.source->frees, 0) << "freed blocks stay cached";
  EXPECT_EQ(f.pool->segment_count(), 2u);
}

TEST(ForeignPool, ALargeBlockIsCutOnlyWhenMoreThanOneMiBRemains) {
  Fixture f;
  const auto a = f.pool->allocate(2 * MiB, stream_n(1));  // 20 MiB segment, 18 MiB rest
  EXPECT_EQ(a.bytes, 2 * MiB);
  EXPECT_TRUE(f.pool->deallocate(a.ptr));
  // The whole segment is one free block again; 19.5 MiB leaves 0.5 MiB: not cut.
  const auto b = f.pool->allocate(19 * MiB + 512 * KiB, stream_n(1));
  EXPECT_EQ(b.ptr, a.ptr);
  EXPECT_EQ(b.bytes, 20 * MiB);
  EXPECT_EQ(f.source->sizes.size(), 1u);
  // A small request never takes a large block.
  const auto c = f.pool->allocate(4 * KiB, stream_n(1));
  EXPECT_EQ(f.source->sizes.back(), 2 * MiB);
  EXPECT_TRUE(f.pool->deallocate(b.ptr));
  EXPECT_TRUE(f.pool->deallocate(c.ptr));
}

TEST(ForeignPool, ReusesAFreeBlockOnlyOnItsSegmentsStreamBestFitFirst) {
  Fixture f;
  const auto a = f.pool->allocate(64 * KiB, stream_n(1));
  const auto hold = f.pool->allocate(64 * KiB, stream_n(1));
  const auto b = f.pool->allocate(256 * KiB, stream_n(1));
  const auto hold2 = f.pool->allocate(64 * KiB, stream_n(1));
  EXPECT_TRUE(f.pool->deallocate(b.ptr));
  EXPECT_TRUE(f.pool->deallocate(a.ptr));
  // Another stream: a segment of its own, whatever is free on stream 1.
  const auto other = f.pool->allocate(64 * KiB, stream_n(2));
  EXPECT_EQ(f.pool->segment_count(), 2u);
  EXPECT_NE(other.ptr, a.ptr);
  // Stream 1: the smallest free block that fits (a's 64 KiB), not b's 256 KiB.
  const auto again = f.pool->allocate(60 * KiB, stream_n(1));
  EXPECT_EQ(again.ptr, a.ptr);
  EXPECT_EQ(again.bytes, 60 * KiB) << "the 4 KiB rest is cut off (at least 512 bytes)";
  for (const void* p : {again.ptr, hold.ptr, hold2.ptr, other.ptr}) {
    EXPECT_TRUE(f.pool->deallocate(const_cast<void*>(p)));
  }
}

TEST(ForeignPool, AFreedBlockJoinsItsFreeNeighboursAndTheSegmentGoesBackWhole) {
  Fixture f;
  const auto a = f.pool->allocate(512 * KiB, stream_n(1));
  const auto b = f.pool->allocate(512 * KiB, stream_n(1));
  const auto c = f.pool->allocate(512 * KiB, stream_n(1));
  EXPECT_TRUE(f.pool->deallocate(a.ptr));
  EXPECT_TRUE(f.pool->deallocate(c.ptr));
  EXPECT_EQ(f.pool->release_free(), 0u) << "b is live: the segment stays";
  EXPECT_TRUE(f.pool->deallocate(b.ptr));
  const auto segments = f.pool->segments();
  ASSERT_EQ(segments.size(), 1u);
  ASSERT_EQ(segments[0].blocks.size(), 1u);
  EXPECT_EQ(segments[0].blocks[0].bytes, 2 * MiB);
  EXPECT_EQ(f.pool->release_free(), 2 * MiB);
  EXPECT_EQ(f.source->frees, 1);
  EXPECT_TRUE(f.source->live.empty());
  EXPECT_EQ(f.pool->reserved_bytes(), 0u);
  // The listener heard of the segment made, then of it going back, with its bytes.
  ASSERT_EQ(f.events.size(), 2u);
  EXPECT_TRUE(f.events[0].made);
  EXPECT_FALSE(f.events[1].made);
  EXPECT_EQ(f.events[1].address, reinterpret_cast<std::uintptr_t>(a.ptr));
  EXPECT_EQ(f.events[1].bytes, 2 * MiB);
}

TEST(ForeignPool, RefusesAPointerItDidNotHandOutOrOneFreedTwice) {
  Fixture f;
  const auto a = f.pool->allocate(4 * KiB, stream_n(1));
  int other = 0;
  EXPECT_FALSE(f.pool->deallocate(&other));
  EXPECT_FALSE(f.pool->deallocate(static_cast<char*>(a.ptr) + 512)) << "inside a block";
  EXPECT_TRUE(f.pool->deallocate(a.ptr));
  EXPECT_FALSE(f.pool->deallocate(a.ptr)) << "freed twice";
  const auto b = f.pool->allocate(4 * KiB, stream_n(1));
  EXPECT_EQ(b.ptr, a.ptr);
  EXPECT_TRUE(f.pool->deallocate(b.ptr));
}

TEST(ForeignPool, AnAllocatorThatFailsReachesTheCallerAndTheCachedSegmentsStay) {
  // A free segment of a pool in use may be baked into a captured graph: a failed request
  // never gives it back (PyTorch's rule too).
  for (const bool by_null : {false, true}) {
    Fixture f;
    f.source->fail_by_null = by_null;
    f.source->fail_above = 24 * MiB;
    const auto big = f.pool->allocate(20 * MiB, stream_n(1));
    EXPECT_TRUE(f.pool->deallocate(big.ptr));  // cached, whole
    if (by_null) {
      EXPECT_EQ(f.pool->allocate(10 * MiB, stream_n(2)).ptr, nullptr);
    } else {
      EXPECT_THROW(f.pool->allocate(10 * MiB, stream_n(2)), std::runtime_error);
    }
    EXPECT_EQ(f.source->frees, 0);
    EXPECT_EQ(f.pool->segment_count(), 1u);
    EXPECT_EQ(f.events.size(), 1u) << "no segment was told of for the failed request";
    // The cached segment still serves its stream.
    const auto again = f.pool->allocate(20 * MiB, stream_n(1));
    EXPECT_EQ(again.ptr, big.ptr);
    EXPECT_TRUE(f.pool->deallocate(again.ptr));
  }
}

TEST(ForeignPool, TheListenerHearsOfASegmentBeforeItIsFiledAndOfEachAtThePoolsEnd) {
  auto source = std::make_shared<CountingAllocator>();
  std::vector<Event> events;
  std::vector<std::size_t> filed_when_heard;
  ForeignPool* self = nullptr;
  {
    auto pool = std::make_shared<ForeignPool>(
        ForeignPool::Id{1, 2}, source,
        [&](std::uintptr_t a, std::size_t b, cudaStream_t, bool made) {
          events.push_back({a, b, made});
          filed_when_heard.push_back(self->segment_count());
        });
    self = pool.get();
    const auto a = pool->allocate(100, stream_n(1));
    const auto b = pool->allocate(12 * MiB, stream_n(1));
    EXPECT_EQ(filed_when_heard, (std::vector<std::size_t>{0, 1}));
    EXPECT_TRUE(pool->deallocate(a.ptr));
    EXPECT_TRUE(pool->deallocate(b.ptr));
  }
  ASSERT_EQ(events.size(), 4u);
  EXPECT_TRUE(events[0].made && events[1].made);
  EXPECT_FALSE(events[2].made || events[3].made);
  EXPECT_EQ(events[0].bytes + events[1].bytes, events[2].bytes + events[3].bytes);
  EXPECT_EQ(source->frees, 2);
}

TEST(ForeignPool, AListenerThatThrowsChangesNothing) {
  auto source = std::make_shared<CountingAllocator>();
  {
    ForeignPool pool({1, 3}, source,
                     [](std::uintptr_t, std::size_t, cudaStream_t, bool) { throw 1; });
    const auto a = pool.allocate(100, stream_n(1));
    ASSERT_NE(a.ptr, nullptr);
    EXPECT_TRUE(pool.deallocate(a.ptr));
    EXPECT_EQ(pool.release_free(), 2 * MiB);
    const auto b = pool.allocate(100, stream_n(1));
    EXPECT_TRUE(pool.deallocate(b.ptr));
  }
  EXPECT_TRUE(source->live.empty());
}

TEST(ForeignPool, ThreadsRacingTheReleaseOfFreeSegmentsLoseNothing) {
  auto source = std::make_shared<CountingAllocator>();
  std::mutex mutex;
  std::map<std::uintptr_t, bool> made_last;  // each address: made and given back in turn
  int out_of_turn = 0;
  auto pool = std::make_shared<ForeignPool>(
      ForeignPool::Id{1, 4}, source, [&](std::uintptr_t a, std::size_t, cudaStream_t, bool made) {
        std::lock_guard lock(mutex);
        auto [it, first] = made_last.try_emplace(a, !made);
        if (it->second == made) ++out_of_turn;
        it->second = made;
      });
  std::atomic<bool> stop{false};
  std::thread releaser([&] {
    while (!stop.load()) pool->release_free();
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 3000; ++i) {
        const std::size_t size = (std::size_t(i * 7919 + t) % (3 * MiB)) + 1;
        const auto g = pool->allocate(size, stream_n(std::uintptr_t(i % 2) + 1));
        static_cast<unsigned char*>(g.ptr)[g.bytes - 1] = 1;
        EXPECT_TRUE(pool->deallocate(g.ptr));
      }
    });
  }
  for (auto& th : threads) th.join();
  stop = true;
  releaser.join();
  pool->release_free();
  EXPECT_EQ(pool->segment_count(), 0u);
  EXPECT_EQ(pool->reserved_bytes(), 0u);
  EXPECT_TRUE(source->live.empty());
  EXPECT_EQ(out_of_turn, 0);
}

TEST(ForeignPool, ItsEndGivesEverySegmentBack) {
  auto source = std::make_shared<CountingAllocator>();
  {
    ForeignPool pool({1, 1}, source);
    const auto a = pool.allocate(3 * KiB, stream_n(1));
    const auto b = pool.allocate(30 * MiB, stream_n(1));
    EXPECT_TRUE(pool.deallocate(a.ptr));
    EXPECT_TRUE(pool.deallocate(b.ptr));
    EXPECT_EQ(source->live.size(), 2u);
  }
  EXPECT_TRUE(source->live.empty());
  EXPECT_EQ(source->frees, 2);
}

TEST(ForeignPool, ThreadsOnTheirOwnStreamsNeverShareABlock) {
  Fixture f;
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<int> overlaps(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<ForeignPool::Given> held;
      for (int i = 0; i < 2000; ++i) {
        const std::size_t size = (std::size_t(i * 7919 + t * 104729) % (3 * MiB)) + 1;
        held.push_back(f.pool->allocate(size, stream_n(std::uintptr_t(t) + 1)));
        auto* p = static_cast<unsigned char*>(held.back().ptr);
        p[0] = static_cast<unsigned char>(t);
        p[held.back().bytes - 1] = static_cast<unsigned char>(t);
        if (held.size() > 8) {
          for (const auto& g : held) {
            const auto* q = static_cast<unsigned char*>(g.ptr);
            if (q[0] != t || q[g.bytes - 1] != t) ++overlaps[t];
          }
          for (const auto& g : held) f.pool->deallocate(g.ptr);
          held.clear();
        }
      }
      for (const auto& g : held) f.pool->deallocate(g.ptr);
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(overlaps[t], 0) << "thread " << t;
  f.pool->release_free();
  EXPECT_EQ(f.pool->segment_count(), 0u);
  EXPECT_TRUE(f.source->live.empty());
}

}  // namespace
