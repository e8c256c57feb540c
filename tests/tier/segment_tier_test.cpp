// SegmentTier (DevicePool's segment tiers): best fit, split and coalesce, wholly free
// segments given back, stream tags released only after a fence, and the virtual-memory
// mode over the host emulation (granules mapped where blocks live, unmapped on trim).
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "test_upstreams.hpp"
#include "tier/segment_tier.hpp"
#include "tier/stream_wants.hpp"
#include "vram/units.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;
using detail::kUntagged;
using detail::SegmentTier;

struct TierFixture {
  explicit TierFixture(SegmentTier::Options options = {}, std::size_t capacity = SIZE_MAX)
      : upstream(std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>(),
                                                TestUpstream::Options{.capacity_bytes = capacity})),
        tier(*upstream, fence, gauge, options) {}
  std::shared_ptr<TestUpstream> upstream;
  ManualFence fence;
  detail::ReservedGauge gauge;
  SegmentTier tier;
};

SegmentTier::Options two_mib_segments() {
  return {.granularity = 512, .packed_segment = 2_MiB, .packed_limit = 2_MiB};
}

TEST(SegmentTier, SplitsBestFitAndCoalesces) {
  TierFixture f(two_mib_segments());
  char* a = static_cast<char*>(f.tier.allocate(512_KiB, kUntagged, true));
  char* b = static_cast<char*>(f.tier.allocate(512_KiB, kUntagged, true));
  char* c = static_cast<char*>(f.tier.allocate(256_KiB, kUntagged, true));
  EXPECT_EQ(f.upstream->allocations(), 1U);  // one segment, split three times
  EXPECT_EQ(b, a + 512_KiB);
  EXPECT_EQ(c, b + 512_KiB);
  ASSERT_TRUE(f.tier.free(b, kUntagged));
  // Free: b's hole (512 KiB) and the tail (768 KiB). Best fit for 384 KiB is the hole.
  char* d = static_cast<char*>(f.tier.allocate(384_KiB, kUntagged, true));
  EXPECT_EQ(d, b);
  ASSERT_TRUE(f.tier.free(a, kUntagged));
  ASSERT_TRUE(f.tier.free(d, kUntagged));
  // a + d + the rest of b's hole merged into one 1 MiB range at a.
  char* e = static_cast<char*>(f.tier.allocate(1_MiB, kUntagged, false));
  EXPECT_EQ(e, a);
  EXPECT_FALSE(f.tier.free(a + 512, kUntagged)) << "not a block: refused, nothing changed";
  ASSERT_TRUE(f.tier.free(e, kUntagged));
  ASSERT_TRUE(f.tier.free(c, kUntagged));
  const auto counters = f.tier.counters();
  EXPECT_EQ(counters.reserved, 2_MiB);
  EXPECT_EQ(counters.free_bytes, 2_MiB);  // one whole free range again
  EXPECT_EQ(f.tier.allocate(2_MiB, kUntagged, false), a);
}

TEST(SegmentTier, WhollyFreeSegmentsGoBackBeforeGrowingAndOnTrim) {
  TierFixture f(two_mib_segments());
  void* a = f.tier.allocate(1536_KiB, kUntagged, true);
  ASSERT_TRUE(f.tier.free(a, kUntagged));
  EXPECT_EQ(f.upstream->live_bytes(), 2_MiB);           // cached
  void* big = f.tier.allocate(3_MiB, kUntagged, true);  // fits no free range
  EXPECT_EQ(f.upstream->frees(), 1U);                   // the free 2 MiB segment went back first
  EXPECT_EQ(f.upstream->live_bytes(), 4_MiB);           // 3 MiB rounded up to 2 MiB
  EXPECT_EQ(f.gauge.reserved.load(), 4_MiB);
  EXPECT_EQ(f.gauge.peak.load(), 4_MiB);
  ASSERT_TRUE(f.tier.free(big, kUntagged));
  f.tier.trim(0, false);
  EXPECT_EQ(f.upstream->live_bytes(), 0U);
  EXPECT_EQ(f.gauge.reserved.load(), 0U);
}

TEST(SegmentTier, StreamTaggedRangesServeTheirStreamAtOnceOthersAfterTheFence) {
  TierFixture f(two_mib_segments());
  const auto s1 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  const auto s2 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
  char* a = static_cast<char*>(f.tier.allocate(1_MiB, s1, true));
  char* filler = static_cast<char*>(f.tier.allocate(1_MiB, s1, true));  // the segment is full
  ASSERT_TRUE(f.tier.free(a, s1));
  EXPECT_EQ(f.tier.allocate(1_MiB, s1, false), a) << "same stream: reused at once";
  ASSERT_TRUE(f.tier.free(a, s1));
  EXPECT_EQ(f.tier.allocate(1_MiB, kUntagged, false), nullptr)
      << "s1's work may still use it: not for any stream yet";
  EXPECT_EQ(f.fence.recorded(), 1U) << "a marker was recorded on s1 when another caller needed it";
  // A whole new segment, so that afterwards a is the only free range that fits.
  char* other = static_cast<char*>(f.tier.allocate(2_MiB, s2, true));
  EXPECT_NE(other, a);
  f.fence.complete_all();
  EXPECT_EQ(f.tier.allocate(1_MiB, s2, false), a) << "after the fence: any stream";
  ASSERT_TRUE(f.tier.free(a, kUntagged));
  ASSERT_TRUE(f.tier.free(other, kUntagged));
  ASSERT_TRUE(f.tier.free(filler, kUntagged));
}

