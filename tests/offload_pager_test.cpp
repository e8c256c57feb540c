// The plug-in's offload functions (plugins/torch/offload.cpp, vram_torch.h "Offload") on the
// host: the least budget, refusals before anything is made, and the pager's C interface over
// host memory standing in for the device (host_double).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "offload.hpp"
#include "vram/cuda/error.hpp"
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

// ---- The C interface at its limits: every refusal answers the documented failure value and
// leaves a reason naming the problem; nothing traps (SIGFPE, wrap, read past an array).

constexpr std::size_t kSizeMax = std::numeric_limits<std::size_t>::max();

// The latest error of a call without a pager (vram_torch_pager_error(NULL)).
std::string call_error() {
  const std::size_t length = vram_torch_pager_error(nullptr, nullptr, 0);
  std::string text(length + 1, '\0');
  EXPECT_EQ(vram_torch_pager_error(nullptr, text.data(), text.size()), length);
  text.resize(length);
  return text;
}

std::string pager_error(vram_torch_pager* pager) {
  const std::size_t length = vram_torch_pager_error(pager, nullptr, 0);
  std::string text(length + 1, '\0');
  vram_torch_pager_error(pager, text.data(), text.size());
  text.resize(length);
  return text;
}

// Acquires and releases every piece in turn; each reads back its host bytes.
void expect_every_piece_reads_back(vram_torch_pager* pager, const HostPieces& pieces) {
  for (std::size_t i = 0; i < pieces.bytes.size(); ++i) {
    const auto* p = static_cast<const std::uint8_t*>(vram_torch_pager_acquire(pager, i, nullptr));
    ASSERT_NE(p, nullptr) << pager_error(pager);
    EXPECT_EQ(std::memcmp(p, pieces.data[i].data(), pieces.bytes[i]), 0) << "piece " << i;
    EXPECT_EQ(vram_torch_pager_release(pager, i, nullptr), 0);
  }
}

