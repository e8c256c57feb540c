// The plug-in's record of freed blocks' requested bytes (plugins/torch/freed_requests.hpp) on
// the host: the block freed last in a range wins, a request is cut at the range's end, devices
// apart, the bound on records, bad devices, and frees from many threads.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include "freed_requests.hpp"

namespace {

using vram_torch::FreedRequests;

TEST(FreedRequests, AFreeRangeNamesTheRequestOfTheBlockFreedLastInIt) {
  FreedRequests freed;
  freed.note(0, 0x1000, 300);
  freed.note(0, 0x2000, 700);
  EXPECT_EQ(freed.last_in(0, 0x1000, 0x3000), 700u);  // 0x2000 was freed after 0x1000
  EXPECT_EQ(freed.last_in(0, 0x1000, 0x2000), 300u);  // the end is not in the range
  freed.note(0, 0x1000, 100);                         // freed again, later
  EXPECT_EQ(freed.last_in(0, 0x1000, 0x3000), 100u);
  EXPECT_EQ(freed.last_in(0, 0x3000, 0x4000), 0u);  // nothing freed there
  EXPECT_EQ(freed.last_in(0, 0x0800, 0x1000), 0u);
}

TEST(FreedRequests, ARequestIsCutAtTheEndOfTheRange) {
  FreedRequests freed;
  freed.note(0, 0x1000, 0x800);
  // Part of the block was handed out again: the free range left ends before the request.
  EXPECT_EQ(freed.last_in(0, 0x1000, 0x1200), 0x200u);
  EXPECT_EQ(freed.last_in(0, 0x0F00, 0x2000), 0x800u);
}

TEST(FreedRequests, DevicesAreApartAndBadDevicesNameNothing) {
  FreedRequests freed;
  freed.note(1, 0x1000, 42);
  EXPECT_EQ(freed.last_in(0, 0x0, 0x10000), 0u);
  EXPECT_EQ(freed.last_in(1, 0x0, 0x10000), 42u);
  freed.note(-1, 0x1000, 7);  // ignored
  EXPECT_EQ(freed.last_in(-1, 0x0, 0x10000), 0u);
  EXPECT_EQ(freed.last_in(5, 0x0, 0x10000), 0u);  // a device never seen
}

TEST(FreedRequests, KeepsAtMostItsBoundPerDeviceDroppingTheLowestAddresses) {
  FreedRequests freed;
  const std::size_t n = FreedRequests::kMaxEntries + 10;
  constexpr std::uintptr_t kApart = std::uintptr_t{1} << 20;  // more than any request here
  for (std::size_t i = 0; i < n; ++i) freed.note(0, kApart + i * kApart, i + 1);
  // The ten lowest addresses are gone; the rest are named.
  EXPECT_EQ(freed.last_in(0, kApart, kApart + 10 * kApart), 0u);
  EXPECT_EQ(freed.last_in(0, kApart + 10 * kApart, kApart + 11 * kApart), 11u);
  EXPECT_EQ(freed.last_in(0, kApart, kApart + n * kApart), n);
}

TEST(FreedRequests, FreesFromManyThreadsAreEachNamed) {
  FreedRequests freed;
  constexpr int kThreads = 8;
  constexpr std::uintptr_t kPerThread = 2000;
  constexpr std::uintptr_t kApart = std::uintptr_t{1} << 20;  // more than any request here
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&freed, t] {
      for (std::uintptr_t i = 0; i < kPerThread; ++i) {
        const std::uintptr_t address = (static_cast<std::uintptr_t>(t) << 40) + i * kApart;
        freed.note(0, address, static_cast<std::size_t>(t) * 10000 + i + 1);
        (void)freed.last_in(0, address, address + kApart);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    const std::uintptr_t base = static_cast<std::uintptr_t>(t) << 40;
    for (std::uintptr_t i = 0; i < kPerThread; i += 199) {
      EXPECT_EQ(freed.last_in(0, base + i * kApart, base + (i + 1) * kApart),
                static_cast<std::size_t>(t) * 10000 + i + 1);
    }
  }
}

}  // namespace