// A heap's chunk back in pieces under a marker of one stream, in a tier that wants markers
// (as a DevicePool's): that stream's largest piece waits for the marker, then serves any
// stream; another stream's piece serves its stream at once; the marked stream's other piece
// keeps its tag (no marker covers it: another stream's request wants one).
TEST(SegmentTier, AChunksLargestPieceOfTheMarkedStreamWaitsForTheMarkerTheOthersKeepTheirTags) {
  std::atomic<std::uint64_t> wanted_bits{0};
  detail::StreamWants wants(wanted_bits);
  auto options = two_mib_segments();
  options.wants = &wants;
  TierFixture f(options);
  const auto s1 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  const auto s2 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
  char* chunk = static_cast<char*>(
      f.tier.allocate(2_MiB, kUntagged, true, nullptr, &detail::LeaseOwner::heap_chunks()));
  ASSERT_NE(chunk, nullptr);
  const SegmentTier::Piece pieces[] = {
      {512, kUntagged}, {1536_KiB - 512, s1}, {256_KiB, s2}, {256_KiB, s1}};
  SegmentTier::FreeMarker marker{.marker = f.fence.record(nullptr), .recorder = &f};
  ASSERT_NE(f.tier.free_pieces(chunk, 2_MiB, pieces, 4, &marker, s1), SegmentTier::Freed::foreign);
  EXPECT_TRUE(marker.taken);
  EXPECT_EQ(f.tier.allocate(1_MiB, s2, false), nullptr)
      << "s1's largest piece waits for the marker";
  EXPECT_EQ(f.tier.allocate(256_KiB, s2, false), chunk + 1536_KiB) << "s2's own piece at once";
  f.fence.complete(marker.marker);
  // Untagged now, it merged with the guard before it: the chunk's first 1.5 MiB.
  EXPECT_EQ(f.tier.allocate(1536_KiB, s2, false), chunk) << "the marker completed: any stream";
  EXPECT_EQ(f.tier.allocate(256_KiB, s2, false), nullptr) << "s1's other piece keeps its tag";
  EXPECT_TRUE(wants.take(s1)) << "other streams' requests want a marker on s1 for it";
  EXPECT_EQ(f.fence.recorded(), 1U) << "the tier recorded nothing of its own";
  ASSERT_TRUE(f.tier.free(chunk, kUntagged));
  ASSERT_TRUE(f.tier.free(chunk + 1536_KiB, kUntagged));
  f.tier.forget_streams(f.tier.mark_frees());  // as after a device-wide quiesce
  f.tier.trim(0, false);
  EXPECT_EQ(f.upstream->live_bytes(), 0U);
}

// Its own stream takes its pending piece back before the marker completes (stream order).
TEST(SegmentTier, AChunksPieceUnderAMarkerServesItsOwnStreamAtOnce) {
  TierFixture f(two_mib_segments());
  const auto s1 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  char* chunk = static_cast<char*>(
      f.tier.allocate(2_MiB, kUntagged, true, nullptr, &detail::LeaseOwner::heap_chunks()));
  const SegmentTier::Piece pieces[] = {{512, kUntagged}, {2_MiB - 512, s1}};
  SegmentTier::FreeMarker marker{.marker = f.fence.record(nullptr), .recorder = &f};
  ASSERT_NE(f.tier.free_pieces(chunk, 2_MiB, pieces, 2, &marker, s1), SegmentTier::Freed::foreign);
  EXPECT_TRUE(marker.taken);
  EXPECT_EQ(f.tier.allocate(1_MiB, s1, false), chunk + 512);
  ASSERT_TRUE(f.tier.free(chunk + 512, kUntagged));
  f.fence.complete_all();
  f.tier.trim(0, false);
  EXPECT_EQ(f.upstream->live_bytes(), 0U);
}

// More streams than the tier keeps emptied per-stream indices for (its free-range indices
// are created, emptied, kept or erased as ranges come and go): each stream still gets back
// exactly its own range at once, and no other stream's.
TEST(SegmentTier, ManyStreamsEachReuseTheirOwnRangesWhileIndicesComeAndGo) {
  TierFixture f(two_mib_segments());
  constexpr int kStreams = 8;
  char* blocks[kStreams];
  detail::StreamKey keys[kStreams];
  for (int i = 0; i < kStreams; ++i) {
    blocks[i] = static_cast<char*>(f.tier.allocate(256_KiB, kUntagged, true));
    keys[i] = detail::stream_key(reinterpret_cast<cudaStream_t>(std::uintptr_t{0x100} * (i + 1)));
  }
  EXPECT_EQ(f.upstream->allocations(), 1U);  // the 2 MiB segment, full
  for (int round = 0; round < 4; ++round) {
    for (int k = 0; k < kStreams; ++k) {  // freed in a different order each round
      const int i = (k * 3 + round) % kStreams;
      ASSERT_TRUE(f.tier.free(blocks[i], keys[i]));
    }
    for (int k = 0; k < kStreams; ++k) {
      const int i = (k * 5 + round) % kStreams;
      EXPECT_EQ(f.tier.allocate(256_KiB, keys[i], false), blocks[i])
          << "round " << round << " stream " << i;
    }
  }
  EXPECT_EQ(f.fence.recorded(), 0U) << "each stream found its own range: nothing fenced";
  for (int i = 0; i < kStreams; ++i) ASSERT_TRUE(f.tier.free(blocks[i], keys[i]));
  // Another stream needs them: every stream is fenced; after the markers, one whole range.
  EXPECT_EQ(f.tier.allocate(2_MiB, kUntagged, false), nullptr);
  EXPECT_EQ(f.fence.recorded(), static_cast<std::size_t>(kStreams));
  f.fence.complete_all();
  EXPECT_EQ(f.tier.allocate(2_MiB, kUntagged, false), blocks[0]);
  ASSERT_TRUE(f.tier.free(blocks[0], kUntagged));
  EXPECT_EQ(f.tier.counters().free_bytes, 2_MiB);
}

SegmentTier::Options virtual_options(VirtualMemory& vm) {
  return {.granularity = 512, .virtual_memory = &vm, .reservation = 1_GiB};
}

// An emulated device (capacity_bytes of "physical" memory behind HostVirtualMemory), a
// fence and a gauge for a virtual-mode SegmentTier.
struct VirtualTierParts {
  explicit VirtualTierParts(std::size_t capacity_bytes = SIZE_MAX)
      : upstream(std::make_shared<TestUpstream>(
            std::make_shared<HostMemoryUpstream>(),
            TestUpstream::Options{.capacity_bytes = capacity_bytes})),
        vm(upstream) {}
  std::shared_ptr<TestUpstream> upstream;
  HostVirtualMemory vm;
  ManualFence fence;
  detail::ReservedGauge gauge;
};