bool names(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Four 4 KiB pieces: a ring of depth + 1 slots of 4 KiB, or 16 KiB with every piece resident.
const std::vector<std::size_t> kFour = {4096, 4096, 4096, 4096};
constexpr std::size_t kFourTotal = 4 * 4096;

TEST(OffloadCApi, PrefetchDepthSizeMaxNeedsEveryPieceResidentNotADivisionByZero) {
  // A ring of SIZE_MAX + 1 slots never fits: only the total does.
  EXPECT_EQ(vram_torch_pager_min_budget(kFour.size(), kFour.data(), kSizeMax), kFourTotal);
  EXPECT_EQ(vram_torch::min_offload_budget(kFour, kSizeMax, 1), kFourTotal);
  // Rings just below it pass the address space as well: the same answer, no wrap.
  EXPECT_EQ(vram_torch_pager_min_budget(kFour.size(), kFour.data(), kSizeMax - 1), kFourTotal);
  EXPECT_EQ(vram_torch_pager_min_budget(kFour.size(), kFour.data(), kSizeMax / 2), kFourTotal);
  EXPECT_EQ(vram_torch_pager_min_budget(kFour.size(), kFour.data(), 2), kFourTotal - 4096);
}

TEST(OffloadCApi, PrefetchDepthSizeMaxIsRefusedBelowTheTotalNotADivisionByZero) {
  HostPieces pieces(kFour);
  const auto options = host_options(kFourTotal - 1, kSizeMax);
  char error[1024] = {};
  EXPECT_EQ(vram_torch_pager_create(pieces.bytes.size(), pieces.hosts.data(), pieces.bytes.data(),
                                    nullptr, 0, &options, error, sizeof error),
            nullptr);
  const std::string text = error;
  EXPECT_TRUE(names(text, "a ring of SIZE_MAX + 1 slots")) << text;  // not a wrapped 0
  EXPECT_TRUE(names(text, "prefetch_depth 18446744073709551615")) << text;
  EXPECT_TRUE(names(text, "needs at least 0 MiB (16384 bytes)")) << text;
  EXPECT_TRUE(names(text, "Fix:")) << text;
  EXPECT_EQ(call_error(), text);
  vram_torch_pager_plan_t plan{};
  EXPECT_EQ(vram_torch_pager_preview(pieces.bytes.size(), pieces.bytes.data(), nullptr, 0,
                                     kFourTotal - 1, kSizeMax, &plan, sizeof plan, nullptr),
            -1);
  EXPECT_TRUE(names(call_error(), "vram_torch_pager_preview: ")) << call_error();
  EXPECT_TRUE(names(call_error(), "needs at least 0 MiB (16384 bytes)")) << call_error();
}

TEST(OffloadCApi, PrefetchDepthSizeMaxWithTheTotalKeepsEveryPieceResident) {
  HostPieces pieces(kFour);
  const auto options = host_options(kFourTotal, kSizeMax);
  char error[512] = {};
  vram_torch_pager* pager =
      vram_torch_pager_create(pieces.bytes.size(), pieces.hosts.data(), pieces.bytes.data(),
                              nullptr, 0, &options, error, sizeof error);
  ASSERT_NE(pager, nullptr) << error;
  vram_torch_pager_plan_t plan{};
  ASSERT_EQ(vram_torch_pager_plan(pager, &plan, sizeof plan, nullptr, 0), 0);
  EXPECT_EQ(plan.slot_count, 0u);
  EXPECT_EQ(plan.resident_pieces, kFour.size());
  EXPECT_EQ(plan.arena_bytes, kFourTotal);
  expect_every_piece_reads_back(pager, pieces);
  vram_torch_pager_destroy(pager);
}

TEST(OffloadCApi, PrefetchDepthZeroIsOneSlot) {
  EXPECT_EQ(vram_torch_pager_min_budget(kFour.size(), kFour.data(), 0), 4096u);
  HostPieces pieces(kFour);
  const auto options = host_options(4096, 0);
  char error[512] = {};
  ::testing::internal::CaptureStderr();  // the plan's "no prefetch" warning
  vram_torch_pager* pager =
      vram_torch_pager_create(pieces.bytes.size(), pieces.hosts.data(), pieces.bytes.data(),
                              nullptr, 0, &options, error, sizeof error);
  (void)::testing::internal::GetCapturedStderr();
  ASSERT_NE(pager, nullptr) << error;
  vram_torch_pager_plan_t plan{};
  ASSERT_EQ(vram_torch_pager_plan(pager, &plan, sizeof plan, nullptr, 0), 0);
  EXPECT_EQ(plan.slot_count, 1u);
  EXPECT_EQ(plan.prefetch_depth, 0u);
  expect_every_piece_reads_back(pager, pieces);
  vram_torch_pager_destroy(pager);
}

TEST(OffloadCApi, SizesWhoseSumPassesTheAddressSpaceAreRefusedNotWrapped) {
  const std::size_t half = std::size_t{1} << 63;
  const std::vector<std::size_t> wraps = {half, half, 1};
  EXPECT_EQ(vram_torch_pager_min_budget(wraps.size(), wraps.data(), 0), 0u);
  const std::string text = call_error();
  EXPECT_TRUE(names(text, "vram_torch_pager_min_budget: ")) << text;
  EXPECT_TRUE(names(text, "sizes of pieces 0..1 add up past the address space")) << text;
  EXPECT_TRUE(names(text, "Fix:")) << text;
  EXPECT_THROW((void)vram_torch::min_offload_budget(wraps, 0), vram::InvalidArgument);
}

TEST(OffloadCApi, SizesJustInsideTheAddressSpaceGiveTheExactBudget) {
  const std::size_t half = std::size_t{1} << 63;
  // Total 2^64 - 256: one slot of the larger piece streams both.
  const std::vector<std::size_t> edge = {half, half - 256};
  EXPECT_EQ(vram_torch_pager_min_budget(edge.size(), edge.data(), 0), half);
  EXPECT_EQ(vram_torch_pager_min_budget(edge.size(), edge.data(), 1), kSizeMax - 255);
  // The largest piece whose 256-byte alignment does not wrap, and the first that does.
  const std::size_t largest = kSizeMax - 255;
  EXPECT_EQ(vram_torch_pager_min_budget(1, &largest, 1), largest);
  const std::size_t wraps = largest + 1;
  EXPECT_EQ(vram_torch_pager_min_budget(1, &wraps, 1), 0u);
  EXPECT_TRUE(names(call_error(),
                    "piece 0 (18446744073709551361 bytes) passes the address "
                    "space once rounded up to the arena's 256-byte alignment"))
      << call_error();
}

TEST(OffloadCApi, NullBytesWithACountIsRefusedWithAReason) {
  EXPECT_EQ(vram_torch_pager_min_budget(3, nullptr, 1), 0u);
  EXPECT_TRUE(names(call_error(), "`bytes` is NULL with a count of 3")) << call_error();
  vram_torch_pager_plan_t plan{};
  EXPECT_EQ(
      vram_torch_pager_preview(3, nullptr, nullptr, 0, 1 << 20, 1, &plan, sizeof plan, nullptr),
      -1);
  EXPECT_TRUE(names(call_error(), "vram_torch_pager_preview: null argument: `bytes` is NULL"))
      << call_error();
  HostPieces pieces({512, 512});
  const auto options = host_options(1 << 20, 1);
  char error[512] = {};
  EXPECT_EQ(vram_torch_pager_create(2, pieces.hosts.data(), nullptr, nullptr, 0, &options, error,
                                    sizeof error),
            nullptr);
  EXPECT_TRUE(names(error, "null argument: `bytes` is NULL with a count of 2")) << error;
  EXPECT_EQ(call_error(), error);
  EXPECT_EQ(vram_torch_pager_create(2, pieces.hosts.data(), pieces.bytes.data(), nullptr, 0,
                                    nullptr, error, sizeof error),
            nullptr);
  EXPECT_TRUE(names(error, "`options` is NULL")) << error;
}

TEST(OffloadCApi, CountZeroIsRefusedAsNoPieces) {
  const std::size_t one = 4096;
  EXPECT_EQ(vram_torch_pager_min_budget(0, nullptr, 1), 0u);
  EXPECT_TRUE(names(call_error(), "vram_torch_pager_min_budget: vram_torch offload: no pieces"))
      << call_error();
  EXPECT_EQ(vram_torch_pager_min_budget(0, &one, 1), 0u);
  EXPECT_TRUE(names(call_error(), "no pieces")) << call_error();
  vram_torch_pager_plan_t plan{};
  EXPECT_EQ(vram_torch_pager_preview(0, &one, nullptr, 0, 1 << 20, 1, &plan, sizeof plan, nullptr),
            -1);
  EXPECT_TRUE(names(call_error(), "vram_torch_pager_preview: vram_torch offload: no pieces"))
      << call_error();
}

TEST(OffloadCApi, APieceOfZeroBytesIsRefusedNamingThePiece) {
  const std::vector<std::size_t> sizes = {4096, 0, 4096};
  EXPECT_EQ(vram_torch_pager_min_budget(sizes.size(), sizes.data(), 1), 0u);
  EXPECT_TRUE(names(call_error(), "piece 1 has 0 bytes")) << call_error();
  EXPECT_TRUE(names(call_error(), "Fix: leave empty pieces out")) << call_error();
  vram_torch_pager_plan_t plan{};
  EXPECT_EQ(vram_torch_pager_preview(sizes.size(), sizes.data(), nullptr, 0, 1 << 20, 1, &plan,
                                     sizeof plan, nullptr),
            -1);
  EXPECT_TRUE(names(call_error(), "piece 1 has 0 bytes")) << call_error();
  HostPieces pieces({4096, 4096});
  pieces.bytes[0] = 0;
  const auto options = host_options(1 << 20, 1);
  char error[512] = {};
  EXPECT_EQ(vram_torch_pager_create(2, pieces.hosts.data(), pieces.bytes.data(), nullptr, 0,
                                    &options, error, sizeof error),
            nullptr);
  EXPECT_TRUE(names(error, "piece 0 has 0 bytes")) << error;
}

TEST(OffloadCApi, ACountNoArrayCanHoldIsRefusedBeforeReadingTheArray) {
  // SIZE_MAX is what a count of -1 becomes: nothing may be read or offset by it.
  const std::size_t one = 4096;
  EXPECT_EQ(vram_torch_pager_min_budget(kSizeMax, &one, 1), 0u);
  EXPECT_TRUE(names(call_error(),
                    "a count of 18446744073709551615 for `bytes` is more entries "
                    "than an array can hold"))
      << call_error();
  vram_torch_pager_plan_t plan{};
  const std::size_t schedule[] = {0};
  EXPECT_EQ(vram_torch_pager_preview(1, &one, schedule, kSizeMax, 1 << 20, 1, &plan, sizeof plan,
                                     nullptr),
            -1);
  EXPECT_TRUE(names(call_error(), "for `schedule` is more entries")) << call_error();
  HostPieces pieces({512, 512});
  const auto options = host_options(1 << 20, 1);
  char error[512] = {};
  EXPECT_EQ(vram_torch_pager_create(kSizeMax, pieces.hosts.data(), pieces.bytes.data(), nullptr, 0,
                                    &options, error, sizeof error),
            nullptr);
  EXPECT_TRUE(names(error, "for `hosts` is more entries")) << error;
  EXPECT_EQ(vram_torch_pager_create(2, pieces.hosts.data(), pieces.bytes.data(), schedule, kSizeMax,
                                    &options, error, sizeof error),
            nullptr);
  EXPECT_TRUE(names(error, "for `schedule` is more entries")) << error;
}

TEST(OffloadCApi, BudgetZeroIsRefusedNamingTheLeastBudget) {
  HostPieces pieces(kFour);
  const auto options = host_options(0, 1);
  char error[1024] = {};
  EXPECT_EQ(vram_torch_pager_create(pieces.bytes.size(), pieces.hosts.data(), pieces.bytes.data(),
                                    nullptr, 0, &options, error, sizeof error),
            nullptr);
  EXPECT_TRUE(names(error, "a budget of 0 MiB (0 bytes)")) << error;
  EXPECT_TRUE(names(error, "needs at least 0 MiB (8192 bytes)")) << error;
  vram_torch_pager_plan_t plan{};
  EXPECT_EQ(vram_torch_pager_preview(kFour.size(), kFour.data(), nullptr, 0, 0, 1, &plan,
                                     sizeof plan, nullptr),
            -1);
  EXPECT_TRUE(names(call_error(), "needs at least 0 MiB (8192 bytes)")) << call_error();
}

TEST(OffloadCApi, BudgetSizeMaxKeepsEveryPieceResident) {
  vram_torch_pager_plan_t plan{};
  std::vector<std::uint8_t> resident(kFour.size(), 9);
  ASSERT_EQ(vram_torch_pager_preview(kFour.size(), kFour.data(), nullptr, 0, kSizeMax, 1, &plan,
                                     sizeof plan, resident.data()),
            0)
      << call_error();
  EXPECT_EQ(plan.arena_bytes, kFourTotal);
  EXPECT_EQ(plan.slot_count, 0u);
  EXPECT_EQ(resident, std::vector<std::uint8_t>(kFour.size(), 1));
  HostPieces pieces(kFour);
  const auto options = host_options(kSizeMax, 1);
  char error[512] = {};
  vram_torch_pager* pager =
      vram_torch_pager_create(pieces.bytes.size(), pieces.hosts.data(), pieces.bytes.data(),
                              nullptr, 0, &options, error, sizeof error);
  ASSERT_NE(pager, nullptr) << error;
  ASSERT_EQ(vram_torch_pager_plan(pager, &plan, sizeof plan, nullptr, 0), 0);
  EXPECT_EQ(plan.arena_bytes, kFourTotal);
  EXPECT_EQ(plan.resident_pieces, kFour.size());
  vram_torch_pager_destroy(pager);
}

TEST(OffloadCApi, PreviewRefusesANullOutAndANullScheduleWithAReason) {
  EXPECT_EQ(vram_torch_pager_preview(kFour.size(), kFour.data(), nullptr, 0, 1 << 20, 1, nullptr, 0,
                                     nullptr),
            -1);
  EXPECT_TRUE(names(call_error(), "`out` is NULL")) << call_error();
  vram_torch_pager_plan_t plan{};
  EXPECT_EQ(vram_torch_pager_preview(kFour.size(), kFour.data(), nullptr, 2, 1 << 20, 1, &plan,
                                     sizeof plan, nullptr),
            -1);
  EXPECT_TRUE(names(call_error(), "`schedule` is NULL with a count of 2")) << call_error();
}

TEST(OffloadCApi, ManyCallsRefuseNullAndOversizedArraysWithAReason) {
  HostPieces pieces({1024, 1024, 1024});
  const auto options = host_options(2 * 1024, 1);
  char error[512] = {};
  vram_torch_pager* pager =
      vram_torch_pager_create(pieces.bytes.size(), pieces.hosts.data(), pieces.bytes.data(),
                              nullptr, 0, &options, error, sizeof error);
  ASSERT_NE(pager, nullptr) << error;
  void* out[2] = {};
  const std::size_t which[] = {0, 1};
  EXPECT_EQ(vram_torch_pager_acquire_many(pager, 2, nullptr, nullptr, out), -1);
  EXPECT_TRUE(names(pager_error(pager), "acquire_many: null argument: `pieces` is NULL"))
      << pager_error(pager);
  EXPECT_EQ(vram_torch_pager_acquire_many(pager, 2, which, nullptr, nullptr), -1);
  EXPECT_TRUE(names(pager_error(pager), "`out` is NULL")) << pager_error(pager);
  EXPECT_EQ(vram_torch_pager_acquire_many(pager, kSizeMax, which, nullptr, out), -1);
  EXPECT_TRUE(names(pager_error(pager), "for `pieces` is more entries")) << pager_error(pager);
  EXPECT_EQ(vram_torch_pager_release_many(pager, 2, nullptr, nullptr), -1);
  EXPECT_TRUE(names(pager_error(pager), "release_many: null argument")) << pager_error(pager);
  EXPECT_EQ(vram_torch_pager_release_many(pager, kSizeMax, which, nullptr), -1);
  EXPECT_TRUE(names(pager_error(pager), "release_many: a count of 18446744073709551615"))
      << pager_error(pager);
  // Nothing was acquired by the refused calls; count 0 is a valid empty call.
  EXPECT_EQ(vram_torch_pager_acquire_many(pager, 0, nullptr, nullptr, nullptr), 0);
  EXPECT_EQ(vram_torch_pager_acquire_many(pager, 2, which, nullptr, out), 0);
  EXPECT_NE(out[0], nullptr);
  EXPECT_NE(out[1], nullptr);
  EXPECT_EQ(vram_torch_pager_release_many(pager, 2, which, nullptr), 0);
  vram_torch_pager_plan_t plan{};
  EXPECT_EQ(vram_torch_pager_plan(pager, nullptr, sizeof plan, nullptr, 0), -1);
  EXPECT_TRUE(names(pager_error(pager), "plan: null argument: `out` is NULL"))
      << pager_error(pager);
  EXPECT_EQ(vram_torch_pager_stats(pager, nullptr, 0), -1);
  EXPECT_TRUE(names(pager_error(pager), "stats: null argument: `out` is NULL"))
      << pager_error(pager);
  EXPECT_EQ(vram_torch_pager_acquire(pager, kSizeMax, nullptr), nullptr);
  EXPECT_TRUE(names(pager_error(pager), "acquire of layer 18446744073709551615 out of 3"))
      << pager_error(pager);
  vram_torch_pager_destroy(pager);
}

TEST(OffloadCApi, ANullPagerIsRefusedWithACallError) {
  EXPECT_EQ(vram_torch_pager_acquire(nullptr, 0, nullptr), nullptr);
  EXPECT_TRUE(names(call_error(), "vram_torch_pager_acquire: the pager is NULL")) << call_error();
  const std::size_t piece = 0;
  EXPECT_EQ(vram_torch_pager_release_many(nullptr, 1, &piece, nullptr), -1);
  EXPECT_TRUE(names(call_error(), "vram_torch_pager_release_many: the pager is NULL"))
      << call_error();
  EXPECT_EQ(vram_torch_pager_synchronize(nullptr), -1);
  EXPECT_TRUE(names(call_error(), "vram_torch_pager_synchronize: the pager is NULL"))
      << call_error();
  EXPECT_EQ(vram_torch_pager_fallback_reason(nullptr, nullptr, 0), 0u);
  // A buffer of size 0 or NULL gets nothing written; the full length is still returned.
  char small[4] = {'x', 'x', 'x', 'x'};
  const std::size_t length = vram_torch_pager_error(nullptr, small, 0);
  EXPECT_GT(length, 0u);
  EXPECT_EQ(small[0], 'x');
  EXPECT_EQ(vram_torch_pager_error(nullptr, small, sizeof small), length);
  EXPECT_EQ(std::string(small), call_error().substr(0, 3));
}

}  // namespace
