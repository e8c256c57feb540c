// SegmentTier against a model of the device (the stream-tagged merge rule, the growth
// waits and the growth budget): random allocations and frees on several streams,
// plain frees, markers completing in order, trims, release_empty_for, and the trim path's
// mark_frees / quiesce / forget_streams. Every 512-byte chunk remembers the stream that last
// freed it and when; a chunk handed to another stream (or to any stream), or given back to
// the upstream, must be past a completed marker recorded on that stream after the free, or
// past a quiesce. Accounting is checked after every step.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "test_upstreams.hpp"
#include "tier/segment_tier.hpp"
#include "vram/device_pool.hpp"
#include "vram/units.hpp"
#include "vram/virtual_memory.hpp"

namespace vram::testing {
namespace {

using namespace vram::literals;
using detail::kUntagged;
using detail::SegmentTier;
using detail::StreamKey;

constexpr std::size_t kChunk = 512;

struct Model {
  struct Freed {
    StreamKey stream;
    std::uint64_t time;
  };
  std::uint64_t now = 0;
  std::uint64_t quiesced_at = 0;  // frees before this are complete
  struct Marker {
    StreamKey stream;
    std::uint64_t time;
  };
  std::vector<Marker> markers;  // marker m is markers[m - 1]
  std::uint64_t done = 0;       // markers up to this have completed
  std::unordered_map<std::uintptr_t, Freed> chunks;
  std::uint64_t violations = 0;

  // The latest record time of a completed marker on each stream.
  std::unordered_map<StreamKey, std::uint64_t> completed_times() const {
    std::unordered_map<StreamKey, std::uint64_t> t;
    for (std::uint64_t m = 0; m < done; ++m) {
      t[markers[m].stream] = std::max(t[markers[m].stream], markers[m].time);
    }
    return t;
  }
  // Chunks of [p, p + n) handed to `to` (kUntagged: any stream, or the upstream).
  void hand_over(const void* p, std::size_t n, StreamKey to) {
    const auto times = completed_times();
    const auto first = reinterpret_cast<std::uintptr_t>(p) / kChunk;
    for (std::uintptr_t c = first; c < first + n / kChunk; ++c) {
      auto it = chunks.find(c);
      if (it == chunks.end()) continue;
      const Freed f = it->second;
      chunks.erase(it);
      if (f.stream == kUntagged || f.stream == to || f.time < quiesced_at) continue;
      auto t = times.find(f.stream);
      if (t != times.end() && t->second > f.time) continue;
      ++violations;
    }
  }
  void freed(const void* p, std::size_t n, StreamKey on) {
    const auto first = reinterpret_cast<std::uintptr_t>(p) / kChunk;
    for (std::uintptr_t c = first; c < first + n / kChunk; ++c) chunks[c] = Freed{on, now};
  }
};

class ModelFence final : public StreamFence {
 public:
  explicit ModelFence(Model& model) : model_(model) {}
  std::uint64_t record(cudaStream_t stream) override {
    model_.markers.push_back({reinterpret_cast<StreamKey>(stream), ++model_.now});  // plain keys
    return model_.markers.size();
  }
  bool completed(std::uint64_t marker) noexcept override { return marker <= model_.done; }
  void wait(std::uint64_t marker) noexcept override { model_.done = std::max(model_.done, marker); }
  void release(std::uint64_t) noexcept override {}
  // The test sets model.quiesced_at: when the device synchronize began.
  void quiesce() noexcept override { model_.done = model_.markers.size(); }

 private:
  Model& model_;
};

class ModelUpstream final : public Upstream {
 public:
  explicit ModelUpstream(Model& model) : model_(model) {}
  void* allocate(std::size_t bytes) override {
    void* p = inner_.allocate(bytes);
    live_ += bytes;
    return p;
  }
  void deallocate(void* block, std::size_t bytes) noexcept override {
    model_.hand_over(block, bytes, kUntagged);
    live_ -= bytes;
    inner_.deallocate(block, bytes);
  }
  MemoryKind kind() const noexcept override { return MemoryKind::host; }
  std::string_view name() const noexcept override { return "model"; }
  std::size_t live() const { return live_; }

