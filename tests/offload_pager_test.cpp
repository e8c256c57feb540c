// The plug-in's offload functions (plugins/torch/offload.cpp, vram_torch.h "Offload") on the
// host: the least budget, refusals before anything is made, and the pager's C interface over
// host memory standing in for the device (host_double).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "offload.hpp"
#include "vram_torch.h"

namespace {

TEST(OffloadMinBudget, HoldsTheForcedPiecesPlusTheRing) {
  // Everything streams through 2 slots of the largest piece, or the largest stays resident.
  const std::vector<std::size_t> mixed = {100, 300, 200};
  EXPECT_EQ(vram_torch::min_offload_budget(mixed, 1, 1), 600u);
  // One large piece: resident, the small ones stream through 3 small slots.
  const std::vector<std::size_t> skewed = {1000, 10, 10, 10};
  EXPECT_EQ(vram_torch::min_offload_budget(skewed, 2, 1), 1030u);
  // Alignment rounds each piece up as the arena does.
  EXPECT_EQ(vram_torch::min_offload_budget(skewed, 2, 256), 1024u + 3 * 256u);
  EXPECT_EQ(vram_torch_pager_min_budget(mixed.size(), mixed.data(), 1), 1024u);  // 256-aligned
}

struct HostPieces {
  std::vector<std::vector<std::uint8_t>> data;
  std::vector<const void*> hosts;
  std::vector<std::size_t> bytes;
  explicit HostPieces(std::vector<std::size_t> sizes) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      data.emplace_back(sizes[i], static_cast<std::uint8_t>(0x10 + i));
    }
    for (auto& d : data) {
      hosts.push_back(d.data());
      bytes.push_back(d.size());
    }
  }
};

vram_torch_pager_options_t host_options(std::size_t budget, std::size_t depth) {
  vram_torch_pager_options_t o{};
  o.budget_bytes = budget;
  o.prefetch_depth = depth;
  o.host_double = 1;
  return o;
}

TEST(OffloadPager, RefusesABudgetBelowTheRingNamingTheLeastBudget) {
  HostPieces pieces({4096, 4096, 4096, 4096});
  const auto options = host_options(2 * 4096, 2);  // 3 slots needed
  char error[1024] = {};
  vram_torch_pager* pager =
      vram_torch_pager_create(pieces.bytes.size(), pieces.hosts.data(), pieces.bytes.data(),
                              nullptr, 0, &options, error, sizeof error);
  EXPECT_EQ(pager, nullptr);
  const std::string text = error;
  EXPECT_NE(text.find("needs at least 0 MiB (12288 bytes)"), std::string::npos) << text;
  EXPECT_NE(text.find("prefetch_depth 2"), std::string::npos) << text;
}

TEST(OffloadPager, RefusesBadArgumentsWithAReason) {
  HostPieces pieces({512, 512});
  auto options = host_options(1 << 20, 1);
  char error[512] = {};
  EXPECT_EQ(vram_torch_pager_create(2, nullptr, pieces.bytes.data(), nullptr, 0, &options, error,
                                    sizeof error),
            nullptr);
  EXPECT_NE(std::string(error).find("null argument"), std::string::npos) << error;
  options.host = 7;
  EXPECT_EQ(vram_torch_pager_create(2, pieces.hosts.data(), pieces.bytes.data(), nullptr, 0,
                                    &options, error, sizeof error),
            nullptr);
  EXPECT_NE(std::string(error).find("host must be"), std::string::npos) << error;
  options.host = 0;
  const std::size_t schedule[] = {0, 5};
  EXPECT_EQ(vram_torch_pager_create(2, pieces.hosts.data(), pieces.bytes.data(), schedule, 2,
                                    &options, error, sizeof error),
            nullptr);
  EXPECT_NE(std::string(error).find("schedule position 1"), std::string::npos) << error;
  EXPECT_EQ(vram_torch_pager_create(0, nullptr, nullptr, nullptr, 0, &options, error, sizeof error),
            nullptr);
  EXPECT_NE(std::string(error).find("no pieces"), std::string::npos) << error;
}

