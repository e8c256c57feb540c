// Capture routes (GraphRouting, src/device_pool/graph_routing.hpp): which graph pool a capture
// scope's stream, thread and capture send allocations to, one scope per stream, thread and pool.
// Host only; the threaded case runs under TSan in CI.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "device_pool/graph_routing.hpp"
#include "tier/stream_wants.hpp"

namespace vram::testing {
namespace {

using detail::GraphRouting;

cudaStream_t fake_stream(std::uintptr_t key) { return reinterpret_cast<cudaStream_t>(key); }

TEST(CaptureRoutes, StreamAndThreadRouteToThePool) {
  // The pool's word of call checks: the routes raise their flag bit and leave the others.
  constexpr std::uint64_t kFlag = std::uint64_t{1} << 63;
  constexpr std::uint64_t kOther = 0b101;
  std::atomic<std::uint64_t> word{kOther};
  GraphRouting routes(&word, kFlag);
  EXPECT_FALSE(routes.any());
  const auto me = std::this_thread::get_id();
  ASSERT_TRUE(routes.open(11, 0x100, fake_stream(0x100), me));
  EXPECT_TRUE(routes.any());
  EXPECT_EQ(word.load(), kFlag | kOther);
  EXPECT_EQ(routes.for_stream(0x100), 11U);
  EXPECT_EQ(routes.for_thread(me), 11U);
  EXPECT_FALSE(routes.for_stream(0x200).has_value());
  EXPECT_FALSE(routes.open(12, 0x100, fake_stream(0x100), std::thread::id{}));  // stream taken
  EXPECT_FALSE(routes.open(12, 0x200, fake_stream(0x200), me));  // the thread has a scope
  EXPECT_FALSE(routes.open(11, 0x300, fake_stream(0x300), std::thread::id{}));  // pool taken
  EXPECT_FALSE(routes.open_unrouted(11));                                       // pool taken
  EXPECT_FALSE(routes.close(12));  // no route of that pool
  routes.add(1);                   // another part (a graph pool, a sleep tag) keeps the flag raised
  EXPECT_TRUE(routes.close(11));
  EXPECT_FALSE(routes.any());
  EXPECT_EQ(word.load(), kFlag | kOther);
  word.fetch_and(~std::uint64_t{1});  // another owner of the word clears its bit meanwhile
  routes.add(-1);
  EXPECT_EQ(word.load(), std::uint64_t{0b100});
  EXPECT_FALSE(routes.for_thread(me).has_value());
}

TEST(CaptureRoutes, UnroutedRoutesMatchNoStreamOrThread) {
  GraphRouting routes;
  ASSERT_TRUE(routes.open_unrouted(21));
  ASSERT_TRUE(routes.open_unrouted(22));  // several hosts' captures at once
  EXPECT_TRUE(routes.any());
  EXPECT_FALSE(routes.for_thread(std::this_thread::get_id()).has_value());
  EXPECT_FALSE(routes.for_stream(GraphRouting::kNoStream).has_value());
  int asked = 0;
  EXPECT_FALSE(routes.for_capture(5, [&](cudaStream_t) { return ++asked, 5ULL; }).has_value());
  EXPECT_EQ(asked, 0);  // unrouted routes have no stream to ask
  EXPECT_TRUE(routes.close(21));
  EXPECT_TRUE(routes.close(22));
  EXPECT_FALSE(routes.any());
}

TEST(CaptureRoutes, StreamsOfTheSameCaptureRouteToTheScopesPool) {
  GraphRouting routes;
  ASSERT_TRUE(routes.open(31, 0x100, fake_stream(0x100), std::this_thread::get_id()));
  ASSERT_TRUE(routes.open(32, 0x200, fake_stream(0x200), std::thread::id{}));
  int asked = 0;
  const auto capture_of = [&](cudaStream_t s) {
    ++asked;
    return s == fake_stream(0x100) ? 7ULL : 9ULL;
  };
  EXPECT_EQ(routes.for_capture(9, capture_of), 32U);
  EXPECT_EQ(routes.for_capture(7, capture_of), 31U);
  EXPECT_FALSE(routes.for_capture(8, capture_of).has_value());
  EXPECT_FALSE(routes.for_capture(0, capture_of).has_value());  // no capture
  EXPECT_EQ(asked, 2);  // each route's capture is learned once
}

TEST(CaptureRoutesThreads, EachThreadSeesItsOwnRoute) {
  GraphRouting routes;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const auto me = std::this_thread::get_id();
      const auto stream = static_cast<GraphRouting::StreamKey>(0x1000 + t);
      const auto pool = static_cast<GraphRouting::PoolId>(t + 1);
      for (int i = 0; i < 500; ++i) {
        if (!routes.open(pool, stream, fake_stream(stream), me)) wrong.fetch_add(1);
        if (routes.for_thread(me) != pool) wrong.fetch_add(1);
        if (routes.for_stream(stream) != pool) wrong.fetch_add(1);
        if (!routes.close(pool)) wrong.fetch_add(1);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_FALSE(routes.any());
}

// The pool's word of call checks holds the routes' flag and the wanted streams' bits: scopes
// opening and closing on one thread while another wants and takes streams lose neither. When
// both stop, the flag says whether a route is open and the wanted bits are the streams'
// still wanted.
TEST(CaptureRoutesThreads, TheFlagAndTheWantedStreamsShareTheWordWithoutLosingEither) {
  constexpr std::uint64_t kFlag = std::uint64_t{1} << 63;
  std::atomic<std::uint64_t> word{0};
  GraphRouting routes(&word, kFlag);
  detail::StreamWants wants(word);
  std::atomic<bool> done{false};
  std::atomic<int> wrong{0};
  std::thread scopes([&] {
    for (int i = 0; i < 5000; ++i) {
      if (!routes.open(41, 0x100, fake_stream(0x100), std::this_thread::get_id())) ++wrong;
      if (!routes.close(41)) ++wrong;
    }
    if (!routes.open(41, 0x100, fake_stream(0x100), std::this_thread::get_id())) ++wrong;
    done.store(true);
  });
  const auto stream_at = [](std::uint64_t i) { return std::uintptr_t{0x7f0000001000} + i * 0x230; };
  for (std::uint64_t round = 0; !done.load() || round < 1000; ++round) {
    wants.want(stream_at(round % 64));
    EXPECT_TRUE(wants.take(stream_at(round % 64)));
  }
  scopes.join();
  EXPECT_EQ(wrong.load(), 0);
  wants.want(stream_at(5));
  EXPECT_EQ(word.load(), kFlag | detail::StreamWants::bit_of(stream_at(5)));
  EXPECT_TRUE(routes.close(41));
  EXPECT_EQ(word.load(), detail::StreamWants::bit_of(stream_at(5)));
}

}  // namespace
}  // namespace vram::testing
