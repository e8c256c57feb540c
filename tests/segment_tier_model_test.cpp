// SegmentTier against a model of the device (review of the stream-tagged merge rule, the
// growth waits and the growth budget): random allocations and frees on several streams,
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
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "test_upstreams.hpp"
#include "vram/detail/segment_tier.hpp"
#include "vram/device_pool.hpp"
#include "vram/units.hpp"

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
    model_.markers.push_back({detail::stream_key(stream), ++model_.now});
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
  {
    SegmentTier tier(upstream, fence, gauge, options);
    const StreamKey streams[] = {kUntagged, 1, 2, 3};
    auto pick = [&](auto n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng); };
    for (int step = 0; step < 3000; ++step) {
      ++model.now;
      const std::size_t op = pick(100);
      if (op < 40 || blocks.empty()) {
        const StreamKey s = streams[pick(4)];
        const std::size_t bytes = (pick(2) ? 1 + pick(64_KiB) : 1 + pick(6_MiB));
        void* p = tier.allocate(bytes, s, pick(8) != 0);
        if (p != nullptr) {
          const std::size_t n = tier.round(bytes);
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
      ASSERT_EQ(gauge.used.load(), used);
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

// Threads on their own (emulated) streams allocate and free stream-ordered and plain, small
// and large, while another completes markers and trims: every block a thread holds is
// filled with its pattern and checked before release (two holders of one byte would clash,
// and under TSan race); nothing in use or reserved at the end.
TEST(DevicePoolStreamsStress, ThreadsOnStreamsWithMarkersCompletingAndTrims) {
  auto fence = std::make_shared<ManualFence>();
  auto upstream = std::make_shared<TestUpstream>(std::make_shared<HostMemoryUpstream>());
  DevicePool::Options options;
  options.fence = fence;
  options.large_segment_bytes = 4_MiB;
  options.max_segment_waste_bytes = 2_MiB;
  DevicePool pool(upstream, options);
  std::atomic<int> running{4};
  std::atomic<std::uint64_t> mismatches{0};
  auto worker = [&](int id) {
    std::mt19937 rng(static_cast<std::uint32_t>(id));
    const auto stream = reinterpret_cast<cudaStream_t>(static_cast<std::uintptr_t>(id + 1));
    struct Held {
      unsigned char* p;
      std::size_t bytes;
    };
    std::vector<Held> held;
    auto release = [&](std::size_t i) {
      const Held h = held[i];
      for (std::size_t k = 0; k < h.bytes; k += 61) {
        if (h.p[k] != static_cast<unsigned char>(id)) ++mismatches;
      }
      if (rng() % 4 == 0) {
        pool.deallocate(h.p, h.bytes);
      } else {
        pool.deallocate_async(h.p, h.bytes, stream);
      }
      held[i] = held.back();
      held.pop_back();
    };
    for (int step = 0; step < 1000; ++step) {
      if (held.size() < 8 && rng() % 2 == 0) {
        const std::size_t bytes = rng() % 3 == 0 ? 1 + rng() % (3_MiB) : 1 + rng() % (32_KiB);
        auto* p = static_cast<unsigned char*>(pool.allocate_async(bytes, stream));
        std::memset(p, id, bytes);
        held.push_back({p, bytes});
      } else if (!held.empty()) {
        release(rng() % held.size());
      }
    }
    while (!held.empty()) release(held.size() - 1);
    --running;
  };
  std::vector<std::thread> threads;
  for (int id = 0; id < 4; ++id) threads.emplace_back(worker, id);
  for (int i = 0; running.load() > 0; ++i) {
    fence->complete_all();
    if (i % 16 == 0) pool.trim(i % 32 == 0 ? 0 : 8_MiB);
    std::this_thread::yield();
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0U) << "a byte held by one thread was written by another";
  EXPECT_EQ(pool.stats().bytes_in_use, 0U);
  pool.trim(0);
  EXPECT_EQ(pool.stats().bytes_reserved, 0U);
  EXPECT_EQ(upstream->live_bytes(), 0U);
}

}  // namespace
}  // namespace vram::testing
