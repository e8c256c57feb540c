// TierMutex (the segment tier's lock): mutual exclusion when contended, including while a
// holder sleeps (the waiters go to sleep on the futex and must all be woken in turn).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

#include "vram/detail/tier_mutex.hpp"

namespace vram::detail {
namespace {

TEST(TierMutex, TryLockFailsWhileHeld) {
  TierMutex mutex;
  ASSERT_TRUE(mutex.try_lock());
  EXPECT_FALSE(mutex.try_lock());
  mutex.unlock();
  EXPECT_TRUE(mutex.try_lock());
  mutex.unlock();
}

TEST(TierMutex, ContendedIncrementsAreExclusive) {
  TierMutex mutex;
  std::size_t counter = 0;  // plain: a lost update shows a broken lock
  constexpr int kThreads = 4;
  constexpr int kRounds = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kRounds; ++i) {
        std::lock_guard lock(mutex);
        const std::size_t seen = counter;
        if (i % 1000 == 0) std::this_thread::yield();  // holders that get preempted
        counter = seen + 1;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(counter, std::size_t{kThreads} * kRounds);
}

TEST(TierMutex, WaitersSleepAndWakeWhileAHolderBlocks) {
  TierMutex mutex;
  int inside = 0;
  int max_inside = 0;
  int entered = 0;
  std::vector<std::thread> threads;
  mutex.lock();  // the waiters spin out and sleep on the futex
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 5; ++i) {
        std::lock_guard lock(mutex);
        max_inside = std::max(max_inside, ++inside);
        std::this_thread::sleep_for(std::chrono::microseconds(200));  // blocks, as a map does
        --inside;
        ++entered;
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  mutex.unlock();
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(max_inside, 1);
  EXPECT_EQ(entered, 20);
  EXPECT_TRUE(mutex.try_lock());  // left free, with no sleeper marked
  mutex.unlock();
}

TEST(TierMutexThreads, AContendedLockIsCountedAndStillExclusive) {
  detail::TierMutex mutex;
  EXPECT_EQ(mutex.contentions(), 0U);
  mutex.lock();
  std::atomic<bool> inside{false};
  std::thread waiter([&] {
    mutex.lock();
    inside.store(true);
    mutex.unlock();
  });
  while (mutex.contentions() == 0) std::this_thread::yield();
  EXPECT_FALSE(inside.load()) << "the waiter got in while the lock was held";
  mutex.unlock();
  waiter.join();
  EXPECT_TRUE(inside.load());
  EXPECT_EQ(mutex.contentions(), 1U);
}

// A spinner takes the lock while a sleeper waits (barging) and no wake-up is lost: many
// threads, some holders blocking long enough that waiters sleep.
TEST(TierMutexThreads, SleepersAndSpinnersAllGetTheLockAndCountsStayExact) {
  detail::TierMutex mutex;
  std::uint64_t counter = 0;
  constexpr int kThreads = 8;
  constexpr int kRounds = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        std::lock_guard lock(mutex);
        ++counter;
        if (t == 0 && i % 200 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(counter, std::uint64_t{kThreads} * kRounds);
  EXPECT_TRUE(mutex.try_lock());
  mutex.unlock();
}

}  // namespace
}  // namespace vram::detail