 private:
  Model& model_;
  HostMemoryUpstream inner_;
  std::size_t live_ = 0;
};

void run_model(std::uint32_t seed, SegmentTier::Options options) {
  Model model;
  ModelFence fence(model);
  ModelUpstream upstream(model);
  detail::ReservedGauge gauge;
  std::mt19937 rng(seed);
  struct Block {
    void* p;
    std::size_t bytes;
    StreamKey stream;
  };
  std::vector<Block> blocks;
  std::size_t used = 0;
  std::size_t used_peak = 0;
  {
    SegmentTier tier(upstream, fence, gauge, options);
    const StreamKey streams[] = {kUntagged, 1, 2, 3};
    auto pick = [&](auto n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng); };
    for (int step = 0; step < 3000; ++step) {
      ++model.now;
      const std::size_t op = pick(100);
      if (op < 40 || blocks.empty()) {
        const StreamKey s = streams[pick(4)];
        // A tier takes rounded bytes (its caller rounds once).
        const std::size_t bytes = tier.round(pick(2) ? 1 + pick(64_KiB) : 1 + pick(6_MiB));
        void* p = tier.allocate(bytes, s, pick(8) != 0);
        if (p != nullptr) {
          const std::size_t n = bytes;
          model.hand_over(p, n, s);
          blocks.push_back({p, n, s});
          used += n;
        }
      } else if (op < 75) {
        const std::size_t i = pick(blocks.size());
        const Block b = blocks[i];
        blocks[i] = blocks.back();
        blocks.pop_back();
        StreamKey tag = pick(4) == 0 ? kUntagged : b.stream;
        if (tag == kUntagged && pick(2)) tag = streams[1 + pick(3)];
        if (tag != kUntagged) model.freed(b.p, b.bytes, tag);
        ASSERT_TRUE(tier.free(b.p, tag));
        used -= b.bytes;
      } else if (op < 88) {
        if (model.done < model.markers.size()) {
          model.done += 1 + pick(model.markers.size() - model.done);
        }
      } else if (op < 92) {
        tier.trim(pick(2) ? 0 : 8_MiB, pick(2) != 0);
      } else if (op < 95) {
        const std::uint64_t mark = tier.mark_frees();
        const std::uint64_t began = ++model.now;  // the device synchronize begins
        if (pick(2) && !blocks.empty()) {         // a free racing it, on another thread
          const Block b = blocks.back();
          blocks.pop_back();
          ++model.now;
          if (b.stream != kUntagged) model.freed(b.p, b.bytes, b.stream);
          ASSERT_TRUE(tier.free(b.p, b.stream));
          used -= b.bytes;
        }
        fence.quiesce();
        model.quiesced_at = began;  // frees before it began are complete, later ones not
        tier.forget_streams(mark);
      } else {
        tier.release_empty_for(1 + pick(16_MiB));
      }
      const auto c = tier.counters();
      ASSERT_EQ(c.reserved, upstream.live()) << "step " << step;
      ASSERT_EQ(c.reserved - c.free_bytes, used) << "step " << step;
      ASSERT_EQ(gauge.reserved.load(), c.reserved);
      used_peak = std::max(used_peak, used);  // one operation per step: peaks land on steps
      ASSERT_EQ(gauge.tier_peaks.load(), used_peak) << "step " << step;
      ASSERT_EQ(model.violations, 0U) << "step " << step << ": a chunk freed on a stream was "
                                      << "handed on before that stream's work completed";
    }
    for (const Block& b : blocks) ASSERT_TRUE(tier.free(b.p, kUntagged));
    tier.trim(0, true);
    EXPECT_EQ(upstream.live(), 0U);
  }
  EXPECT_EQ(model.violations, 0U);
}

TEST(SegmentTierModel, StreamFreesNeverReachAnotherStreamBeforeTheirWorkCompletes) {
  for (std::uint32_t seed = 1; seed <= 4; ++seed) {
    SCOPED_TRACE(seed);
    run_model(seed, {.granularity = 512,
                     .packed_segment = 4_MiB,
                     .packed_limit = 2_MiB,
                     .max_segment_waste = seed % 2 ? 2_MiB : SIZE_MAX});
  }
}

// Virtual mode (runs of granules): a VirtualMemory that records every
// mapping over the host emulation. A map must not overlap a mapping; an unmap must name
// exactly one whole mapping, must not touch a live block, and (Model::hand_over) must not
// take memory freed on a stream before that stream's work completed. After every step every
// live block lies inside mappings, reserved equals the physical bytes live, and at the end
// nothing is left mapped.
class RecordingVirtualMemory final : public VirtualMemory {
 public:
  RecordingVirtualMemory(Model& model, std::shared_ptr<Upstream> physical)
      : model_(model), inner_(std::move(physical)) {}
  std::size_t granularity() const noexcept override { return inner_.granularity(); }
  char* reserve(std::size_t bytes) override { return inner_.reserve(bytes); }
  void unreserve(char* base, std::size_t bytes) noexcept override { inner_.unreserve(base, bytes); }
  std::uint64_t map(char* address, std::size_t bytes) override {
    auto next = mappings_.lower_bound(address);
    if (next != mappings_.end() && next->first < address + bytes) ++errors;
    if (next != mappings_.begin() && std::prev(next)->first + std::prev(next)->second > address) {
      ++errors;
    }
    const std::uint64_t handle = inner_.map(address, bytes);
    mappings_[address] = bytes;
    return handle;
  }
  void unmap(char* address, std::size_t bytes, std::uint64_t handle) noexcept override {
    auto it = mappings_.find(address);
    if (it == mappings_.end() || it->second != bytes) ++errors;
    if (it != mappings_.end()) mappings_.erase(it);
    if (live != nullptr) {
      for (const auto& [p, n] : *live) {
        if (p < address + bytes && address < p + n) ++errors;  // a live block unmapped
      }
    }
    model_.hand_over(address, bytes, kUntagged);
    inner_.unmap(address, bytes, handle);
  }
  // Whether [p, p + n) lies inside mappings.
  bool covered(const char* p, std::size_t n) const {
    const char* end = p + n;
    while (p < end) {
      auto it = mappings_.upper_bound(const_cast<char*>(p));
      if (it == mappings_.begin()) return false;
      --it;
      if (it->first + it->second <= p) return false;
      p = it->first + it->second;
    }
    return true;
  }
  std::size_t mappings() const { return mappings_.size(); }
  std::uint64_t errors = 0;
  const std::vector<std::pair<char*, std::size_t>>* live = nullptr;

