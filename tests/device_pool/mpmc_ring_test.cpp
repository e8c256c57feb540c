#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "vram/detail/mpmc_ring.hpp"

namespace vram::detail {
namespace {

TEST(MpmcRing, FifoWithinCapacity) {
  MpmcRing<int> ring(4);
  EXPECT_EQ(ring.capacity(), 4U);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(ring.try_push(i));
  EXPECT_FALSE(ring.try_push(99));
  int value = -1;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(ring.try_pop(value));
    EXPECT_EQ(value, i);
  }
  EXPECT_FALSE(ring.try_pop(value));
  EXPECT_EQ(ring.pushes(), 4U);
  EXPECT_EQ(ring.pops(), 4U);
}

TEST(MpmcRing, ManyProducersAndConsumersLoseAndDuplicateNothing) {
  MpmcRing<std::uint64_t> ring(64);
  constexpr int kProducers = 4;
  constexpr int kPerProducer = 20000;
  std::atomic<std::uint64_t> sum{0};
  std::atomic<int> consumed{0};
  std::vector<std::thread> threads;
  for (int p = 0; p < kProducers; ++p) {
    threads.emplace_back([&, p] {
      for (int i = 1; i <= kPerProducer; ++i) {
        while (!ring.try_push(static_cast<std::uint64_t>(p) * 1000000 + i))
          std::this_thread::yield();
      }
    });
  }
  for (int c = 0; c < kProducers; ++c) {
    threads.emplace_back([&] {
      std::uint64_t value = 0;
      while (consumed.load() < kProducers * kPerProducer) {
        if (ring.try_pop(value)) {
          sum += value;
          ++consumed;
        } else {
          std::this_thread::yield();
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  std::uint64_t expected = 0;
  for (int p = 0; p < kProducers; ++p) {
    for (int i = 1; i <= kPerProducer; ++i) expected += static_cast<std::uint64_t>(p) * 1000000 + i;
  }
  EXPECT_EQ(sum.load(), expected);
  EXPECT_EQ(ring.size(), 0U);
}

}  // namespace
}  // namespace vram::detail