TEST(SegmentTierVirtual, GranulesAreMappedWhereBlocksLiveAndUnmappedOnTrim) {
  VirtualTierParts parts;
  auto& upstream = parts.upstream;
  {
    SegmentTier tier(*upstream, parts.fence, parts.gauge, virtual_options(parts.vm));
    char* a = static_cast<char*>(tier.allocate(3_MiB, kUntagged, true));
    char* b = static_cast<char*>(tier.allocate(3_MiB, kUntagged, true));
    EXPECT_EQ(b, a + 3_MiB) << "one address range: blocks are contiguous";
    EXPECT_EQ(upstream->live_bytes(), 6_MiB) << "three 2 MiB granules cover 6 MiB";
    std::memset(a, 0xAB, 6_MiB);  // mapped memory is usable
    ASSERT_TRUE(tier.free(a, kUntagged));
    ASSERT_TRUE(tier.free(b, kUntagged));
    // Freed ranges merge across what separate segments could never merge.
    char* c = static_cast<char*>(tier.allocate(6_MiB, kUntagged, false));
    EXPECT_EQ(c, a);
    ASSERT_TRUE(tier.free(c, kUntagged));
    tier.trim(0, false);
    EXPECT_EQ(upstream->live_bytes(), 0U) << "every free granule unmapped";
    EXPECT_EQ(parts.gauge.reserved.load(), 0U);
    EXPECT_EQ(tier.counters().maps, 2U) << "a's granules in one run, b's new one in another";
  }
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

// Granules are mapped in runs (one physical allocation, one map, for the unmapped stretch
// under a block) and a run goes back only whole.
TEST(SegmentTierVirtual, RunsAreMappedOnceAndUnmappedOnlyWhenWhollyFree) {
  VirtualTierParts parts;
  auto& upstream = parts.upstream;
  {
    SegmentTier tier(*upstream, parts.fence, parts.gauge, virtual_options(parts.vm));
    char* big = static_cast<char*>(tier.allocate(64_MiB, kUntagged, true));
    EXPECT_EQ(tier.counters().maps, 1U) << "32 granules, one map";
    EXPECT_EQ(upstream->allocations(), 1U);
    std::memset(big, 0x5A, 64_MiB);
    char* a = static_cast<char*>(tier.allocate(3_MiB, kUntagged, true));  // a run of 2
    char* b = static_cast<char*>(tier.allocate(3_MiB, kUntagged, true));  // shares a's 2nd
    EXPECT_EQ(b, a + 3_MiB);
    EXPECT_EQ(tier.counters().maps, 3U);
    ASSERT_TRUE(tier.free(a, kUntagged));
    tier.trim(0, false);
    EXPECT_EQ(upstream->live_bytes(), 64_MiB + 6_MiB) << "a's run still holds b's first MiB";
    ASSERT_TRUE(tier.free(b, kUntagged));
    tier.trim(0, false);
    EXPECT_EQ(upstream->live_bytes(), 64_MiB) << "both runs wholly free: both went back";
    ASSERT_TRUE(tier.free(big, kUntagged));
    tier.trim(0, false);
    EXPECT_EQ(upstream->live_bytes(), 0U);
    EXPECT_EQ(tier.counters().upstream_frees, 3U);
  }
  EXPECT_EQ(upstream->bad_frees(), 0U);
}

TEST(SegmentTierVirtual, MapFailureUnmapsFreeGranulesAndRetriesOrLeavesNothingChanged) {
  VirtualTierParts parts(8_MiB);
  auto& upstream = parts.upstream;
  SegmentTier tier(*upstream, parts.fence, parts.gauge, virtual_options(parts.vm));
  void* a = tier.allocate(4_MiB, kUntagged, true);  // granules 0, 1
  void* b = tier.allocate(2_MiB, kUntagged, true);  // granule 2
  ASSERT_TRUE(tier.free(a, kUntagged));             // granules 0, 1 mapped and free
  // Past b: granules 3, 4, 5. The device holds 4 granules: 0 and 1 must be unmapped.
  void* c = tier.allocate(5_MiB, kUntagged, true);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(upstream->live_bytes(), 8_MiB);
  EXPECT_GE(tier.counters().failed_upstream_allocations, 1U);
  // a's old range fits 4 MiB but nothing can be mapped for it: OutOfMemory, no change.
  EXPECT_THROW((void)tier.allocate(4_MiB, kUntagged, true), OutOfMemory);
  const auto counters = tier.counters();
  EXPECT_EQ(counters.reserved, upstream->live_bytes());
  ASSERT_TRUE(tier.free(b, kUntagged));
  ASSERT_TRUE(tier.free(c, kUntagged));
  tier.trim(0, false);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

// A run goes back only whole, so one small block placed in a freed large block's run
// (best_fit prefers mapped ranges) pins the whole run: trim and the map-failure reclaim
// cannot give back the free granules around it. Runs are at most max_run_bytes and at most
// 1/16 of the physical memory still available, so near the end of memory they shrink to
// single granules: on a 16 MiB device the freed granules go back and a request that fits
// the device is served; on a large one the pinned run (one map, far from the end of
// memory) stays mapped.
TEST(SegmentTierVirtual, ASmallBlockInAFreedRunPinsItsRunOnlyFarFromTheEndOfMemory) {
  for (const std::size_t capacity : {16_MiB, 4_GiB}) {
    SCOPED_TRACE(capacity);
    VirtualTierParts parts(capacity);
    auto& upstream = parts.upstream;
    {
      SegmentTier::Options options = virtual_options(parts.vm);
      options.max_run_bytes = 64_MiB;
      SegmentTier tier(*upstream, parts.fence, parts.gauge, options);
      void* a = tier.allocate(12_MiB, kUntagged, true);  // granules 0-5
      void* x = tier.allocate(2_MiB, kUntagged, true);   // granule 6
      ASSERT_TRUE(tier.free(a, kUntagged));
      void* b = tier.allocate(2_MiB, kUntagged, true);  // best fit, mapped: granule 0
      EXPECT_EQ(b, a);
      tier.trim(0, false);
      if (capacity == 16_MiB) {
        EXPECT_EQ(tier.counters().maps, 7U) << "16 MiB free: runs of one granule";
        EXPECT_EQ(upstream->live_bytes(), 4_MiB) << "granules 1-5 are free: trim gives them back";
        void* c = nullptr;  // 2 + 2 + 12 MiB live fits the 16 MiB device
        EXPECT_NO_THROW(c = tier.allocate(12_MiB, kUntagged, true));
        if (c != nullptr) {
          ASSERT_TRUE(tier.free(c, kUntagged));
        }
      } else {
        EXPECT_EQ(tier.counters().maps, 2U) << "one run per block far from the end of memory";
        EXPECT_EQ(upstream->live_bytes(), 14_MiB) << "b pins its 12 MiB run, x its granule";
      }
      ASSERT_TRUE(tier.free(b, kUntagged));
      ASSERT_TRUE(tier.free(x, kUntagged));
      tier.trim(0, false);
      EXPECT_EQ(upstream->live_bytes(), 0U);
    }
    EXPECT_EQ(upstream->bad_frees(), 0U);
  }
}

// How long a run is: max_run_bytes, and 1/16 of the physical memory still available when
// the map is made (a map costs about the same from 2 MiB to 256 MiB, so long runs make
// filling an empty pool cheap; short ones near the end of memory can go back separately).
TEST(SegmentTierVirtual, RunsAreCappedByTheOptionAndByTheMemoryStillAvailable) {
  {
    VirtualTierParts parts;  // unknown capacity: only the option caps runs
    SegmentTier::Options options = virtual_options(parts.vm);
    options.max_run_bytes = 4_MiB;
    SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, options);
    void* a = tier.allocate(12_MiB, kUntagged, true);
    EXPECT_EQ(tier.counters().maps, 3U) << "12 MiB in runs of at most 4 MiB";
    ASSERT_TRUE(tier.free(a, kUntagged));
  }
  {
    VirtualTierParts parts(256_MiB);  // 256 MiB available: runs of at most 16 MiB
    SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, virtual_options(parts.vm));
    void* a = tier.allocate(64_MiB, kUntagged, true);
    EXPECT_EQ(tier.counters().maps, 4U) << "64 MiB in runs of 256/16 MiB";
    EXPECT_EQ(parts.upstream->live_bytes(), 64_MiB);
    // 192 MiB left: runs of 12 MiB; 24 MiB more is two of them.
    void* b = tier.allocate(24_MiB, kUntagged, true);
    EXPECT_EQ(tier.counters().maps, 6U);
    ASSERT_TRUE(tier.free(a, kUntagged));
    ASSERT_TRUE(tier.free(b, kUntagged));
    tier.trim(0, false);
    EXPECT_EQ(parts.upstream->live_bytes(), 0U);
  }
}

