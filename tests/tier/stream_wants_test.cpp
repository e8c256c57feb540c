// StreamWants (src/tier/stream_wants.hpp): the streams whose marker another stream's request
// wants, published as bits of a word whose other bits belong to its owner (a DevicePool's
// call checks). Host only; the threaded case runs under TSan in CI.
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <cstdint>
#include <thread>

#include "tier/stream_key.hpp"
#include "tier/stream_wants.hpp"

namespace vram::testing {
namespace {

using detail::StreamKey;
using detail::StreamWants;

constexpr std::uint64_t kOwnerBits = ~StreamWants::kMask;

// A caller stream's key (as stream_key() names a created stream: its handle's address).
StreamKey stream_at(std::uint64_t i) { return 0x7f0000001000 + i * 0x230; }

// Every wanted stream's bit is one of the wants' own bits; the streams that are always
// recordable (no stream, the legacy stream) have none; streams reach every one of them.
TEST(StreamWants, AStreamsBitIsOneOfTheWantsOwnBits) {
  std::uint64_t seen = 0;
  for (std::uint64_t i = 0; i < 4096; ++i) {
    const std::uint64_t bit = StreamWants::bit_of(stream_at(i));
    ASSERT_EQ(std::popcount(bit), 1) << i;
    ASSERT_EQ(bit & kOwnerBits, 0U) << i;
    seen |= bit;
  }
  EXPECT_EQ(seen, StreamWants::kMask);  // 4,096 streams reach every one of the 62 bits
  EXPECT_EQ(StreamWants::bit_of(detail::kUntagged), 0U);
  EXPECT_EQ(StreamWants::bit_of(detail::stream_key(cudaStreamLegacy)), 0U);
}

// want, take and clear set and clear the wanted streams' bits and leave the owner's bits as
// they are, set or clear.
TEST(StreamWants, WantsChangeOnlyTheirOwnBitsOfTheWord) {
  for (const std::uint64_t owner : {std::uint64_t{0}, kOwnerBits, std::uint64_t{1} << 63}) {
    std::atomic<std::uint64_t> word{owner};
    StreamWants wants(word);
    const StreamKey a = stream_at(1);
    const StreamKey b = stream_at(2);
    wants.want(a);
    EXPECT_EQ(word.load(), owner | StreamWants::bit_of(a));
    wants.want(b);
    EXPECT_EQ(word.load(), owner | StreamWants::bit_of(a) | StreamWants::bit_of(b));
    EXPECT_TRUE(wants.take(a));
    EXPECT_FALSE(wants.take(a));  // taken once
    EXPECT_EQ(word.load(), owner | StreamWants::bit_of(b));
    wants.clear();
    EXPECT_EQ(word.load(), owner);
    EXPECT_EQ(wants.wanted(), 2U);
  }
}

// The owner sets and clears its bit while another thread wants and takes streams: when both
// stop, the owner's bit is what the owner last wrote and the wants' bits are those of the
// streams still wanted.
TEST(StreamWantsThreads, TheOwnersBitSurvivesWantsOnOtherThreads) {
  constexpr std::uint64_t kFlag = std::uint64_t{1} << 63;
  std::atomic<std::uint64_t> word{0};
  StreamWants wants(word);
  std::atomic<bool> stop{false};
  std::thread owner([&] {
    for (int i = 0; i < 20000; ++i) {
      if (i % 2 == 0) {
        word.fetch_or(kFlag, std::memory_order_relaxed);
      } else {
        word.fetch_and(~kFlag, std::memory_order_relaxed);
      }
    }
    word.fetch_or(kFlag, std::memory_order_relaxed);
    stop.store(true);
  });
  std::uint64_t round = 0;
  while (!stop.load() || round < 1000) {
    const StreamKey key = stream_at(round++ % 64);
    wants.want(key);
    EXPECT_TRUE(wants.take(key));
  }
  owner.join();
  wants.want(stream_at(7));
  EXPECT_EQ(word.load(), kFlag | StreamWants::bit_of(stream_at(7)));
}

}  // namespace
}  // namespace vram::testing
