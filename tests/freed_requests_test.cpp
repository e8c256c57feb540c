// The plug-in's record of freed blocks' requested bytes (plugins/torch/freed_requests.hpp) on
// the host: the newest record overlapping a range wins, requests cut to the range and to the
// block, a free drops or cuts the records under its block, memory given back and recording
// turned off forget them, devices apart, the oldest records go first past the bound, and frees
// from many threads.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include "freed_requests.hpp"

namespace {

using vram_torch::FreedRequests;

struct Recording : FreedRequests {
  Recording() { set_recording(true); }
};

TEST(FreedRequests, AFreeRangeNamesTheRequestOfTheNewestBlockFreedInIt) {
  Recording freed;
  freed.note(0, 0x1000, 0x400, 300);
  freed.note(0, 0x2000, 0x400, 700);
  EXPECT_EQ(freed.last_in(0, 0x1000, 0x3000), 700u);  // 0x2000 was freed after 0x1000
  EXPECT_EQ(freed.last_in(0, 0x1000, 0x2000), 300u);  // the end is not in the range
  freed.note(0, 0x1000, 0x400, 100);                  // freed again, later
  EXPECT_EQ(freed.last_in(0, 0x1000, 0x3000), 100u);
  EXPECT_EQ(freed.last_in(0, 0x3000, 0x4000), 0u);  // nothing freed there
  EXPECT_EQ(freed.last_in(0, 0x0800, 0x1000), 0u);
  EXPECT_EQ(freed.last_in(0, 0x1000, 0x1000), 0u);  // an empty range
}

TEST(FreedRequests, ARequestIsCutToTheRange) {
  Recording freed;
  freed.note(0, 0x1000, 0x1000, 0x800);
  // Part of the block was handed out again: the free range left is shorter than the request.
  EXPECT_EQ(freed.last_in(0, 0x1000, 0x1200), 0x200u);
  EXPECT_EQ(freed.last_in(0, 0x0F00, 0x2000), 0x800u);
  // The head was handed out again: the rest names the requested bytes that lie in it.
  EXPECT_EQ(freed.last_in(0, 0x1600, 0x2000), 0x200u);
  EXPECT_EQ(freed.last_in(0, 0x1900, 0x2000), 0u);  // past the requested bytes
}

TEST(FreedRequests, ALaterFreeOverRecordsReplacesThemAlsoFromBeforeTheRange) {
  Recording freed;
  freed.note(0, 0x1000, 0x400, 1000);  // X
  // Y covers X's memory (handed out again and freed as part of Y) and begins before it.
  freed.note(0, 0x0E00, 0x4000, 0x3000);
  EXPECT_EQ(freed.size(0), 1u) << "X's record is inside Y's block: it goes";
  // Y's head was handed out again: the range left begins past Y's start.
  EXPECT_EQ(freed.last_in(0, 0x0F00, 0x4E00), 0x2F00u);
}

TEST(FreedRequests, MemoryGivenBackAndAClearedHistoryForgetTheirRecords) {
  Recording freed;
  freed.note(0, 0x1000, 0x400, 10);
  freed.note(0, 0x9000, 0x400, 20);
  freed.forget(0, 0x0000, 0x2000);  // a unit given back to the device
  EXPECT_EQ(freed.last_in(0, 0x0000, 0x2000), 0u) << "memory mapped there later is fresh";
  EXPECT_EQ(freed.last_in(0, 0x9000, 0xA000), 20u);
  // A record that begins before memory given back is cut to end where that memory begins.
  freed.note(0, 0x10000, 0x4000, 0x4000);
  freed.forget(0, 0x13000, 0x15000);
  EXPECT_EQ(freed.last_in(0, 0x13000, 0x15000), 0u);
  EXPECT_EQ(freed.last_in(0, 0x10000, 0x13000), 0x3000u);
  freed.set_recording(false);
  EXPECT_EQ(freed.last_in(0, 0x9000, 0xA000), 0u);
  EXPECT_EQ(freed.size(0), 0u);
  freed.note(0, 0x9000, 0x400, 20);  // not recording: nothing is kept
  EXPECT_EQ(freed.size(0), 0u);
  freed.set_recording(true);
  freed.note(0, 0x9000, 0x400, 20);
  EXPECT_EQ(freed.last_in(0, 0x9000, 0xA000), 20u);
}

TEST(FreedRequests, AFreeCutsTheRecordBeforeItAndARequestIsCutToItsBlock) {
  Recording freed;
  freed.note(0, 0x1000, 0x4000, 0x3000);  // A
  // A's head stays handed out; a block in A's middle is freed: A ends where it begins.
  freed.note(0, 0x3000, 0x400, 0x100);  // B
  EXPECT_EQ(freed.size(0), 2u);
  EXPECT_EQ(freed.last_in(0, 0x3000, 0x3400), 0x100u);  // B
  EXPECT_EQ(freed.last_in(0, 0x2800, 0x3000), 0x800u);  // A, cut to end at B
  EXPECT_EQ(freed.last_in(0, 0x3800, 0x5000), 0u);      // past B: A no longer names it
  freed.note(0, 0x8000, 0x100, 0x1000);                 // requested beyond the block
  EXPECT_EQ(freed.last_in(0, 0x8000, 0x9000), 0x100u);
}

TEST(FreedRequests, DevicesAreApartAndBadArgumentsNameNothing) {
  Recording freed;
  freed.note(1, 0x1000, 0x100, 42);
  EXPECT_EQ(freed.last_in(0, 0x0, 0x10000), 0u);
  EXPECT_EQ(freed.last_in(1, 0x0, 0x10000), 42u);
  freed.note(-1, 0x1000, 0x100, 7);  // ignored
  freed.note(1, 0x5000, 0, 7);       // no bytes: ignored
  EXPECT_EQ(freed.last_in(-1, 0x0, 0x10000), 0u);
  EXPECT_EQ(freed.last_in(5, 0x0, 0x10000), 0u);  // a device never seen
  EXPECT_EQ(freed.last_in(1, 0x5000, 0x6000), 0u);
  freed.forget(7, 0x0, 0x10000);  // a device never seen: nothing happens
  EXPECT_EQ(freed.size(1), 1u);
}

TEST(FreedRequests, PastItsBoundTheOldestRecordsGoFirst) {
  Recording freed;
  const std::size_t n = FreedRequests::kMaxEntries + 10;
  constexpr std::uintptr_t kApart = std::uintptr_t{1} << 20;  // more than any request here
  // High addresses first, then lower ones: the oldest are the highest.
  for (std::size_t i = 0; i < n; ++i) freed.note(0, (n - i) * kApart, kApart, i + 1);
  EXPECT_EQ(freed.size(0), FreedRequests::kMaxEntries);
  // The ten oldest (the highest addresses) are gone; the newest, lowest, stays named.
  EXPECT_EQ(freed.last_in(0, (n - 9) * kApart, (n + 1) * kApart), 0u);
  EXPECT_EQ(freed.last_in(0, 1 * kApart, 2 * kApart), n);
  EXPECT_EQ(freed.last_in(0, (n - 10) * kApart, (n - 9) * kApart), 11u);
  // Frees again and again at one address: the first adds a record (the oldest left, at
  // n - 10, goes), the others replace it.
  for (std::size_t i = 0; i < 3 * FreedRequests::kMaxEntries; ++i) freed.note(0, 0, 0x100, 5);
  EXPECT_EQ(freed.last_in(0, 0, 0x100), 5u);
  EXPECT_EQ(freed.size(0), FreedRequests::kMaxEntries);
  EXPECT_EQ(freed.last_in(0, (n - 10) * kApart, (n - 9) * kApart), 0u);
  EXPECT_EQ(freed.last_in(0, (n - 11) * kApart, (n - 10) * kApart), 12u);
  freed.note(0, (n + 5) * kApart, kApart, 77);  // one more: the oldest left, at n - 11, goes
  EXPECT_EQ(freed.last_in(0, (n - 11) * kApart, (n - 10) * kApart), 0u);
  EXPECT_EQ(freed.last_in(0, (n - 12) * kApart, (n - 11) * kApart), 13u);
  EXPECT_EQ(freed.last_in(0, (n + 5) * kApart, (n + 6) * kApart), 77u);
}

TEST(FreedRequests, FreesFromManyThreadsAreEachNamed) {
  Recording freed;
  constexpr int kThreads = 8;
  constexpr std::uintptr_t kPerThread = 2000;
  constexpr std::uintptr_t kApart = std::uintptr_t{1} << 20;  // more than any request here
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&freed, t] {
      for (std::uintptr_t i = 0; i < kPerThread; ++i) {
        const std::uintptr_t address = (static_cast<std::uintptr_t>(t) << 40) + i * kApart;
        freed.note(0, address, kApart, static_cast<std::size_t>(t) * 10000 + i + 1);
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
