// offload.cpp: the vram_torch_pager_* functions (vram_torch.h, "Offload") and the checks
// before a pager is made (offload.hpp).
//
// Rules:
// - No exception leaves an entry point: a failure is kept as the pager's latest error (a
//   call without a pager: the latest call error, read with vram_torch_pager_error(NULL);
//   create also writes it into `error`) and answered with NULL / -1 / 0.
// - A count from the caller is refused above kMaxEntries (no array of size_t or pointers
//   is that long) before any pointer arithmetic or read over it.
// - A vram_torch_pager owns its WeightPager; destroy waits for the pager's copies and
//   recorded releases (WeightPager's destructor).
#include "offload.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "vram/cuda/error.hpp"
#include "vram/pager_plan.hpp"
#include "vram_torch.h"

#define VRAM_TORCH_API extern "C" __attribute__((visibility("default")))

namespace vram_torch {
namespace {

constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
// The most entries an array of size_t (or of pointers) in the address space can have.
constexpr std::size_t kMaxEntries =
    static_cast<std::size_t>(std::numeric_limits<std::ptrdiff_t>::max()) / sizeof(std::size_t);
static_assert(sizeof(const void*) == sizeof(std::size_t));

// Precondition: bytes <= kMax - alignment + 1 (no wrap).
std::size_t round_up(std::size_t bytes, std::size_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

std::string mib(std::size_t bytes) {
  return std::to_string(bytes >> 20) + " MiB (" + std::to_string(bytes) + " bytes)";
}

std::size_t copy_text(std::string_view text, char* buffer, std::size_t size) noexcept {
  if (buffer != nullptr && size > 0) {
    const std::size_t n = std::min(size - 1, text.size());
    std::memcpy(buffer, text.data(), n);
    buffer[n] = '\0';
  }
  return text.size();
}

// The latest failure of a call that has no pager to keep it (min_budget, preview, create, a
// call given a NULL pager), from any thread: vram_torch_pager_error(NULL, ...).
struct CallError {
  std::mutex mutex;
  std::string text;  // under mutex
};
CallError& call_error() {
  static auto* error = new CallError;  // never destroyed: a call may come during teardown
  return *error;
}
void note_call_error(const char* call, const char* what) noexcept {
  try {
    std::string text = call != nullptr ? std::string(call) + ": " + what : std::string(what);
    CallError& error = call_error();
    std::lock_guard lock(error.mutex);
    error.text = std::move(text);
  } catch (...) {
  }
}

// Throws vram::InvalidArgument when `count` entries of `name` cannot be read: more than any
// array holds, or `pointer` NULL with count > 0. The message starts with `call` when given.
void check_array(const char* call, const char* name, const void* pointer, std::size_t count) {
  const std::string origin = call != nullptr ? std::string(call) + ": " : std::string();
  if (count > kMaxEntries) {
    throw vram::InvalidArgument(origin + "a count of " + std::to_string(count) + " for `" + name +
                                "` is more entries than an array can hold (at most " +
                                std::to_string(kMaxEntries) + "). Fix: pass the number of " +
                                "entries of `" + name +
                                "` (a negative count cast to size_t is this large).");
  }
  if (pointer == nullptr && count != 0) {
    throw vram::InvalidArgument(origin + "null argument: `" + name + "` is NULL with a count of " +
                                std::to_string(count) + ". Fix: pass an array of " +
                                std::to_string(count) + " entries, or a count of 0.");
  }
}

}  // namespace

std::size_t min_offload_budget(std::span<const std::size_t> bytes, std::size_t depth,
                               std::size_t alignment) {
  if (bytes.empty()) {
    throw vram::InvalidArgument(
        "vram_torch offload: no pieces. Fix: offload a module that has "
        "parameters.");
  }
  if (alignment == 0) alignment = 1;
  std::vector<std::size_t> aligned;
  aligned.reserve(bytes.size());
  std::size_t total = 0;  // <= kMax: every term below is at most it
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    const std::size_t b = bytes[i];
    if (b == 0) {
      throw vram::InvalidArgument("vram_torch offload: piece " + std::to_string(i) +
                                  " has 0 bytes, which the pager refuses at any budget. Fix: "
                                  "leave empty pieces out.");
    }
    if (b > kMax - alignment + 1) {
      throw vram::InvalidArgument(
          "vram_torch offload: piece " + std::to_string(i) + " (" + std::to_string(b) +
          " bytes) passes the address space once rounded up to the arena's " +
          std::to_string(alignment) +
          "-byte alignment. Fix: give each piece's real size in bytes.");
    }
    aligned.push_back(round_up(b, alignment));
    if (aligned.back() > kMax - total) {
      throw vram::InvalidArgument(
          "vram_torch offload: the sizes of pieces 0.." + std::to_string(i) +
          " add up past the address space (" + std::to_string(kMax) +
          " bytes) once aligned. Fix: give each piece's real size in bytes.");
    }
    total += aligned.back();
  }
  std::size_t best = total;
  if (depth == kMax) return best;  // a ring of 2^64 slots: only everything resident fits
  const std::size_t slots = depth + 1;
  std::vector<std::size_t> sizes(aligned);
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  for (std::size_t slot : sizes) {
    std::size_t forced = 0;  // <= total
    for (std::size_t a : aligned) forced += a > slot ? a : 0;
    if (slot > (kMax - forced) / slots) continue;  // the ring passes the address space
    best = std::min(best, forced + slots * slot);
  }
  return best;
}

void check_offload_budget(std::span<const std::size_t> bytes, std::size_t budget,
                          std::size_t depth) {
  const std::size_t least = min_offload_budget(bytes, depth);
  if (budget >= least) return;
  const std::size_t largest = *std::max_element(bytes.begin(), bytes.end());
  throw vram::InvalidArgument(
      "vram_torch offload: a budget of " + mib(budget) +
      " cannot hold the pieces that must stay resident plus a ring of " +
      (depth == kMax ? std::string("SIZE_MAX + 1") : std::to_string(depth + 1)) +
      " slots (prefetch_depth " + std::to_string(depth) + "; largest piece " + mib(largest) +
      "): it needs at least " + mib(least) +
      ". Fix: raise the budget, lower prefetch_depth, or page at a finer granularity.");
}

std::unique_ptr<vram::WeightPager> make_offload_pager(std::vector<vram::WeightLayer> layers,
                                                      vram::WeightPagerOptions options,
                                                      std::unique_ptr<vram::PagerDevice> device) {
  std::vector<std::size_t> bytes;
  bytes.reserve(layers.size());
  for (const auto& layer : layers) bytes.push_back(layer.bytes);
  check_offload_budget(bytes, options.plan.budget_bytes, options.plan.prefetch_depth);
  return std::make_unique<vram::WeightPager>(std::move(layers), std::move(options),
                                             std::move(device));
}

}  // namespace vram_torch