// Map-ahead (Options::map_ahead_bytes): a tier growing in many small steps maps the granules
// after a block with the map that block needs anyway, within its bounds: the extra mapped
// and free bytes stay under map_ahead_bytes and 1/4 of what the tier holds (plus the
// granule a block's end leaves partly free).
TEST(SegmentTierVirtual, MapAheadMakesFewMapsForManySmallStepsWithinItsBounds) {
  std::uint64_t maps[2] = {0, 0};
  for (const bool ahead : {false, true}) {
    SCOPED_TRACE(ahead);
    VirtualTierParts parts;
    SegmentTier::Options options = virtual_options(parts.vm);
    options.map_ahead_bytes = ahead ? 32_MiB : 0;
    SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, options);
    std::vector<void*> blocks;
    for (std::size_t i = 1; i <= 300; ++i) {  // 900 MiB in 3 MiB steps, all live
      blocks.push_back(tier.allocate(3_MiB, kUntagged, true));
      const std::size_t used = i * 3_MiB;
      const std::size_t held = parts.upstream->live_bytes();
      ASSERT_GE(held, used);
      const std::size_t bound = ahead ? std::min<std::size_t>(32_MiB, held / 4) + 2_MiB : 2_MiB;
      ASSERT_LE(held - used, bound) << "after block " << i;
    }
    maps[ahead ? 1 : 0] = tier.counters().maps;
    for (void* b : blocks) ASSERT_TRUE(tier.free(b, kUntagged));
    tier.trim(0, false);
    EXPECT_EQ(parts.upstream->live_bytes(), 0U);
  }
  EXPECT_EQ(maps[0], 300U) << "without map-ahead every 3 MiB block needs a map";
  EXPECT_LE(maps[1] * 8, maps[0]) << "with it: " << maps[1] << " maps";
}

// Map-ahead serves a workload that is still growing: a block that needs new granules while
// the tier's used bytes stay below their peak (its free memory is in the wrong places) maps
// only its own granules, which would otherwise stay reserved with nothing asking for them.
TEST(SegmentTierVirtual, MapAheadOnlyForBlocksThatRaiseThePeakOfUsedBytes) {
  VirtualTierParts parts;
  SegmentTier::Options options = virtual_options(parts.vm);
  options.map_ahead_bytes = 128_MiB;
  SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, options);
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(tier.allocate(16_MiB, kUntagged, true));
  // The granules mapped ahead after the last block: taken by one block, so nothing mapped
  // is free beyond the holes made below.
  const std::size_t tail = parts.upstream->live_bytes() - 128_MiB;
  ASSERT_GT(tail, 0U) << "the growing workload mapped ahead";
  void* filler = tier.allocate(tail, kUntagged, true);
  ASSERT_EQ(tier.counters().free_bytes, 0U);
  // Every other block freed: 16 MiB holes; used 64 MiB + tail, below the peak.
  for (std::size_t i = 0; i < blocks.size(); i += 2) ASSERT_TRUE(tier.free(blocks[i], kUntagged));
  std::size_t held = parts.upstream->live_bytes();
  void* grown = tier.allocate(24_MiB, kUntagged, true);  // fits no hole: new granules
  EXPECT_EQ(parts.upstream->live_bytes(), held + 24_MiB) << "below the peak: no map-ahead";
  // Past the peak of used bytes, a block maps ahead again.
  held = parts.upstream->live_bytes();
  void* past_peak = tier.allocate(80_MiB, kUntagged, true);
  EXPECT_GT(parts.upstream->live_bytes(), held + 80_MiB) << "map-ahead for a growing workload";
  ASSERT_TRUE(tier.free(past_peak, kUntagged));
  ASSERT_TRUE(tier.free(grown, kUntagged));
  ASSERT_TRUE(tier.free(filler, kUntagged));
  for (std::size_t i = 1; i < blocks.size(); i += 2) ASSERT_TRUE(tier.free(blocks[i], kUntagged));
  tier.trim(0, false);
  EXPECT_EQ(parts.upstream->live_bytes(), 0U);
}

// Map-ahead never takes a stream's free range (its granules serve that stream; mapping them
// for nobody would be memory no block asked for), and stops near the end of memory: on a
// 64 MiB device 21 blocks of 3 MiB (63 MiB) all fit.
TEST(SegmentTierVirtual, MapAheadSkipsStreamRangesAndStopsNearTheEndOfMemory) {
  {
    VirtualTierParts parts;
    SegmentTier::Options options = virtual_options(parts.vm);
    options.map_ahead_bytes = 128_MiB;
    SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, options);
    const auto s1 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
    void* b = tier.allocate(64_MiB, kUntagged, true);  // the first map: nothing held, no ahead
    EXPECT_EQ(parts.upstream->live_bytes(), 64_MiB);
    void* a = tier.allocate(3_MiB, kUntagged, true);  // 64 MiB held: up to 16 MiB ahead
    const std::size_t after_a = parts.upstream->live_bytes();
    EXPECT_GT(after_a, 68_MiB) << "the untagged tail after a was mapped ahead";
    EXPECT_LE(after_a, 68_MiB + 16_MiB);
    ASSERT_TRUE(tier.free(a, s1));              // a and the tail after it become s1's free range
    void* c = tier.allocate(40_MiB, s1, true);  // s1's range at 64 MiB, past the mapped part
    EXPECT_EQ(c, a);
    EXPECT_EQ(parts.upstream->live_bytes(), 104_MiB) << "exactly the granules under c: the "
                                                        "rest of s1's range is not mapped ahead";
    ASSERT_TRUE(tier.free(c, kUntagged));
    ASSERT_TRUE(tier.free(b, kUntagged));
  }
  {
    VirtualTierParts parts(64_MiB);
    SegmentTier::Options options = virtual_options(parts.vm);
    options.map_ahead_bytes = 128_MiB;
    SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, options);
    std::vector<void*> blocks;
    for (int i = 0; i < 21; ++i) {
      void* p = nullptr;
      ASSERT_NO_THROW(p = tier.allocate(3_MiB, kUntagged, true)) << "block " << i;
      blocks.push_back(p);
    }
    for (void* p : blocks) ASSERT_TRUE(tier.free(p, kUntagged));
    tier.trim(0, false);
    EXPECT_EQ(parts.upstream->live_bytes(), 0U);
  }
}