 private:
  Model& model_;
  HostVirtualMemory inner_;
  std::map<char*, std::size_t> mappings_;
};

void run_virtual_model(std::uint32_t seed, bool unmap_before_map, std::size_t max_free,
                       std::size_t capacity, std::uint64_t fail_every) {
  Model model;
  ModelFence fence(model);
  ModelUpstream unused(model);
  auto physical = std::make_shared<TestUpstream>(
      std::make_shared<HostMemoryUpstream>(),
      TestUpstream::Options{.capacity_bytes = capacity, .fail_every = fail_every});
  RecordingVirtualMemory vm(model, physical);
  detail::ReservedGauge gauge;
  std::mt19937 rng(seed);
  std::vector<std::pair<char*, std::size_t>> live;
  std::vector<StreamKey> live_streams;
  vm.live = &live;
  std::size_t used = 0;
  std::size_t used_peak = 0;
  std::uint64_t ooms = 0;
  std::uint64_t retries = 0;
  {
    SegmentTier tier(unused, fence, gauge,
                     {.granularity = 512,
                      .max_free_bytes = max_free,
                      .virtual_memory = &vm,
                      .reservation = 1_GiB,
                      .unmap_before_map = unmap_before_map});
    const StreamKey streams[] = {kUntagged, 1, 2, 3};
    auto pick = [&](auto n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng); };
    for (int step = 0; step < 1000; ++step) {
      ++model.now;
      const std::size_t op = pick(100);
      if (op < 45 || live.empty()) {
        const StreamKey s = streams[pick(4)];
        const std::size_t bytes = tier.round(pick(3) ? 1 + pick(3_MiB) : 1 + pick(12_MiB));
        void* p = nullptr;
        const bool may_grow = pick(8) != 0;
        try {
          p = tier.allocate(bytes, s, may_grow);
        } catch (const OutOfMemory&) {
          // DevicePool's retry: every stream's work waited for, everything free unmapped.
          ++retries;
          const std::uint64_t mark = tier.mark_frees();
          model.quiesced_at = ++model.now;
          fence.quiesce();
          tier.forget_streams(mark);
          tier.trim(0, true);
          try {
            p = tier.allocate(bytes, s, may_grow);
          } catch (const OutOfMemory&) {
            ++ooms;
          }
        }
        if (p != nullptr) {
          const std::size_t n = bytes;
          model.hand_over(p, n, s);
          live.emplace_back(static_cast<char*>(p), n);
          live_streams.push_back(s);
          used += n;
          static_cast<char*>(p)[0] = 1;  // mapped memory is usable
          static_cast<char*>(p)[n - 1] = 1;
        }
      } else if (op < 80) {
        const std::size_t i = pick(live.size());
        const auto [p, n] = live[i];
        const StreamKey s = live_streams[i];
        live[i] = live.back();
        live.pop_back();
        live_streams[i] = live_streams.back();
        live_streams.pop_back();
        StreamKey tag = pick(3) == 0 ? kUntagged : s;
        if (tag == kUntagged && pick(2)) tag = streams[1 + pick(3)];
        if (tag != kUntagged) model.freed(p, n, tag);
        ASSERT_TRUE(tier.free(p, tag));
        used -= n;
      } else if (op < 92) {
        if (model.done < model.markers.size()) {
          model.done += 1 + pick(model.markers.size() - model.done);
        }
      } else if (op < 97) {
        tier.trim(pick(2) ? 0 : 8_MiB, pick(2) != 0);
      } else {
        const std::uint64_t mark = tier.mark_frees();
        model.quiesced_at = ++model.now;
        fence.quiesce();
        tier.forget_streams(mark);
      }
      const auto c = tier.counters();
      ASSERT_EQ(c.reserved, physical->live_bytes()) << "step " << step;
      ASSERT_EQ(c.reserved - c.free_bytes, used) << "step " << step;
      ASSERT_EQ(gauge.reserved.load(), c.reserved) << "step " << step;
      used_peak = std::max(used_peak, used);  // one operation per step: peaks land on steps
      ASSERT_EQ(gauge.tier_peaks.load(), used_peak) << "step " << step;
      ASSERT_EQ(vm.errors, 0U) << "step " << step << ": overlapping map, partial unmap, or a "
                               << "live block unmapped";
      ASSERT_EQ(model.violations, 0U) << "step " << step << ": memory freed on a stream "
                                      << "unmapped before that stream's work completed";
      for (const auto& [p, n] : live) {
        ASSERT_TRUE(vm.covered(p, n)) << "step " << step << ": a live block is not mapped";
      }
    }
    EXPECT_GT(tier.counters().maps, 10U);
    EXPECT_GT(tier.counters().upstream_frees, 0U) << "runs went back while blocks were live";
    if (capacity != SIZE_MAX || fail_every != 0) {
      EXPECT_GT(ooms + physical->injected_failures(), 0U) << "the OOM path was exercised";
    }
    while (!live.empty()) {
      char* p = live.back().first;
      live.pop_back();
      ASSERT_TRUE(tier.free(p, kUntagged));
    }
    tier.trim(0, true);
    EXPECT_EQ(physical->live_bytes(), 0U) << "trim(0) with nothing live: every run went back";
    EXPECT_EQ(vm.mappings(), 0U);
    EXPECT_EQ(vm.errors, 0U) << "at the end";
  }
  EXPECT_EQ(physical->live_bytes(), 0U);
  EXPECT_EQ(physical->bad_frees(), 0U);
  EXPECT_EQ(vm.errors, 0U);
  EXPECT_EQ(gauge.reserved.load(), 0U);
}

TEST(SegmentTierVirtualModel, RunsStayMappedUnderLiveAndStreamFreedBlocksAndAllGoBack) {
  for (std::uint32_t seed = 1; seed <= 3; ++seed) {
    SCOPED_TRACE(seed);
    run_virtual_model(seed, seed % 2 == 0, seed == 3 ? 16_MiB : SIZE_MAX, SIZE_MAX, 0);
  }
}

TEST(SegmentTierVirtualModel, MapFailuresReclaimOnlyWhollyFreeRunsAndLeaveNothingInconsistent) {
  for (std::uint32_t seed = 11; seed <= 14; ++seed) {
    SCOPED_TRACE(seed);
    run_virtual_model(seed, seed % 2 == 0, seed == 13 ? 16_MiB : SIZE_MAX, 96_MiB,
                      seed == 14 ? 7 : 0);
  }
}

}  // namespace
}  // namespace vram::testing
