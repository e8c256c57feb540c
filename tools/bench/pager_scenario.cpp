// `vram bench --scenario pager`: a layer stack several times the VRAM budget, run step after
// step (one step = one pass over every layer), each layer's compute a GEMM-shaped kernel
// (bench/pager_kernels.cu) made copy-bound or compute-bound by its arithmetic intensity.
// In the same run, against:
//   all resident        every layer in VRAM, no paging (reference: the compute floor)
//   copy bound          bytes that cannot stay resident / the pinned H2D rate measured here
//   two-slot prefetch   a side stream copies layer i+1 while layer i computes, every layer
//                       streamed (the careful PyTorch pattern), pinned source
//   synchronous         copy, then compute, on one stream (simple offload hooks)
//   pin per page-in     cudaHostAlloc + memcpy + copy + cudaFreeHost for every layer
// and, for pageable host weights, the pager's staged GB/s against a pageable cudaMemcpyAsync.
// Step times are CUDA events on the compute stream at step boundaries (steps run back to
// back, one host sync at the end); medians over the measured steps after a warm-up step.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/scenarios.hpp"
#include "staging/pageable_stager.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/event.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/units.hpp"
#include "vram/weight_pager.hpp"

#if defined(VRAM_HAVE_BENCH_KERNELS)
#include "bench/pager_kernels.hpp"
#endif

namespace vram::bench {

#if !defined(VRAM_HAVE_BENCH_KERNELS)

std::size_t pager_scenario_steps(const BenchConfig&) { return 0; }
void run_pager_scenario(const BenchConfig&, Progress&, std::vector<Measurement>&) {
  std::printf(
      "vram bench: scenario 'pager' skipped: built without the bench kernels "
      "(VRAM_BENCH_KERNELS=OFF)\n");
}

#else

namespace {

using namespace vram::literals;

struct StackShape {
  std::size_t layers;
  std::size_t layer_bytes;
  std::size_t budget;
  std::size_t warmup_steps;
  std::size_t steps;
};

StackShape shape_for(const BenchConfig& c) {
  if (c.quick) return {16, 64_MiB, 384_MiB, 1, 4};  // 1 GiB under 384 MiB
  return {48, 256_MiB, 4_GiB, 1, 5};                // 12 GiB under 4 GiB
}

Measurement pager_measurement(const std::string& parameter, double value, const std::string& name,
                              bool ours, bool reference, const std::string& unit,
                              bool lower_is_better, const std::vector<double>& samples) {
  Measurement m = bench::make_measurement("pager", parameter, value, name, ours, unit,
                                          lower_is_better, samples);
  m.reference = reference;
  return m;
}

// Host weights: one allocation, layer i at i * layer_bytes, filled with fp16 0.5 on several
// threads (page faults in parallel).
class HostStack {
 public:
  explicit HostStack(const StackShape& shape) : shape_(shape) {
    bytes_ = shape.layers * shape.layer_bytes;
    data_ = static_cast<std::byte*>(std::aligned_alloc(4096, bytes_));
    if (data_ == nullptr) throw OutOfMemory(bytes_, 0, 0, "bench: host weights");
    const unsigned threads = std::min(16U, std::max(1U, std::thread::hardware_concurrency()));
    std::vector<std::thread> workers;
    const std::size_t slice = (bytes_ / threads + 4095) / 4096 * 4096;
    for (unsigned t = 0; t < threads; ++t) {
      workers.emplace_back([this, t, slice] {
        const std::size_t begin = std::min(bytes_, t * slice);
        const std::size_t end = std::min(bytes_, begin + slice);
        auto* words = reinterpret_cast<std::uint32_t*>(data_ + begin);
        std::fill(words, words + (end - begin) / 4, 0x38003800U);  // two fp16 0.5
      });
    }
    for (auto& worker : workers) worker.join();
  }
  ~HostStack() { std::free(data_); }
  HostStack(const HostStack&) = delete;
  HostStack& operator=(const HostStack&) = delete;