// Virtual mode: the untagged rest of the reservation fits every request, so a stream whose
// own free ranges are too small would map new granules while other streams' free memory
// idles. Growing fences the other streams first; their ranges serve once the markers
// complete. Within the growth budget the tier grows without waiting; past it, it waits for
// those markers.
TEST(SegmentTierVirtual, GrowingFencesOtherStreamsWhoseFreeMemoryServesOnceComplete) {
  const auto s1 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  const auto s2 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
  const auto s3 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x30));
  {  // within the budget (a headroom of 2x): grow at once, reuse after the marker
    VirtualTierParts parts;
    SegmentTier::Options options = virtual_options(parts.vm);
    options.growth_headroom_1024 = 2048;
    SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, options);
    void* a = tier.allocate(8_MiB, s1, true);
    ASSERT_TRUE(tier.free(a, s1));
    EXPECT_EQ(parts.fence.recorded(), 0U) << "a free records nothing";
    void* s1_again = tier.allocate(8_MiB, s1, true);
    EXPECT_EQ(s1_again, a) << "its own stream reuses it at once";
    EXPECT_EQ(parts.fence.recorded(), 0U) << "no growth: nothing fenced";
    ASSERT_TRUE(tier.free(s1_again, s1));
    // s2 has nothing free; only s1's range (mapped) would serve without growing.
    void* b = tier.allocate(8_MiB, s2, true);
    EXPECT_NE(b, a) << "s1's work may still use a: b is new memory";
    EXPECT_EQ(parts.fence.recorded(), 1U) << "growing fenced s1 first";
    EXPECT_EQ(parts.fence.waits(), 0U) << "within the budget: no wait";
    EXPECT_EQ(tier.counters().maps, 2U);
    const std::size_t reserved = tier.counters().reserved;
    parts.fence.complete_all();  // s1's work at its free has completed
    void* c = tier.allocate(8_MiB, s3, true);
    EXPECT_EQ(c, a) << "s1's range, untagged after its marker, serves another stream";
    EXPECT_EQ(tier.counters().maps, 2U) << "no map for c";
    EXPECT_EQ(tier.counters().reserved, reserved);
    // A fit over mapped memory is not growth: b's range freed on s2 serves s2 at once.
    ASSERT_TRUE(tier.free(b, s2));
    ASSERT_TRUE(tier.free(c, s3));
    const std::uint64_t fenced = parts.fence.recorded();
    void* d = tier.allocate(8_MiB, s2, true);
    EXPECT_EQ(d, b);
    EXPECT_EQ(parts.fence.recorded(), fenced) << "served by its own range: nothing fenced";
    EXPECT_EQ(tier.counters().maps, 2U);
    ASSERT_TRUE(tier.free(d, s2));
  }
  {  // past the budget (the default headroom, 1/16): wait for s1's marker, then reuse a
    VirtualTierParts parts;
    SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, virtual_options(parts.vm));
    void* a = tier.allocate(8_MiB, s1, true);
    ASSERT_TRUE(tier.free(a, s1));
    void* b = tier.allocate(8_MiB, s2, true);
    EXPECT_EQ(b, a) << "waited for s1's work, then reused its range";
    EXPECT_EQ(parts.fence.recorded(), 1U);
    EXPECT_EQ(parts.fence.waits(), 1U);
    EXPECT_EQ(tier.counters().maps, 1U) << "nothing new mapped";
    ASSERT_TRUE(tier.free(b, s2));
  }
}

// Many streams, each allocating blocks of mixed sizes and freeing them on itself, while
// the fence completes markers a little later (as a device would): reserved stays within
// a small multiple of what is live and stops growing, pass after pass.
TEST(SegmentTierVirtual, ManyStreamsKeepReservedBoundedAcrossPasses) {
  VirtualTierParts parts;
  SegmentTier::Options options = virtual_options(parts.vm);
  options.reservation = 64_GiB;
  options.map_ahead_bytes = 128_MiB;
  SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, options);
  constexpr std::size_t kStreams = 16;
  const std::size_t sizes[] = {3_MiB, 5_MiB, 9_MiB};
  struct Live {
    void* block;
    std::size_t bytes;
    detail::StreamKey stream;
  };
  std::vector<Live> live;
  std::size_t live_bytes = 0;
  std::size_t peak_live = 0;
  std::uint64_t seed = 12345;
  auto next = [&seed] {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return seed >> 33;
  };
  std::size_t reserved_after_pass[3] = {};
  for (int pass = 0; pass < 3; ++pass) {
    for (std::size_t i = 0; i < 4000; ++i) {
      const auto stream = detail::stream_key(
          reinterpret_cast<cudaStream_t>(std::uintptr_t{0x100} * (i % kStreams + 1)));
      const std::size_t bytes = sizes[next() % 3];
      void* block = tier.allocate(bytes, stream, true);
      ASSERT_NE(block, nullptr);
      live.push_back({block, bytes, stream});
      live_bytes += tier.round(bytes);
      peak_live = std::max(peak_live, live_bytes);
      if (live.size() > 2 * kStreams) {  // the oldest goes back on its own stream
        ASSERT_TRUE(tier.free(live.front().block, live.front().stream));
        live_bytes -= tier.round(live.front().bytes);
        live.erase(live.begin());
      }
      if (i % 8 == 0) parts.fence.complete_all();  // markers complete some events later
    }
    reserved_after_pass[pass] = tier.counters().peak_reserved;
  }
  EXPECT_LE(tier.counters().peak_reserved, 2 * peak_live)
      << "peak live " << peak_live << ": other streams' free memory must serve before growing";
  EXPECT_EQ(reserved_after_pass[2], reserved_after_pass[1]) << "no growth in a repeated pass";
  for (const Live& l : live) ASSERT_TRUE(tier.free(l.block, l.stream));
}

// A range freed on a stream absorbs an untagged neighbour; the range beyond that neighbour
// may be free on the same stream, and must be merged too, else two adjacent free ranges
// carry the same tag (against the invariant of free_ranges.hpp) and a wholly free segment
// is never seen as one: it cannot serve a whole-segment request on its own stream, is never
// waited for nor given back, and the tier grows beside it.
TEST(SegmentTier, StreamFreeMergesThroughAnAbsorbedUntaggedRangeBefore) {
  TierFixture f(two_mib_segments());
  const auto s1 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  char* a = static_cast<char*>(f.tier.allocate(512_KiB, s1, true));
  void* b = f.tier.allocate(512_KiB, s1, true);
  void* c = f.tier.allocate(512_KiB, s1, true);
  void* d = f.tier.allocate(512_KiB, s1, true);  // the segment is full
  ASSERT_TRUE(f.tier.free(a, s1));               // a: s1
  ASSERT_TRUE(f.tier.free(b, kUntagged));        // b: untagged, beside a (no merge: a is s1's)
  ASSERT_TRUE(f.tier.free(c, s1));               // c absorbs b: [a: s1][b+c: s1] must be one
  ASSERT_TRUE(f.tier.free(d, s1));
  EXPECT_EQ(f.tier.allocate(2_MiB, s1, false), a)
      << "the whole segment is free on s1 but left split in two s1 ranges";
  EXPECT_EQ(f.upstream->allocations(), 1U);
}

