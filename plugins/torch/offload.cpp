// offload.cpp: the vram_torch_pager_* functions (vram_torch.h, "Offload") and the checks
// before a pager is made (offload.hpp).
//
// Rules:
// - No exception leaves an entry point: a failure is kept as the pager's latest error (or
//   written into create's `error` buffer) and answered with NULL / -1.
// - A vram_torch_pager owns its WeightPager; destroy waits for the pager's copies and
//   recorded releases (WeightPager's destructor).
#include "offload.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "vram/cuda/error.hpp"
#include "vram/pager_plan.hpp"
#include "vram_torch.h"

#define VRAM_TORCH_API extern "C" __attribute__((visibility("default")))

namespace vram_torch {
namespace {

std::size_t round_up(std::size_t bytes, std::size_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

std::string mib(std::size_t bytes) {
  return std::to_string(bytes >> 20) + " MiB (" + std::to_string(bytes) + " bytes)";
}

std::size_t copy_text(const std::string& text, char* buffer, std::size_t size) {
  if (buffer != nullptr && size > 0) {
    const std::size_t n = std::min(size - 1, text.size());
    std::memcpy(buffer, text.data(), n);
    buffer[n] = '\0';
  }
  return text.size();
}

}  // namespace

std::size_t min_offload_budget(std::span<const std::size_t> bytes, std::size_t depth,
                               std::size_t alignment) {
  if (alignment == 0) alignment = 1;
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  std::vector<std::size_t> aligned;
  aligned.reserve(bytes.size());
  std::size_t total = 0;
  for (std::size_t b : bytes) {
    if (b > kMax - alignment) return kMax;
    aligned.push_back(round_up(b, alignment));
    total = aligned.back() > kMax - total ? kMax : total + aligned.back();
  }
  std::size_t best = total;
  std::vector<std::size_t> sizes(aligned);
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  for (std::size_t slot : sizes) {
    std::size_t forced = 0;
    for (std::size_t a : aligned) forced += a > slot ? a : 0;
    if (slot > (kMax - forced) / (depth + 1)) continue;
    best = std::min(best, forced + (depth + 1) * slot);
  }
  return best;
}

std::unique_ptr<vram::WeightPager> make_offload_pager(std::vector<vram::WeightLayer> layers,
                                                      vram::WeightPagerOptions options,
                                                      std::unique_ptr<vram::PagerDevice> device) {
  if (layers.empty()) {
    throw vram::InvalidArgument(
        "vram_torch offload: no pieces. Fix: offload a module that has "
        "parameters.");
  }
  std::vector<std::size_t> bytes;
  bytes.reserve(layers.size());
  for (const auto& layer : layers) bytes.push_back(layer.bytes);
  const std::size_t least = min_offload_budget(bytes, options.prefetch_depth);
  if (options.budget_bytes < least) {
    const std::size_t largest = *std::max_element(bytes.begin(), bytes.end());
    throw vram::InvalidArgument(
        "vram_torch offload: a budget of " + mib(options.budget_bytes) +
        " cannot hold the pieces that must stay resident plus a ring of " +
        std::to_string(options.prefetch_depth + 1) + " slots (prefetch_depth " +
        std::to_string(options.prefetch_depth) + "; largest piece " + mib(largest) +
        "): it needs at least " + mib(least) +
        ". Fix: raise the budget, lower prefetch_depth, or page at a finer granularity.");
  }
  return std::make_unique<vram::WeightPager>(std::move(layers), std::move(options),
                                             std::move(device));
}

}  // namespace vram_torch

struct vram_torch_pager {
  std::unique_ptr<vram::WeightPager> pager;
  std::mutex error_mutex;
  std::string error;  // under error_mutex