TEST(OffloadPager, StreamsPiecesThroughTheRingWithTheirBytes) {
  HostPieces pieces({4096, 8192, 4096, 4096, 2048});
  // Below the total: the 8 KiB piece stays resident, the others stream through 3 slots of 4 KiB.
  const auto options = host_options(8192 + 3 * 4096, 2);
  char error[512] = {};
  vram_torch_pager* pager =
      vram_torch_pager_create(pieces.bytes.size(), pieces.hosts.data(), pieces.bytes.data(),
                              nullptr, 0, &options, error, sizeof error);
  ASSERT_NE(pager, nullptr) << error;
  vram_torch_pager_plan_t plan{};
  std::vector<std::uint8_t> resident(pieces.bytes.size(), 9);
  ASSERT_EQ(vram_torch_pager_plan(pager, &plan, sizeof plan, resident.data(), resident.size()), 0);
  EXPECT_EQ(plan.slot_count, 3u);
  EXPECT_EQ(plan.prefetch_depth, 2u);
  EXPECT_LE(plan.arena_bytes, options.budget_bytes);
  std::size_t resident_count = 0;
  for (auto r : resident) {
    EXPECT_TRUE(r == 0 || r == 1);
    resident_count += r;
  }
  EXPECT_EQ(resident_count, plan.resident_pieces);
  EXPECT_EQ(resident[1], 1u);
  EXPECT_EQ(plan.slot_bytes, 4096u);
  EXPECT_GT(plan.streamed_bytes_per_step, 0u);
  for (int step = 0; step < 3; ++step) {
    for (std::size_t i = 0; i < pieces.bytes.size(); ++i) {
      const auto* p = static_cast<const std::uint8_t*>(vram_torch_pager_acquire(pager, i, nullptr));
      ASSERT_NE(p, nullptr);
      EXPECT_EQ(std::memcmp(p, pieces.data[i].data(), pieces.bytes[i]), 0) << "piece " << i;
      ASSERT_EQ(vram_torch_pager_release(pager, i, nullptr), 0);
    }
  }
  vram_torch_pager_stats_t stats{};
  ASSERT_EQ(vram_torch_pager_stats(pager, &stats, sizeof stats), 0);
  EXPECT_EQ(stats.acquires, 3u * pieces.bytes.size());
  EXPECT_GT(stats.page_ins, 0u);
  EXPECT_GT(stats.bytes_paged_in, 0u);
  EXPECT_EQ(vram_torch_pager_fallback_reason(pager, nullptr, 0), 0u);
  EXPECT_EQ(vram_torch_pager_reset_counters(pager), 0);
  ASSERT_EQ(vram_torch_pager_stats(pager, &stats, sizeof stats), 0);
  EXPECT_EQ(stats.acquires, 0u);
  EXPECT_EQ(vram_torch_pager_synchronize(pager), 0);
  vram_torch_pager_destroy(pager);
}

TEST(OffloadPager, AReleaseWithoutAcquireFailsAndTheErrorSaysWhy) {
  HostPieces pieces({1024, 1024, 1024});
  const auto options = host_options(2 * 1024, 1);
  char error[512] = {};
  vram_torch_pager* pager =
      vram_torch_pager_create(pieces.bytes.size(), pieces.hosts.data(), pieces.bytes.data(),
                              nullptr, 0, &options, error, sizeof error);
  ASSERT_NE(pager, nullptr) << error;
  EXPECT_EQ(vram_torch_pager_release(pager, 1, nullptr), -1);
  const std::size_t length = vram_torch_pager_error(pager, nullptr, 0);
  std::string text(length + 1, '\0');
  vram_torch_pager_error(pager, text.data(), text.size());
  EXPECT_NE(text.find("not acquired"), std::string::npos) << text;
  EXPECT_EQ(vram_torch_pager_acquire(pager, 99, nullptr), nullptr);  // out of range
  // Every slot held: the third acquire has no slot and says so; the pager stays usable.
  ASSERT_NE(vram_torch_pager_acquire(pager, 0, nullptr), nullptr);
  ASSERT_NE(vram_torch_pager_acquire(pager, 1, nullptr), nullptr);
  EXPECT_EQ(vram_torch_pager_acquire(pager, 2, nullptr), nullptr);
  EXPECT_EQ(vram_torch_pager_release(pager, 0, nullptr), 0);
  EXPECT_NE(vram_torch_pager_acquire(pager, 2, nullptr), nullptr);
  EXPECT_EQ(vram_torch_pager_release(pager, 1, nullptr), 0);
  EXPECT_EQ(vram_torch_pager_release(pager, 2, nullptr), 0);
  vram_torch_pager_destroy(pager);
  // Null pagers are refused, not dereferenced.
  EXPECT_EQ(vram_torch_pager_acquire(nullptr, 0, nullptr), nullptr);
  EXPECT_EQ(vram_torch_pager_release(nullptr, 0, nullptr), -1);
  EXPECT_EQ(vram_torch_pager_stats(nullptr, nullptr, 0), -1);
  vram_torch_pager_destroy(nullptr);
}

}  // namespace