TEST(SegmentTier, StreamFreeMergesThroughAnAbsorbedUntaggedRangeAfter) {
  TierFixture f(two_mib_segments());
  const auto s1 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  char* a = static_cast<char*>(f.tier.allocate(512_KiB, s1, true));
  void* b = f.tier.allocate(512_KiB, s1, true);
  void* c = f.tier.allocate(512_KiB, s1, true);
  void* d = f.tier.allocate(512_KiB, s1, true);
  ASSERT_TRUE(f.tier.free(c, s1));         // c: s1 (merges with nothing: b, d used)
  ASSERT_TRUE(f.tier.free(b, kUntagged));  // b: untagged, beside c
  ASSERT_TRUE(f.tier.free(a, s1));         // a absorbs b: [a+b: s1][c: s1] must be one
  ASSERT_TRUE(f.tier.free(d, s1));
  void* whole = f.tier.allocate(2_MiB, s1, true);
  EXPECT_EQ(whole, a) << "the whole segment is free on s1 but left split in two s1 ranges";
  EXPECT_EQ(f.upstream->allocations(), 1U) << "the tier grew beside a wholly free segment";
  ASSERT_TRUE(f.tier.free(whole, kUntagged));
}

// Growing waits on the host (under the tier mutex) for the markers of wholly free segments'
// streams; it does not also block on every other pending marker (another stream's range in
// a segment still in use: its long kernel).
TEST(SegmentTier, GrowingWaitsOnlyForTheMarkersOfWhollyFreeSegments) {
  TierFixture f(two_mib_segments());
  const auto s1 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  const auto s2 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
  void* t = f.tier.allocate(1_MiB, s2, true);
  void* keep = f.tier.allocate(1_MiB, s2, true);  // t's segment stays in use
  ASSERT_TRUE(f.tier.free(t, s2));
  EXPECT_EQ(f.tier.allocate(1_MiB, kUntagged, false), nullptr);  // fences s2: pending
  EXPECT_EQ(f.fence.recorded(), 1U);
  void* s = f.tier.allocate(2_MiB, s1, true);  // a second segment
  ASSERT_TRUE(f.tier.free(s, s1));             // wholly free on s1
  void* again = f.tier.allocate(2_MiB, kUntagged, true);
  EXPECT_EQ(again, s) << "after waiting for s1: the wholly free segment serves";
  EXPECT_EQ(f.fence.waits(), 1U) << "waited also for s2's marker (a segment still in use)";
  ASSERT_TRUE(f.tier.free(again, kUntagged));
  ASSERT_TRUE(f.tier.free(keep, kUntagged));
}

// The host wait before growing is taken only when a waited-for segment can then serve the
// request or must go back (past the growth budget). Here the stream's wholly free segment
// is too small and reserved stays within the budget: no wait (a host block on the stream's
// work, under the tier mutex).
TEST(SegmentTier, GrowingWithinTheBudgetDoesNotWaitForSegmentsTooSmallToServe) {
  TierFixture f(two_mib_segments());
  const auto s1 = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  void* big = f.tier.allocate(64_MiB, s1, true);
  void* a = f.tier.allocate(2_MiB, s1, true);  // a segment of its own
  ASSERT_TRUE(f.tier.free(a, s1));             // wholly free on s1
  void* b = f.tier.allocate(4_MiB, s1, true);  // 66 + 4 MiB: within 68 MiB + 1/16
  EXPECT_EQ(f.upstream->live_bytes(), 70_MiB) << "the 2 MiB segment stays (within budget)";
  EXPECT_EQ(f.fence.waits(), 0U) << "waited for s1 though its segment could neither serve "
                                    "nor go back";
  ASSERT_TRUE(f.tier.free(b, kUntagged));
  ASSERT_TRUE(f.tier.free(big, kUntagged));
}

// max_segment_waste makes the tier grow instead of splitting a wholly free segment; that
// segment goes back only when growing passes the budget (peak in use + 1/16). Within it,
// it stays idle beside the new segment.
TEST(SegmentTier, WastefulWhollyFreeSegmentStaysWithinTheBudget) {
  auto options = two_mib_segments();
  options.max_segment_waste = 8_MiB;
  TierFixture f(options);
  void* big = f.tier.allocate(256_MiB, kUntagged, true);
  void* x = f.tier.allocate(64_MiB, kUntagged, true);
  ASSERT_TRUE(f.tier.free(x, kUntagged));  // 64 MiB wholly free; peak in use 320 MiB
  void* y = f.tier.allocate(16_MiB, kUntagged, true);
  EXPECT_NE(y, x) << "not split: 48 MiB would stay idle";
  EXPECT_EQ(f.upstream->live_bytes(), 336_MiB) << "320 + 16 MiB is within 340 MiB: x stays";
  ASSERT_TRUE(f.tier.free(y, kUntagged));
  ASSERT_TRUE(f.tier.free(big, kUntagged));
}

// Past the budget the virtual tier waits only for pending markers whose ranges could serve
// the request (as the segments mode does: wait_for_empty_segments' could_serve). Here t's
// 8 MiB range sits between a used block and the start of the reservation: after a wait it
// still could not serve 16 MiB, so the allocation on s maps 16 MiB without blocking the
// host on t's work.
TEST(SegmentTierVirtualStreams, PastBudgetDoesNotWaitForMarkersWhoseRangesCannotServe) {
  const auto s = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  const auto t = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
  VirtualTierParts parts;
  SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, virtual_options(parts.vm));
  void* x = tier.allocate(8_MiB, t, true);
  void* y = tier.allocate(2_MiB, t, true);  // keeps x away from the untagged tail
  ASSERT_TRUE(tier.free(x, t));
  const std::size_t reserved = tier.counters().reserved;
  void* big = tier.allocate(16_MiB, s, true);  // past the budget (10 MiB peak + 1/16)
  EXPECT_NE(big, x);
  EXPECT_EQ(tier.counters().reserved, reserved + 16_MiB) << "mapped 16 MiB, wait or not";
  EXPECT_EQ(parts.fence.waits(), 0U)
      << "waited for t's marker though t's 8 MiB range could not serve 16 MiB";
  ASSERT_TRUE(tier.free(big, s));
  ASSERT_TRUE(tier.free(y, t));
}