  void fail(const char* call, const std::exception& e) noexcept {
    try {
      std::lock_guard lock(error_mutex);
      error = std::string(call) + ": " + e.what();
    } catch (...) {
    }
  }
};

VRAM_TORCH_API size_t vram_torch_pager_min_budget(size_t count, const size_t* bytes,
                                                  size_t prefetch_depth) {
  if (bytes == nullptr && count != 0) return 0;
  try {
    return vram_torch::min_offload_budget(std::span<const std::size_t>(bytes, count),
                                          prefetch_depth);
  } catch (...) {
    return 0;
  }
}

namespace {
// The figures of `plan` that vram_torch_pager_plan_t carries (the load's are the caller's).
vram_torch_pager_plan_t plan_figures(const vram::PagerPlan& plan) {
  vram_torch_pager_plan_t p{};
  p.arena_bytes = plan.arena_bytes;
  p.resident_bytes = plan.resident_bytes;
  p.slot_bytes = plan.slot_bytes;
  p.slot_count = plan.slot_count;
  p.prefetch_depth = plan.prefetch_depth;
  p.streamed_bytes_per_step = plan.streamed_bytes_per_step;
  p.resident_pieces =
      static_cast<uint64_t>(std::count(plan.resident.begin(), plan.resident.end(), true));
  return p;
}
}  // namespace

// The plan a pager over these pieces would make (plan_residency: no allocation, no pin, no
// CUDA call): the plan's sizes in `out`, each piece's residency in `resident`. 0, or -1 when
// the plan is refused (a budget below what it needs).
VRAM_TORCH_API int vram_torch_pager_preview(size_t count, const size_t* bytes,
                                            const size_t* schedule, size_t schedule_length,
                                            size_t budget_bytes, size_t prefetch_depth,
                                            vram_torch_pager_plan_t* out, size_t out_size,
                                            uint8_t* resident) {
  if (count == 0 || bytes == nullptr || out == nullptr ||
      (schedule_length != 0 && schedule == nullptr)) {
    return -1;
  }
  try {
    const std::span<const std::size_t> sizes(bytes, count);
    if (budget_bytes < vram_torch::min_offload_budget(sizes, prefetch_depth)) return -1;
    const vram::PagerPlan plan = vram::plan_residency(
        std::vector<std::size_t>(sizes.begin(), sizes.end()),
        std::vector<std::size_t>(schedule, schedule + schedule_length),
        vram::PagerPlanOptions{
            .budget_bytes = budget_bytes, .prefetch_depth = prefetch_depth, .alignment = 256});
    const vram_torch_pager_plan_t p = plan_figures(plan);
    std::memcpy(out, &p, std::min(out_size, sizeof p));
    if (resident != nullptr) {
      for (size_t i = 0; i < count; ++i) resident[i] = plan.resident[i] ? 1 : 0;
    }
    return 0;
  } catch (...) {
    return -1;
  }
}

VRAM_TORCH_API vram_torch_pager* vram_torch_pager_create(size_t count, const void* const* hosts,
                                                         const size_t* bytes,
                                                         const size_t* schedule,
                                                         size_t schedule_length,
                                                         const vram_torch_pager_options_t* options,
                                                         char* error, size_t error_size) {
  try {
    if (options == nullptr || (count != 0 && (hosts == nullptr || bytes == nullptr)) ||
        (schedule_length != 0 && schedule == nullptr)) {
      throw vram::InvalidArgument("vram_torch_pager_create: null argument");
    }
    if (options->host < 0 || options->host > 2) {
      throw vram::InvalidArgument(
          "vram_torch_pager_create: host must be 0 (automatic), 1 "
          "(pinned) or 2 (pageable), not " +
          std::to_string(options->host));
    }
    std::vector<vram::WeightLayer> layers;
    layers.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      layers.push_back({"piece." + std::to_string(i), hosts[i], bytes[i]});
    }
    vram::WeightPagerOptions o;
    o.budget_bytes = options->budget_bytes;
    o.prefetch_depth = options->prefetch_depth;
    o.schedule.assign(schedule, schedule + schedule_length);
    o.host = options->host == 1   ? vram::HostWeights::pinned
             : options->host == 2 ? vram::HostWeights::pageable
                                  : vram::HostWeights::automatic;
    o.device = options->device;
    if (options->staging_chunk_bytes != 0) o.staging_chunk_bytes = options->staging_chunk_bytes;
    if (options->staging_buffers != 0) o.staging_buffers = options->staging_buffers;
    o.fill_threads = options->fill_threads;
    o.stall_sample_period = options->stall_sample_period;
    auto pager = std::make_unique<vram_torch_pager>();
    pager->pager = vram_torch::make_offload_pager(
        std::move(layers), std::move(o),
        options->host_double ? vram_torch::make_host_pager_device() : nullptr);
    return pager.release();
  } catch (const std::exception& e) {
    vram_torch::copy_text(e.what(), error, error_size);
  } catch (...) {
    vram_torch::copy_text("unknown error", error, error_size);
  }
  return nullptr;
}

VRAM_TORCH_API void vram_torch_pager_destroy(vram_torch_pager* pager) { delete pager; }

VRAM_TORCH_API void* vram_torch_pager_acquire(vram_torch_pager* pager, size_t piece,
                                              vram_torch_stream_t stream) {
  if (pager == nullptr) return nullptr;
  try {
    return pager->pager->acquire(piece, stream);
  } catch (const std::exception& e) {
    pager->fail("acquire", e);
  }
  return nullptr;
}

VRAM_TORCH_API int vram_torch_pager_release(vram_torch_pager* pager, size_t piece,
                                            vram_torch_stream_t stream) {
  if (pager == nullptr) return -1;
  try {
    pager->pager->release(piece, stream);
    return 0;
  } catch (const std::exception& e) {
    pager->fail("release", e);
  }
  return -1;
}