struct vram_torch_pager {
  std::unique_ptr<vram::WeightPager> pager;
  std::mutex error_mutex;
  std::string error;  // under error_mutex

  void fail(const char* call, const std::exception& e) noexcept { fail(call, e.what()); }
  void fail(const char* call, const char* what) noexcept {
    try {
      std::lock_guard lock(error_mutex);
      error = std::string(call) + ": " + what;
    } catch (...) {
    }
  }
};

namespace {
// A NULL pager: kept as the call error (there is no pager to keep it).
void note_null_pager(const char* call) noexcept {
  vram_torch::note_call_error(call,
                              "the pager is NULL. Fix: pass the handle vram_torch_pager_create "
                              "returned (and check it for NULL).");
}
}  // namespace

VRAM_TORCH_API size_t vram_torch_pager_min_budget(size_t count, const size_t* bytes,
                                                  size_t prefetch_depth) {
  constexpr const char* kCall = "vram_torch_pager_min_budget";
  try {
    vram_torch::check_array(nullptr, "bytes", bytes, count);
    return vram_torch::min_offload_budget(std::span<const std::size_t>(bytes, count),
                                          prefetch_depth);
  } catch (const std::exception& e) {
    vram_torch::note_call_error(kCall, e.what());
  } catch (...) {
    vram_torch::note_call_error(kCall, "unknown error");
  }
  return 0;  // never a budget: every accepted piece needs at least one aligned byte range
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
// the arguments or the plan are refused (reason: vram_torch_pager_error(NULL)).
VRAM_TORCH_API int vram_torch_pager_preview(size_t count, const size_t* bytes,
                                            const size_t* schedule, size_t schedule_length,
                                            size_t budget_bytes, size_t prefetch_depth,
                                            vram_torch_pager_plan_t* out, size_t out_size,
                                            uint8_t* resident) {
  constexpr const char* kCall = "vram_torch_pager_preview";
  try {
    vram_torch::check_array(nullptr, "bytes", bytes, count);
    vram_torch::check_array(nullptr, "schedule", schedule, schedule_length);
    if (out == nullptr) {
      throw vram::InvalidArgument(
          "null argument: `out` is NULL. Fix: pass a vram_torch_pager_plan_t to fill.");
    }
    const std::span<const std::size_t> sizes(bytes, count);
    vram_torch::check_offload_budget(sizes, budget_bytes, prefetch_depth);
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
  } catch (const std::exception& e) {
    vram_torch::note_call_error(kCall, e.what());
  } catch (...) {
    vram_torch::note_call_error(kCall, "unknown error");
  }
  return -1;
}

VRAM_TORCH_API vram_torch_pager* vram_torch_pager_create(size_t count, const void* const* hosts,
                                                         const size_t* bytes,
                                                         const size_t* schedule,
                                                         size_t schedule_length,
                                                         const vram_torch_pager_options_t* options,
                                                         char* error, size_t error_size) {
  constexpr const char* kCall = "vram_torch_pager_create";
  const char* text = "vram_torch_pager_create: unknown error";
  try {
    if (options == nullptr) {
      throw vram::InvalidArgument(
          "vram_torch_pager_create: null argument: `options` is NULL. Fix: pass a "
          "vram_torch_pager_options_t.");
    }
    vram_torch::check_array(kCall, "hosts", hosts, count);
    vram_torch::check_array(kCall, "bytes", bytes, count);
    vram_torch::check_array(kCall, "schedule", schedule, schedule_length);
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
    o.plan.budget_bytes = options->budget_bytes;
    o.plan.prefetch_depth = options->prefetch_depth;
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
    vram_torch::note_call_error(nullptr, e.what());
    vram_torch::copy_text(e.what(), error, error_size);
    return nullptr;
  } catch (...) {
  }
  vram_torch::note_call_error(nullptr, text);
  vram_torch::copy_text(text, error, error_size);
  return nullptr;
}

VRAM_TORCH_API void vram_torch_pager_destroy(vram_torch_pager* pager) { delete pager; }

VRAM_TORCH_API void* vram_torch_pager_acquire(vram_torch_pager* pager, size_t piece,
                                              vram_torch_stream_t stream) {
  if (pager == nullptr) {
    note_null_pager("vram_torch_pager_acquire");
    return nullptr;
  }
  try {
    return pager->pager->acquire(piece, stream);
  } catch (const std::exception& e) {
    pager->fail("acquire", e);
  }
  return nullptr;
}

VRAM_TORCH_API int vram_torch_pager_release(vram_torch_pager* pager, size_t piece,
                                            vram_torch_stream_t stream) {
  if (pager == nullptr) {
    note_null_pager("vram_torch_pager_release");
    return -1;
  }
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
  if (pager == nullptr) {
    note_null_pager("vram_torch_pager_acquire_many");
    return -1;
  }
  try {
    vram_torch::check_array(nullptr, "pieces", pieces, count);
    vram_torch::check_array(nullptr, "out", out, count);
  } catch (const std::exception& e) {
    pager->fail("acquire_many", e);
    return -1;
  }
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
  if (pager == nullptr) {
    note_null_pager("vram_torch_pager_release_many");
    return -1;
  }
  try {
    vram_torch::check_array(nullptr, "pieces", pieces, count);
  } catch (const std::exception& e) {
    pager->fail("release_many", e);
    return -1;
  }
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
  if (pager == nullptr) {
    vram_torch::CallError& error = vram_torch::call_error();
    std::lock_guard lock(error.mutex);
    return vram_torch::copy_text(error.text, buffer, size);
  }
  std::lock_guard lock(pager->error_mutex);
  return vram_torch::copy_text(pager->error, buffer, size);
}

VRAM_TORCH_API int vram_torch_pager_plan(vram_torch_pager* pager, vram_torch_pager_plan_t* out,
                                         size_t out_size, uint8_t* resident, size_t count) {
  if (pager == nullptr) {
    note_null_pager("vram_torch_pager_plan");
    return -1;
  }
  if (out == nullptr) {
    pager->fail("plan",
                "null argument: `out` is NULL. Fix: pass a vram_torch_pager_plan_t to fill.");
    return -1;
  }
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
  if (pager == nullptr) {
    note_null_pager("vram_torch_pager_fallback_reason");
    return 0;
  }
  return vram_torch::copy_text(pager->pager->load().fallback_reason, buffer, size);
}

VRAM_TORCH_API int vram_torch_pager_stats(vram_torch_pager* pager, vram_torch_pager_stats_t* out,
                                          size_t out_size) {
  if (pager == nullptr) {
    note_null_pager("vram_torch_pager_stats");
    return -1;
  }
  if (out == nullptr) {
    pager->fail("stats",
                "null argument: `out` is NULL. Fix: pass a vram_torch_pager_stats_t to fill.");
    return -1;
  }
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
  if (pager == nullptr) {
    note_null_pager("vram_torch_pager_reset_counters");
    return -1;
  }
  try {
    pager->pager->reset_counters();
    return 0;
  } catch (const std::exception& e) {
    pager->fail("reset_counters", e);
  }
  return -1;
}

VRAM_TORCH_API int vram_torch_pager_synchronize(vram_torch_pager* pager) {
  if (pager == nullptr) {
    note_null_pager("vram_torch_pager_synchronize");
    return -1;
  }
  try {
    pager->pager->synchronize();
    return 0;
  } catch (const std::exception& e) {
    pager->fail("synchronize", e);
  }
  return -1;
}