// Growing for one stream within the budget fences only the other streams whose free ranges
// could serve the request: a fenced stream loses the immediate reuse of its own frees
// (stream order makes them safe for it). t's 2 MiB block, freed on t, cannot serve s's
// 64 MiB growth, so it stays t's, and t's next 2 MiB request gets it back at once.
TEST(SegmentTierVirtualStreams, AnUnrelatedGrowthDoesNotTakeAStreamsOwnFreesFromIt) {
  const auto s = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  const auto t = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
  VirtualTierParts parts;
  SegmentTier::Options options = virtual_options(parts.vm);
  options.growth_headroom_1024 = 4096;  // well within the budget: no wait anywhere
  SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, options);
  void* x = tier.allocate(2_MiB, t, true);
  void* y = tier.allocate(2_MiB, t, true);  // keeps x away from the untagged tail
  ASSERT_TRUE(tier.free(x, t));
  void* big = tier.allocate(64_MiB, s, true);  // x (2 MiB) cannot serve it
  const std::uint64_t maps = tier.counters().maps;
  void* again = tier.allocate(2_MiB, t, true);
  EXPECT_EQ(again, x) << "t's own free range, mapped, serves t at once";
  EXPECT_EQ(tier.counters().maps, maps) << "no new map for a request t's own frees cover";
  EXPECT_EQ(parts.fence.recorded(), 0U) << "t was fenced for a request its ranges cannot serve";
  ASSERT_TRUE(tier.free(again, t));
  ASSERT_TRUE(tier.free(big, s));
  ASSERT_TRUE(tier.free(y, t));
}

// Past the budget an allocation on t never waits for a marker recorded on t itself (here by
// trim(wait=false)): t's own fenced range is safe for t in stream order. A wait would be a
// host block on t's own queued work on every such growth, and with host-dependent work on
// t (a host function that calls into the pool) it would never return.
TEST(SegmentTierVirtualStreams, AStreamDoesNotBlockOnItsOwnMarker) {
  const auto t = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
  VirtualTierParts parts;
  SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, virtual_options(parts.vm));
  void* x = tier.allocate(8_MiB, t, true);
  void* y = tier.allocate(2_MiB, t, true);  // keeps x away from the untagged tail
  ASSERT_TRUE(tier.free(x, t));
  tier.trim(SIZE_MAX, /*wait=*/false);  // fences t, waits for nothing
  ASSERT_EQ(parts.fence.recorded(), 1U);
  void* again = tier.allocate(8_MiB, t, true);  // growing 8 MiB passes 10 MiB + 1/16
  EXPECT_EQ(parts.fence.waits(), 0U) << "t's allocation waited for t's own marker";
  ASSERT_TRUE(tier.free(again, t));
  ASSERT_TRUE(tier.free(y, t));
}

// could_serve does not count the never-mapped tail of the reservation, which a stream's
// free beside it absorbs (the most recent block usually sits there): fresh_tail() serves
// any stream from it without a fence. t's 2 MiB block x, freed on t, takes the tail; s's
// unrelated 64 MiB growth (within the budget) does not fence t, and t reuses x at once.
TEST(SegmentTierVirtualStreams, AnUnrelatedGrowthDoesNotFenceAStreamForItsNeverMappedTail) {
  const auto s = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  const auto t = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
  VirtualTierParts parts;
  SegmentTier::Options options = virtual_options(parts.vm);
  options.growth_headroom_1024 = 4096;  // well within the budget: no wait anywhere
  SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, options);
  void* x = tier.allocate(2_MiB, t, true);
  ASSERT_TRUE(tier.free(x, t));  // absorbs the untagged, never-mapped rest of the reservation
  void* big = tier.allocate(64_MiB, s, true);
  EXPECT_NE(big, x);
  const std::uint64_t maps = tier.counters().maps;
  void* again = tier.allocate(2_MiB, t, true);
  EXPECT_EQ(again, x) << "t's own free range, mapped, serves t at once";
  EXPECT_EQ(tier.counters().maps, maps) << "no new map for a request t's own frees cover";
  EXPECT_EQ(parts.fence.recorded(), 0U)
      << "t was fenced because its range holds never-mapped granules fresh_tail() serves anyway";
  ASSERT_TRUE(tier.free(again, t));
  ASSERT_TRUE(tier.free(big, s));
}

// Past the budget wait_for_pending asks could_serve of each pending range with all its free
// or pending neighbours: two other streams' pending ranges side by side merge into one
// once both are untagged. t's and u's 8 MiB ranges are adjacent; s's 16 MiB request past
// the budget fences both, waits for them, and reuses the 16 MiB (no growth).
TEST(SegmentTierVirtualStreams, PastBudgetWaitsForAdjacentPendingRangesThatServeTogether) {
  const auto s = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  const auto t = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
  const auto u = detail::stream_key(reinterpret_cast<cudaStream_t>(0x30));
  VirtualTierParts parts;
  SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, virtual_options(parts.vm));
  void* a = tier.allocate(8_MiB, t, true);
  void* b = tier.allocate(8_MiB, u, true);
  void* c = tier.allocate(2_MiB, kUntagged, true);  // keeps b away from the untagged tail
  ASSERT_EQ(static_cast<char*>(b), static_cast<char*>(a) + 8_MiB);
  ASSERT_TRUE(tier.free(a, t));
  ASSERT_TRUE(tier.free(b, u));
  const std::size_t reserved = tier.counters().reserved;
  void* big = tier.allocate(16_MiB, s, true);  // past the budget (18 MiB peak + 1/16)
  EXPECT_EQ(big, a) << "t's and u's ranges, once untagged, are one 16 MiB mapped range";
  EXPECT_EQ(tier.counters().reserved, reserved) << "mapped 16 MiB past the budget";
  ASSERT_TRUE(tier.free(big, s));
  ASSERT_TRUE(tier.free(c, kUntagged));
}

// The requester's own fenced frees are safe for it in stream order: past the budget, t
// takes back its own pending 8 MiB range instead of mapping 8 MiB more (and waits for no
// marker).
TEST(SegmentTierVirtualStreams, AStreamPastTheBudgetReusesItsOwnPendingRange) {
  const auto t = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
  VirtualTierParts parts;
  SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, virtual_options(parts.vm));
  void* x = tier.allocate(8_MiB, t, true);
  void* y = tier.allocate(2_MiB, t, true);  // keeps x away from the untagged tail
  ASSERT_TRUE(tier.free(x, t));
  tier.trim(SIZE_MAX, /*wait=*/false);  // fences t, waits for nothing
  const std::size_t reserved = tier.counters().reserved;
  void* again = tier.allocate(8_MiB, t, true);  // growing 8 MiB passes 10 MiB + 1/16
  EXPECT_EQ(parts.fence.waits(), 0U);
  EXPECT_EQ(again, x) << "t's own pending range is safe for t in stream order";
  EXPECT_EQ(tier.counters().reserved, reserved) << "mapped 8 MiB past the budget instead";
  ASSERT_TRUE(tier.free(again, t));
  ASSERT_TRUE(tier.free(y, t));
}