// Several pieces in one call (a hooked module's pieces): out[i] is pieces[i]'s device memory.
// On a failure the pieces acquired by this call are released again and -1 is returned.
VRAM_TORCH_API int vram_torch_pager_acquire_many(vram_torch_pager* pager, size_t count,
                                                 const size_t* pieces, vram_torch_stream_t stream,
                                                 void** out) {
  if (pager == nullptr || (count != 0 && (pieces == nullptr || out == nullptr))) return -1;
  size_t done = 0;
  try {
    for (; done < count; ++done) out[done] = pager->pager->acquire(pieces[done], stream);
    return 0;
  } catch (const std::exception& e) {
    pager->fail("acquire", e);
  }
  for (size_t i = 0; i < done; ++i) {
    try {
      pager->pager->release(pieces[i], stream);
    } catch (...) {  // the first failure is the one kept
    }
  }
  return -1;
}

// Releases every piece named (each exactly once); -1 when one failed (the first failure is
// kept as the error), after trying the others.
VRAM_TORCH_API int vram_torch_pager_release_many(vram_torch_pager* pager, size_t count,
                                                 const size_t* pieces, vram_torch_stream_t stream) {
  if (pager == nullptr || (count != 0 && pieces == nullptr)) return -1;
  int result = 0;
  for (size_t i = 0; i < count; ++i) {
    try {
      pager->pager->release(pieces[i], stream);
    } catch (const std::exception& e) {
      if (result == 0) pager->fail("release", e);
      result = -1;
    }
  }
  return result;
}

VRAM_TORCH_API size_t vram_torch_pager_error(vram_torch_pager* pager, char* buffer, size_t size) {
  if (pager == nullptr) return 0;
  std::lock_guard lock(pager->error_mutex);
  return vram_torch::copy_text(pager->error, buffer, size);
}

VRAM_TORCH_API int vram_torch_pager_plan(vram_torch_pager* pager, vram_torch_pager_plan_t* out,
                                         size_t out_size, uint8_t* resident, size_t count) {
  if (pager == nullptr || out == nullptr) return -1;
  const vram::PagerPlan& plan = pager->pager->plan();
  const vram::WeightPagerLoad& load = pager->pager->load();
  vram_torch_pager_plan_t p = plan_figures(plan);
  p.pinned = load.pinned ? 1 : 0;
  p.pinned_bytes = load.pinned_bytes;
  p.register_calls = load.register_calls;
  p.already_pinned_bytes = load.already_pinned_bytes;
  p.pin_seconds = load.pin_seconds;
  p.upload_seconds = load.upload_seconds;
  std::memcpy(out, &p, std::min(out_size, sizeof p));
  if (resident != nullptr) {
    for (size_t i = 0; i < std::min(count, plan.resident.size()); ++i) {
      resident[i] = plan.resident[i] ? 1 : 0;
    }
  }
  return 0;
}

VRAM_TORCH_API size_t vram_torch_pager_fallback_reason(vram_torch_pager* pager, char* buffer,
                                                       size_t size) {
  if (pager == nullptr) return 0;
  return vram_torch::copy_text(pager->pager->load().fallback_reason, buffer, size);
}

VRAM_TORCH_API int vram_torch_pager_stats(vram_torch_pager* pager, vram_torch_pager_stats_t* out,
                                          size_t out_size) {
  if (pager == nullptr || out == nullptr) return -1;
  try {
    const vram::WeightPagerStats s = pager->pager->stats();
    vram_torch_pager_stats_t r{};
    r.acquires = s.acquires;
    r.hits = s.hits;
    r.page_ins = s.page_ins;
    r.prefetches = s.prefetches;
    r.bytes_paged_in = s.bytes_paged_in;
    r.timed_page_ins = s.timed_page_ins;
    r.timed_bytes = s.timed_bytes;
    r.stall_samples = s.stall_samples;
    r.stalled = s.stalled;
    r.staging_pin_calls = s.staging_pin_calls;
    r.timed_copy_ms = s.timed_copy_ms;
    r.effective_gbps = s.effective_gbps;
    r.stall_ms_sampled = s.stall_ms_sampled;
    r.host_wait_ms = s.host_wait_ms;
    std::memcpy(out, &r, std::min(out_size, sizeof r));
    return 0;
  } catch (const std::exception& e) {
    pager->fail("stats", e);
  }
  return -1;
}

VRAM_TORCH_API int vram_torch_pager_reset_counters(vram_torch_pager* pager) {
  if (pager == nullptr) return -1;
  try {
    pager->pager->reset_counters();
    return 0;
  } catch (const std::exception& e) {
    pager->fail("reset_counters", e);
  }
  return -1;
}

VRAM_TORCH_API int vram_torch_pager_synchronize(vram_torch_pager* pager) {
  if (pager == nullptr) return -1;
  try {
    pager->pager->synchronize();
    return 0;
  } catch (const std::exception& e) {
    pager->fail("synchronize", e);
  }
  return -1;
}