  const std::byte* layer(std::size_t i) const { return data_ + i * shape_.layer_bytes; }
  std::vector<WeightLayer> layers() const {
    std::vector<WeightLayer> result;
    for (std::size_t i = 0; i < shape_.layers; ++i) {
      result.push_back({"layer." + std::to_string(i), layer(i), shape_.layer_bytes});
    }
    return result;
  }
  // Page-locks the whole stack for the pinned baselines (chunks of at most 2 GiB).
  void pin() {
    for (std::size_t at = 0; at < bytes_; at += 2_GiB) {
      const std::size_t length = std::min(2_GiB, bytes_ - at);
      cuda::check(cudaHostRegister(data_ + at, length, cudaHostRegisterPortable),
                  "cudaHostRegister(bench host weights)");
      pinned_.push_back(data_ + at);
    }
  }
  void unpin() noexcept {
    for (void* chunk : pinned_) {
      if (cudaHostUnregister(chunk) != cudaSuccess) (void)cudaGetLastError();
    }
    pinned_.clear();
  }

 private:
  StackShape shape_;
  std::size_t bytes_ = 0;
  std::byte* data_ = nullptr;
  std::vector<void*> pinned_;
};

class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    cuda::check(cudaMalloc(&data_, bytes), "cudaMalloc(bench)");
  }
  ~DeviceBuffer() {
    if (cudaFree(data_) != cudaSuccess) (void)cudaGetLastError();
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::byte* get() const { return static_cast<std::byte*>(data_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_;
};

// Runs warm-up + measured steps back to back on `stream`; returns ms per measured step.
std::vector<double> time_steps(const StackShape& shape, cudaStream_t stream,
                               const std::function<void()>& step) {
  const std::size_t total = shape.warmup_steps + shape.steps;
  std::vector<cuda::Event> marks;
  for (std::size_t i = 0; i <= total; ++i) marks.emplace_back(cuda::Event::Timing::enabled);
  for (std::size_t i = 0; i < total; ++i) {
    marks[i].record(stream);
    step();
  }
  marks[total].record(stream);
  marks[total].wait();
  std::vector<double> ms;
  for (std::size_t i = shape.warmup_steps; i < total; ++i) {
    ms.push_back(cuda::Event::elapsed_ms(marks[i], marks[i + 1]));
  }
  return ms;
}

// The compute kernel's grid: 4 blocks of 256 threads per SM.
int compute_blocks() {
  int device = 0;
  int sms = 0;
  cuda::check(cudaGetDevice(&device), "cudaGetDevice");
  cuda::check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
              "cudaDeviceGetAttribute(MultiProcessorCount)");
  return 4 * sms;
}

void run_compute(const void* weights, std::size_t bytes, unsigned intensity, float* out, int blocks,
                 cudaStream_t stream) {
  cuda::check(launch_pager_compute(weights, bytes, intensity, out, blocks, stream),
              "pager_compute<<<>>>");
}

double median(std::vector<double> values) { return summarize(std::move(values)).median; }

// Pinned H2D rate (GB/s) from a pre-pinned buffer of one layer.
double measure_pinned_rate(std::size_t bytes, cudaStream_t stream) {
  void* pinned = nullptr;
  cuda::check(cudaHostAlloc(&pinned, bytes, cudaHostAllocPortable), "cudaHostAlloc(rate)");
  std::memset(pinned, 0, bytes);
  DeviceBuffer device(bytes);
  std::vector<double> rates;
  cuda::Event start(cuda::Event::Timing::enabled);
  cuda::Event end(cuda::Event::Timing::enabled);
  for (int i = 0; i < 9; ++i) {
    start.record(stream);
    cuda::check(cudaMemcpyAsync(device.get(), pinned, bytes, cudaMemcpyHostToDevice, stream),
                "cudaMemcpyAsync(rate)");
    end.record(stream);
    end.wait();
    if (i > 0) {
      rates.push_back(static_cast<double>(bytes) / cuda::Event::elapsed_ms(start, end) / 1e6);
    }
  }
  (void)cudaFreeHost(pinned);
  return median(rates);
}

// The intensity whose kernel time per layer is about `target_ms` (linear fit on two runs).
unsigned calibrate_intensity(std::size_t bytes, double target_ms, float* out, int blocks,
                             cudaStream_t stream) {
  DeviceBuffer weights(bytes);
  cuda::check(cudaMemset(weights.get(), 0x38, bytes), "cudaMemset");
  auto time_at = [&](unsigned intensity) {
    cuda::Event start(cuda::Event::Timing::enabled);
    cuda::Event end(cuda::Event::Timing::enabled);
    run_compute(weights.get(), bytes, intensity, out, blocks, stream);  // warm
    start.record(stream);
    run_compute(weights.get(), bytes, intensity, out, blocks, stream);
    end.record(stream);
    end.wait();
    return static_cast<double>(cuda::Event::elapsed_ms(start, end));
  };
  const double base = time_at(0);
  const unsigned probe = 256;  // long enough (ms) for a clean slope
  const double per_unit = std::max(1e-6, (time_at(probe) - base) / probe);
  const double wanted = (target_ms - base) / per_unit;
  return static_cast<unsigned>(std::clamp(wanted, 1.0, 1e6));
}

}  // namespace

std::size_t pager_scenario_steps(const BenchConfig&) { return 14; }

void run_pager_scenario(const BenchConfig& c, Progress& progress,
                        std::vector<Measurement>& results) {
  const StackShape shape = shape_for(c);
  const std::size_t n = shape.layers;
  const std::size_t bytes = shape.layer_bytes;
  const std::string stack =
      std::to_string(n) + " x " + format_bytes(bytes) + ", budget " + format_bytes(shape.budget);
  cuda::Stream compute;
  cuda::Stream side;  // the two-slot pattern's copy stream
  const int blocks = compute_blocks();
  DeviceBuffer out_buffer(std::size_t(blocks) * kPagerComputeThreads * sizeof(float));
  float* out = reinterpret_cast<float*>(out_buffer.get());

  progress.step("pager: host weights and H2D rate");
  HostStack host(shape);
  const double pinned_gbps = measure_pinned_rate(bytes, compute.get());
  const double copy_ms_per_layer = static_cast<double>(bytes) / pinned_gbps / 1e6;
  struct Regime {
    std::string name;
    unsigned intensity;
  };
  // Copy-bound: a pure read of the weights. Compute-bound: each layer computes for about
  // 1.5x its copy time, so prefetch can hide every copy.
  const unsigned heavy =
      calibrate_intensity(bytes, 1.5 * copy_ms_per_layer, out, blocks, compute.get());
  const std::vector<Regime> regimes = {{"copy-bound", 0}, {"compute-bound", heavy}};

  const PagerPlan plan = plan_residency(std::vector<std::size_t>(n, bytes), {},
                                        {.budget_bytes = shape.budget, .prefetch_depth = 1});
  const double streamed_bytes = static_cast<double>(plan.streamed_bytes_per_step);
  const double copy_bound_ms = streamed_bytes / pinned_gbps / 1e6;

  // (a) all resident needs the whole stack in VRAM: uploaded once, if the card holds it.
  std::unique_ptr<DeviceBuffer> all;
  {
    progress.step("pager: all-resident upload");
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    cuda::check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
    if (free_bytes > n * bytes + shape.budget + 1_GiB) {
      all = std::make_unique<DeviceBuffer>(n * bytes);
      cuda::check(cudaMemcpy(all->get(), host.layer(0), n * bytes, cudaMemcpyHostToDevice),
                  "cudaMemcpy(all resident)");
    } else {
      std::printf("vram bench: pager: all-resident reference skipped (%s free)\n",
                  format_bytes(free_bytes).c_str());
    }
  }

  for (const auto& regime : regimes) {
    const std::string parameter = stack + ", " + regime.name;
    const auto value = static_cast<double>(n * bytes);
    auto record = [&](const std::string& name, bool ours, bool reference,
                      const std::vector<double>& ms) -> Measurement& {
      results.push_back(
          pager_measurement(parameter, value, name, ours, reference, "ms/step", true, ms));
      results.back().extra["intensity"] = regime.intensity;
      return results.back();
    };
    auto compute_layer = [&](const void* weights) {
      run_compute(weights, bytes, regime.intensity, out, blocks, compute.get());
    };

    progress.step("pager " + regime.name + ": all resident");
    double resident_ms = 0;
    if (all) {
      const auto ms = time_steps(shape, compute.get(), [&] {
        for (std::size_t i = 0; i < n; ++i) compute_layer(all->get() + i * bytes);
      });
      resident_ms = record("all resident (no paging)", false, true, ms).value.median;
    }

    // (b) the copy bound, from the rate measured in this run.
    {
      Measurement& bound =
          record("copy bound (streamed bytes / pinned H2D)", false, true, {copy_bound_ms});
      bound.extra["pinned_h2d_gbps"] = pinned_gbps;
      bound.extra["streamed_gib_per_step"] = streamed_bytes / double(1_GiB);
    }

    // The pager, pinned host weights (it registers the streamed layers itself).
    progress.step("pager " + regime.name + ": vram WeightPager");
    {
      WeightPager pager(host.layers(), {.plan = {.budget_bytes = shape.budget, .prefetch_depth = 1},
                                        .host = HostWeights::pinned,
                                        .print_plan_warnings = false});
      const auto ms = time_steps(shape, compute.get(), [&] {
        for (std::size_t i = 0; i < n; ++i) {
          compute_layer(pager.acquire(i, compute.get()));
          pager.release(i, compute.get());
        }
      });
      pager.synchronize();
      const auto stats = pager.stats();
      const auto steps = static_cast<double>(shape.warmup_steps + shape.steps);
      Measurement& m = record("vram WeightPager (depth 1, pinned)", true, false, ms);
      m.extra["vs_copy_bound"] = m.value.median / copy_bound_ms;
      if (resident_ms > 0) m.extra["vs_all_resident"] = m.value.median / resident_ms;
      m.extra["page_ins_per_step"] = static_cast<double>(stats.page_ins) / steps;
      m.extra["hits_pct"] = 100.0 * static_cast<double>(stats.hits) /
                            static_cast<double>(std::max<std::uint64_t>(1, stats.acquires));
      m.extra["sampled_copy_gbps"] = stats.effective_gbps;
      m.extra["sampled_stall_ms"] = stats.stall_ms_sampled;
      m.extra["stalled_of_samples"] = static_cast<double>(stats.stalled);
      m.extra["pin_at_load_s"] = pager.load().pin_seconds;
      m.extra["pinned_at_load_gib"] =
          static_cast<double>(pager.load().pinned_bytes) / double(1_GiB);
      m.extra["resident_layers"] = static_cast<double>(n - plan.streamed_layers());
    }

    // The baselines read page-locked host weights too.
    host.pin();
    try {
      // (e) two slots, side-stream prefetch, every layer streamed.
      progress.step("pager " + regime.name + ": two-slot prefetch");
      {
        DeviceBuffer slots(2 * bytes);
        std::vector<cuda::Event> copied(2);
        std::vector<cuda::Event> used(2);
        used[0].record(compute.get());
        used[1].record(compute.get());
        auto copy_in = [&](std::size_t layer) {
          const std::size_t slot = layer % 2;
          used[slot].make_wait(side.get());
          cuda::check(cudaMemcpyAsync(slots.get() + slot * bytes, host.layer(layer), bytes,
                                      cudaMemcpyHostToDevice, side.get()),
                      "cudaMemcpyAsync(two-slot)");
          copied[slot].record(side.get());
        };
        const auto ms = time_steps(shape, compute.get(), [&] {
          copy_in(0);
          for (std::size_t i = 0; i < n; ++i) {
            if (i + 1 < n) copy_in(i + 1);
            copied[i % 2].make_wait(compute.get());
            compute_layer(slots.get() + (i % 2) * bytes);
            used[i % 2].record(compute.get());
          }
        });
        Measurement& m = record("two-slot prefetch, stream everything", false, false, ms);
        m.extra["gbps"] = static_cast<double>(n * bytes) / m.value.median / 1e6;
      }

      // (c) synchronous: copy, then compute, on one stream.
      progress.step("pager " + regime.name + ": synchronous");
      {
        DeviceBuffer slot(bytes);
        const auto ms = time_steps(shape, compute.get(), [&] {
          for (std::size_t i = 0; i < n; ++i) {
            cuda::check(cudaMemcpyAsync(slot.get(), host.layer(i), bytes, cudaMemcpyHostToDevice,
                                        compute.get()),
                        "cudaMemcpyAsync(synchronous)");
            compute_layer(slot.get());
          }
        });
        record("synchronous copy then compute", false, false, ms);
      }
    } catch (...) {
      host.unpin();
      throw;
    }
    host.unpin();

    // (d) pinning per page-in, copy-bound only (its cost does not depend on the kernel):
    // fewer steps, it is slow by design.
    if (regime.intensity == 0) {
      progress.step("pager copy-bound: pin per page-in");
      StackShape short_run = shape;
      short_run.warmup_steps = 0;
      short_run.steps = c.quick ? 2 : 1;
      DeviceBuffer slot(bytes);
      const auto ms = time_steps(short_run, compute.get(), [&] {
        for (std::size_t i = 0; i < n; ++i) {
          void* staging = nullptr;
          cuda::check(cudaHostAlloc(&staging, bytes, cudaHostAllocPortable), "cudaHostAlloc");
          std::memcpy(staging, host.layer(i), bytes);
          cuda::check(
              cudaMemcpyAsync(slot.get(), staging, bytes, cudaMemcpyHostToDevice, compute.get()),
              "cudaMemcpyAsync(pin per page-in)");
          compute.synchronize();
          cuda::check(cudaFreeHost(staging), "cudaFreeHost");
          compute_layer(slot.get());
        }
      });
      record("pin per page-in (cudaHostAlloc + copy + free)", false, false, ms);
    }
  }

  all.reset();

  // Pageable host weights: the pager stages them; against a pageable cudaMemcpyAsync.
  {
    const std::string parameter = stack + ", pageable host weights";
    const auto value = static_cast<double>(n * bytes);
    // The default configuration, then the fill's two knobs in the same run (the host's
    // memory bandwidth decides which wins; it varies between machines and runs).
    struct Fill {
      unsigned threads;  // 0: the default
      bool streaming;
      const char* name;
    };
    const std::vector<Fill> fills = {
        {0, false, "vram WeightPager (pageable, staged)"},
        {0, true, "vram WeightPager (pageable, staged), non-temporal fill"},
        {8, false, "vram WeightPager (pageable, staged), 8 fill threads"}};
    for (const Fill& fill : fills) {
      if (c.quick && fill.threads != 0) continue;
      progress.step(std::string("pager pageable: ") + fill.name);
      WeightPager pager(host.layers(), {.plan = {.budget_bytes = shape.budget, .prefetch_depth = 1},
                                        .host = HostWeights::pageable,
                                        .fill_threads = fill.threads,
                                        .streaming_fill = fill.streaming,
                                        .print_plan_warnings = false});
      const auto ms = time_steps(shape, compute.get(), [&] {
        for (std::size_t i = 0; i < n; ++i) {
          run_compute(pager.acquire(i, compute.get()), bytes, 0, out, blocks, compute.get());
          pager.release(i, compute.get());
        }
      });
      std::vector<double> gbps;
      for (double step_ms : ms) gbps.push_back(streamed_bytes / step_ms / 1e6);
      const bool ours = fill.threads == 0 && !fill.streaming;
      results.push_back(
          pager_measurement(parameter, value, fill.name, ours, false, "GB/s", false, gbps));
      const auto stats = pager.stats();
      results.back().extra["sampled_copy_gbps"] = stats.effective_gbps;
      results.back().extra["staging_pins_after_load"] =
          static_cast<double>(stats.staging_pin_calls);
      results.back().extra["host_wait_ms"] = stats.host_wait_ms;
      results.back().extra["fill_threads"] =
          fill.threads != 0 ? fill.threads : detail::default_fill_threads();
    }
    progress.step("pager pageable: cudaMemcpyAsync from pageable");
    {
      DeviceBuffer slot(bytes);
      const std::size_t copies = c.quick ? 4 : 8;
      std::vector<double> gbps;
      cuda::Event start(cuda::Event::Timing::enabled);
      cuda::Event end(cuda::Event::Timing::enabled);
      for (std::size_t i = 0; i <= copies; ++i) {
        start.record(compute.get());
        cuda::check(cudaMemcpyAsync(slot.get(), host.layer(i % n), bytes, cudaMemcpyHostToDevice,
                                    compute.get()),
                    "cudaMemcpyAsync(pageable)");
        end.record(compute.get());
        end.wait();
        if (i > 0) {
          gbps.push_back(static_cast<double>(bytes) / cuda::Event::elapsed_ms(start, end) / 1e6);
        }
      }
      results.push_back(pager_measurement(parameter, value, "cudaMemcpyAsync from pageable", false,
                                          false, "GB/s", false, gbps));
    }
    results.push_back(pager_measurement(parameter, value, "pinned H2D (ceiling)", false, true,
                                        "GB/s", false, {pinned_gbps}));
  }

  // Pageable, mixed sizes: an MoE layer as vram_torch.offload pages it (four attention
  // pieces of 4 MiB, one joined expert piece of 168 MiB), with the staging it uses there
  // (16 buffers of 16 MiB): small page-ins between large ones must keep the copy busy.
  {
    progress.step("pager pageable: mixed 4 x 4 MiB + 168 MiB layers");
    const std::size_t small = c.quick ? 1_MiB : 4_MiB;
    const std::size_t large = c.quick ? 42_MiB : 168_MiB;
    StackShape mixed_shape = shape;
    mixed_shape.layer_bytes = 4 * small + large;
    HostStack mixed(mixed_shape);
    std::vector<WeightLayer> pieces;
    for (std::size_t i = 0; i < mixed_shape.layers; ++i) {
      for (std::size_t p = 0; p < 5; ++p) {
        pieces.push_back({"layer." + std::to_string(i) + "." + std::to_string(p),
                          mixed.layer(i) + p * small, p < 4 ? small : large});
      }
    }
    const std::string parameter = std::to_string(mixed_shape.layers) + " x (4 x " +
                                  format_bytes(small) + " + " + format_bytes(large) + "), budget " +
                                  format_bytes(shape.budget) + ", pageable host weights";
    WeightPager pager(pieces, {.plan = {.budget_bytes = shape.budget, .prefetch_depth = 1},
                               .host = HostWeights::pageable,
                               .staging_chunk_bytes = 16_MiB,
                               .staging_buffers = 16,
                               .print_plan_warnings = false});
    const double mixed_streamed = static_cast<double>(pager.plan().streamed_bytes_per_step);
    const auto ms = time_steps(mixed_shape, compute.get(), [&] {
      for (std::size_t i = 0; i < pieces.size(); ++i) {
        run_compute(pager.acquire(i, compute.get()), pieces[i].bytes, 0, out, blocks,
                    compute.get());
        pager.release(i, compute.get());
      }
    });
    std::vector<double> gbps;
    for (double step_ms : ms) gbps.push_back(mixed_streamed / step_ms / 1e6);
    results.push_back(pager_measurement(
        parameter,
        static_cast<double>(mixed_shape.layers) * static_cast<double>(mixed_shape.layer_bytes),
        "vram WeightPager (pageable, staged), mixed sizes", true, false, "GB/s", false, gbps));
    const auto stats = pager.stats();
    results.back().extra["sampled_copy_gbps"] = stats.effective_gbps;
    results.back().extra["staging_pins_after_load"] = static_cast<double>(stats.staging_pin_calls);
    results.back().extra["host_wait_ms"] = stats.host_wait_ms;
    results.back().extra["streamed_gib_per_step"] = mixed_streamed / double(1_GiB);
    results.back().extra["pinned_h2d_gbps"] = pinned_gbps;
  }
}

#endif  // VRAM_HAVE_BENCH_KERNELS

}  // namespace vram::bench