// A stream's pending range too small for its request, with an untagged free range after it
// that makes up the rest: the two serve the stream (its own queued work on the first is safe
// for it in stream order) without growing; the block starts at the pending range, and the
// rest of the untagged range stays any stream's. Another stream's request cannot take it.
TEST(SegmentTierVirtualStreams, AStreamsPendingRangeAndTheUntaggedRangeAfterItServeItsRequest) {
  const auto s = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  const auto t = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
  VirtualTierParts parts;
  SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, virtual_options(parts.vm));
  char* x = static_cast<char*>(tier.allocate(8_MiB, t, true));
  char* y = static_cast<char*>(tier.allocate(8_MiB, kUntagged, true));
  void* z = tier.allocate(2_MiB, kUntagged, true);  // keeps y away from the untagged tail
  ASSERT_EQ(y, x + 8_MiB);
  ASSERT_TRUE(tier.free(y, kUntagged));
  SegmentTier::FreeMarker marker{.marker = parts.fence.record(nullptr), .recorder = &parts};
  ASSERT_EQ(tier.free_keeping(x, t, 8_MiB, nullptr, &marker), SegmentTier::Freed::kept);
  ASSERT_TRUE(marker.taken) << "x is pending under the marker";
  const std::size_t reserved = tier.counters().reserved;
  const std::uint64_t maps = tier.counters().maps;
  EXPECT_EQ(tier.allocate(12_MiB, s, false), nullptr) << "t's pending range is t's alone";
  char* big = static_cast<char*>(tier.allocate(12_MiB, t, false));
  EXPECT_EQ(big, x) << "x and the untagged range after it, without growing";
  EXPECT_EQ(tier.counters().reserved, reserved);
  EXPECT_EQ(tier.counters().maps, maps);
  EXPECT_EQ(parts.fence.waits(), 0U);
  EXPECT_EQ(tier.allocate(4_MiB, s, false), x + 12_MiB) << "the rest is any stream's at once";
  ASSERT_TRUE(tier.free(big, t));
  ASSERT_TRUE(tier.free(x + 12_MiB, s));
  ASSERT_TRUE(tier.free(z, kUntagged));
}

// A stream's request that would need its pending range and granules still to map, with too
// little memory left to map them: the request fails and the pending range stays under its
// marker, so once the marker completed another stream gets it, with no growth.
TEST(SegmentTierVirtualStreams, AFailedGrowthLeavesAStreamsPendingRangeToOthersAfterItsMarker) {
  const auto s = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  const auto t = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
  VirtualTierParts parts(4_MiB);
  SegmentTier tier(*parts.upstream, parts.fence, parts.gauge, virtual_options(parts.vm));
  char* x = static_cast<char*>(tier.allocate(2_MiB, t, true));
  SegmentTier::FreeMarker marker{.marker = parts.fence.record(nullptr), .recorder = &parts};
  ASSERT_EQ(tier.free_keeping(x, t, 2_MiB, nullptr, &marker), SegmentTier::Freed::kept);
  ASSERT_TRUE(marker.taken);
  EXPECT_THROW((void)tier.allocate(8_MiB, t, true), OutOfMemory);
  parts.fence.complete_all();
  void* again = tier.allocate(2_MiB, s, false);
  EXPECT_EQ(again, x) << "x's marker completed: x is any stream's";
  ASSERT_TRUE(tier.free(again, s));
}

// The same in a tier of segments, and when the block takes the whole of both ranges.
TEST(SegmentTier, AStreamsPendingRangeAndTheUntaggedRangeAfterItServeItsRequest) {
  const auto s = detail::stream_key(reinterpret_cast<cudaStream_t>(0x10));
  const auto t = detail::stream_key(reinterpret_cast<cudaStream_t>(0x20));
  TierFixture f(two_mib_segments());
  char* whole = static_cast<char*>(f.tier.allocate(8_MiB, kUntagged, true));
  ASSERT_TRUE(f.tier.free(whole, kUntagged));
  for (const std::size_t request : {6_MiB, 8_MiB}) {
    SCOPED_TRACE(request);
    char* x = static_cast<char*>(f.tier.allocate(4_MiB, t, false));
    ASSERT_EQ(x, whole) << "the front of the free segment";
    SegmentTier::FreeMarker marker{.marker = f.fence.record(nullptr), .recorder = &f};
    ASSERT_EQ(f.tier.free_keeping(x, t, 4_MiB, nullptr, &marker), SegmentTier::Freed::kept);
    ASSERT_TRUE(marker.taken);
    const std::size_t reserved = f.tier.counters().reserved;
    EXPECT_EQ(f.tier.allocate(request, t, false), x);
    EXPECT_EQ(f.tier.counters().reserved, reserved);
    if (request < 8_MiB) {
      char* rest = static_cast<char*>(f.tier.allocate(8_MiB - request, s, false));
      EXPECT_EQ(rest, x + request) << "the rest is any stream's at once";
      ASSERT_TRUE(f.tier.free(rest, kUntagged));
    }
    ASSERT_TRUE(f.tier.free(x, kUntagged));
  }
  f.tier.trim(0, false);
  EXPECT_EQ(f.upstream->live_bytes(), 0U);
}

// The tier-level consequence: free(nullptr) returns false but under-counts live_, which
// then grows too late; the table fills up completely and the next lookup of an absent key
// (owns() / free() of a foreign pointer) probes forever. Run in a child with an alarm.
TEST(SegmentTierDeathTest, SegmentTierFreeOfNullLeavesTheLiveMapUsable) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        alarm(5);  // a hang is the failure
        auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
        ManualFence fence;
        detail::ReservedGauge gauge;
        SegmentTier tier(*upstream, fence, gauge,
                         {.granularity = 512, .packed_segment = 2_MiB, .packed_limit = 2_MiB});
        std::vector<void*> blocks;
        for (int i = 0; i < 16; ++i) blocks.push_back(tier.allocate(4096, kUntagged, true));
        for (int i = 0; i < 16; ++i) {
          if (tier.free(nullptr, kUntagged)) std::_Exit(2);
        }
        for (int i = 0; i < 16; ++i) blocks.push_back(tier.allocate(4096, kUntagged, true));
        int foreign = 0;
        if (tier.owns(&foreign)) std::_Exit(3);  // hangs when the table is full
        for (void* b : blocks) {
          if (!tier.free(b, kUntagged)) std::_Exit(4);
        }
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace vram::testing
