// `vram bench --scenario sleep`: DevicePool's sleep and wake against the pinned link of the
// same run.
//
// The link: one buffer copied device to host and host to device (cudaMemcpyAsync between a
// cudaMalloc buffer and a cudaHostAlloc one, 1 GiB, timed with events), the ceiling of any
// sleep. Then a pool over CUDA virtual memory with two tags: "weights" (8 GiB in 32 blocks,
// backed up) and "kv" (8 GiB, discardable); one untimed cycle (it pins the backup), then
// three timed ones: sleep and wake of each tag, host wall clock around the call (the copies,
// the proof of their end, the unmaps and maps); the weights' three again with 1 s between
// sleep and wake (outside both timings). Then "many": 10,000 blocks of 64 KiB to
// 4 MiB (log-uniform, fixed seed) in one tag, the same cycles; then the same blocks apart (a
// freed 512 KiB block after each in the tag's range: a copy per block, vram's worst case for
// those bytes). Sizes shrink to fit the device's free memory (and --quick divides them by 8).
//
// The peer: torch_memory_saver, whose only interface is its Python package. After vram's
// pools are gone, bench/torch_sleep.py (carried in the binary) runs its tms child in a
// separate process with $VRAM_BENCH_PYTHON (else python3): the same parts, the same sizes
// (the many blocks' list is handed over), one untimed and three timed cycles, host wall
// clock around pause and from resume to a synchronize after it. Each step is its own
// parameter, so each gets its own verdict.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/python_peer.hpp"
#include "bench/scenarios.hpp"
#include "bench/sleep_peer_lines.hpp"
#include "vram/cuda/error.hpp"
#include "vram/cuda/event.hpp"
#include "vram/cuda/stream.hpp"
#include "vram/device_pool.hpp"
#include "vram/units.hpp"

namespace vram::bench {
namespace {

using namespace vram::literals;

double gb_per_s(std::size_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0;
}

// GB/s of `repetitions` copies of `bytes` each way (device to host, host to device).
std::pair<std::vector<double>, std::vector<double>> pinned_link(std::size_t bytes,
                                                                std::size_t repetitions) {
  void* device = nullptr;
  void* host = nullptr;
  cuda::check(cudaMalloc(&device, bytes), "cudaMalloc");
  const cudaError_t pinned = cudaHostAlloc(&host, bytes, cudaHostAllocPortable);
  if (pinned != cudaSuccess) {
    (void)cudaFree(device);
    cuda::check(pinned, "cudaHostAlloc");
  }
  cuda::Stream stream;
  cuda::Event start(cuda::Event::Timing::enabled);
  cuda::Event stop(cuda::Event::Timing::enabled);
  std::vector<double> to_host;
  std::vector<double> to_device;
  for (std::size_t r = 0; r <= repetitions; ++r) {
    for (int direction = 0; direction < 2; ++direction) {
      start.record(stream.get());
      cuda::check(direction == 0
                      ? cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream.get())
                      : cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream.get()),
                  "cudaMemcpyAsync");
      stop.record(stream.get());
      stop.wait();
      if (r == 0) continue;  // warm-up
      const double rate = gb_per_s(bytes, cuda::Event::elapsed_ms(start, stop) / 1e3);
      (direction == 0 ? to_host : to_device).push_back(rate);
    }
  }
  (void)cudaFreeHost(host);
  (void)cudaFree(device);
  return {to_host, to_device};
}

constexpr const char* kOurs = "vram DevicePool";
constexpr const char* kPeer = "torch_memory_saver (Python)";
// The weights' cycles again with a second between sleep and wake (the trainer's step of an
// RL loop; passed to bench/torch_sleep.py's child): a copy into device memory made within
// about 100 ms of the release of other memory ran about 10% below the link on an H100, so a
// wake right after its sleep pays that (bench/RESULTS.md, "Sleep and wake").
constexpr double kAsleepSeconds = 1.0;
std::string asleep_suffix() {
  char text[64];
  std::snprintf(text, sizeof text, ", %g s asleep", kAsleepSeconds);
  return text;
}

std::string many_parameter(std::size_t count, std::size_t bytes) {
  return std::to_string(count) + " blocks, " + format_bytes(bytes);
}
// The many blocks again, each followed in the tag's range by a freed 512 KiB block: every
// live block its own copy (blocks closer than 256 KiB are copied as one range).
constexpr std::size_t kApartGap = 512_KiB;
std::string apart_parameter(std::size_t count, std::size_t bytes) {
  return many_parameter(count, bytes) + " apart (512 KiB freed after each)";
}
// torch_memory_saver copies each allocation whatever lies between them, and a freed tensor
// stays in PyTorch's cache inside its pool (copied too): its rows for the blocks apart are
// those of the same blocks together, its best case.
constexpr const char* kPeerTogether = "torch_memory_saver (Python), the blocks together";
// The parts the peer's child prints (bench/torch_sleep.py, _print_lines).
const std::vector<std::string> kPeerParts = {"weights", "weights_asleep", "kv", "many"};

// `asleep_s`: seconds between the sleep and the wake, outside both timings.
CycleTimes cycles(DevicePool& pool, SleepTag tag, cudaStream_t stream, std::size_t timed,
                  double asleep_s = 0) {
  CycleTimes times;
  for (std::size_t cycle = 0; cycle <= timed; ++cycle) {
    cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    const double start = now_seconds();
    pool.sleep(tag, stream);
    const double slept = now_seconds();
    if (asleep_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(asleep_s));
    const double waking = now_seconds();
    pool.wake(tag, stream);
    const double woke = now_seconds();
    if (cycle == 0) continue;  // pins the backup
    times.sleep_s.push_back(slept - start);
    times.wake_s.push_back(woke - waking);
  }
  return times;
}

// Rows of one allocator's cycles of one part: GB/s (`rates`) or ms and ms per GiB, sleep
// and wake as separate parameters (each its own verdict).
void add_rows(std::vector<Measurement>& results, const std::string& parameter, std::size_t bytes,
              const std::string& allocator, bool ours, const CycleTimes& times, bool rates,
              double link_to_host, double link_to_device) {
  const double gib = static_cast<double>(bytes) / static_cast<double>(1_GiB);
  for (int direction = 0; direction < 2; ++direction) {
    std::vector<double> samples;
    for (double s : direction == 0 ? times.sleep_s : times.wake_s) {
      samples.push_back(rates ? gb_per_s(bytes, s) : s * 1e3);
    }
    if (samples.empty()) continue;
    Measurement m = make_measurement("sleep", parameter + (direction == 0 ? ", sleep" : ", wake"),
                                     static_cast<double>(bytes), allocator, ours,
                                     rates ? "GB/s" : "ms", !rates, samples);
    if (rates) {
      const double link = direction == 0 ? link_to_host : link_to_device;
      m.extra["fraction_of_link"] = link > 0 ? m.value.median / link : 0;
    } else {
      m.extra["ms_per_gib"] = gib > 0 ? m.value.median / gib : 0;
    }
    results.push_back(m);
  }
}

// torch_memory_saver through its Python package (bench/torch_sleep.py's tms child, in its own
// process, after vram's pools are gone): the same parts, sizes and cycles. Absent when
// Python or the package is missing (said on stderr).
std::optional<SleepPeerLines> torch_memory_saver(std::size_t each, std::size_t timed,
                                                 const std::vector<std::size_t>& many_sizes) {
  std::string sizes_text;
  for (std::size_t bytes : many_sizes) sizes_text += std::to_string(bytes) + "\n";
  TemporaryFile sizes(sizes_text, ".txt");
  const std::string python = bench_python();
  auto absent = [&](const std::string& why) -> std::optional<SleepPeerLines> {
    std::fprintf(stderr, "vram bench: sleep: torch_memory_saver not measured: %s\n", why.c_str());
    return std::nullopt;
  };
  if (sizes.path().empty()) return absent(sizes.error());
  char gib[64];
  std::snprintf(gib, sizeof gib, "%.17g", static_cast<double>(each) / static_cast<double>(1_GiB));
  char asleep[64];
  std::snprintf(asleep, sizeof asleep, "%.17g", kAsleepSeconds);
  const ChildRun run =
      run_python(python, torch_sleep_script(),
                 {"--child", "tms", "--lines", "--gib", gib, "--cycles", std::to_string(timed),
                  "--many-sizes", sizes.path(), "--asleep-s", asleep},
                 1800);
  if (!run.ran) return absent(run.error);
  SleepPeerLines peer = read_sleep_peer_lines(run.lines);
  if (!peer.absent.empty()) return absent(peer.absent);
  if (!peer.complete(kPeerParts)) {
    return absent(python + " exited " + std::to_string(run.exit_code) + " without results" +
                  (peer.last.empty() ? "" : " (last line: " + peer.last + ")"));
  }
  if (run.exit_code != 0) {  // its results were complete and checked: a failure at its exit
    std::fprintf(stderr,
                 "vram bench: sleep: torch_memory_saver's process exited %d after its results "
                 "(last line: %s)\n",
                 run.exit_code, peer.last.c_str());
  }
  return peer;
}

std::size_t free_device_bytes() {
  std::size_t free_bytes = 0;
  std::size_t total = 0;
  cuda::check(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo");
  return free_bytes;
}

// One tag of `sizes` in a pool of its own (each block followed by a freed block of `gap`
// bytes when not 0), its cycles, the copies of its last sleep; the blocks freed after.
struct TagPart {
  CycleTimes times;
  std::size_t bytes = 0;
  std::uint64_t copies = 0;
};
TagPart tag_part(int device, cudaStream_t stream, const std::vector<std::size_t>& sizes,
                 std::size_t gap, std::size_t timed) {
  DevicePool::Options options;
  options.large_tier.memory = LargeTierMemory::virtual_memory;
  DevicePool pool(device, options);
  const SleepTag tag = pool.create_tag("blocks");
  std::vector<void*> blocks;
  std::vector<void*> gaps;
  TagPart part;
  {
    auto scope = pool.tag_scope(tag);
    for (std::size_t bytes : sizes) {
      blocks.push_back(pool.allocate_async(bytes, stream));
      if (gap != 0) gaps.push_back(pool.allocate_async(gap, stream));
      part.bytes += bytes;
    }
  }
  for (void* g : gaps) pool.deallocate_async(g, gap, stream);
  part.times = cycles(pool, tag, stream, timed);
  part.copies = pool.tag_stats(tag).copies;
  for (std::size_t i = 0; i < blocks.size(); ++i)
    pool.deallocate_async(blocks[i], sizes[i], stream);
  return part;
}

}  // namespace

std::size_t sleep_scenario_steps(const BenchConfig&) { return 6; }

void run_sleep_scenario(const BenchConfig& config, Progress& progress,
                        std::vector<Measurement>& results) {
  cuda::check(cudaSetDevice(config.device), "cudaSetDevice");
  const std::size_t timed = 3;
  progress.step("sleep: pinned link");
  const auto [link_to_host, link_to_device] = pinned_link(1_GiB, config.quick ? 3 : 5);
  for (int direction = 0; direction < 2; ++direction) {
    Measurement m = make_measurement(
        "sleep", "1 GiB", static_cast<double>(1_GiB),
        direction == 0 ? "pinned link device to host" : "pinned link host to device", false, "GB/s",
        false, direction == 0 ? link_to_host : link_to_device);
    m.reference = true;
    results.push_back(m);
  }
  const double to_host =
      make_measurement("", "", 0, "", false, "", false, link_to_host).value.median;
  const double to_device =
      make_measurement("", "", 0, "", false, "", false, link_to_device).value.median;

  // Weights and KV cache: 8 GiB each, less when the device has less free (a quarter each of
  // what is free, leaving room for the maps).
  std::size_t each = config.quick ? 1_GiB : 8_GiB;
  each = std::min(each, free_device_bytes() / 4 / 32_MiB * 32_MiB);
  const std::string weights_parameter = "weights " + format_bytes(each) + " in 32 blocks";
  const std::string kv_parameter = "KV " + format_bytes(each) + " discardable";
  cuda::Stream stream;
  {
    DevicePool::Options options;
    options.large_tier.memory = LargeTierMemory::virtual_memory;
    DevicePool pool(config.device, options);
    const SleepTag weights = pool.create_tag("weights");
    const SleepTag kv = pool.create_tag("kv", {.discardable = true});
    std::vector<void*> blocks;
    const std::size_t block = each / 32;
    for (int i = 0; i < 32; ++i) {
      blocks.push_back(pool.allocate_tagged(block, weights));
      cuda::check(cudaMemsetAsync(blocks.back(), i, block, stream.get()), "cudaMemsetAsync");
    }
    void* cache = pool.allocate_tagged(each, kv);
    progress.step("sleep: weights");
    const CycleTimes w = cycles(pool, weights, stream.get(), timed);
    add_rows(results, weights_parameter, each, kOurs, true, w, true, to_host, to_device);
    progress.step("sleep: weights, 1 s asleep");
    const CycleTimes wa = cycles(pool, weights, stream.get(), timed, kAsleepSeconds);
    add_rows(results, weights_parameter + asleep_suffix(), each, kOurs, true, wa, true, to_host,
             to_device);
    progress.step("sleep: kv (discardable)");
    const CycleTimes k = cycles(pool, kv, stream.get(), timed);
    add_rows(results, kv_parameter, each, kOurs, true, k, false, to_host, to_device);
    for (void* b : blocks) pool.deallocate(b, block);
    pool.deallocate(cache, each);
  }

  // Many blocks: 10,000 of 64 KiB to 4 MiB, log-uniform.
  progress.step("sleep: 10,000 blocks");
  std::vector<std::size_t> sizes;
  {
    const std::size_t count = config.quick ? 1000 : 10000;
    std::mt19937_64 random(42);
    std::uniform_real_distribution<double> exponent(std::log(64.0 * 1024), std::log(4.0 * 1048576));
    std::size_t total = 0;
    const std::size_t cap = free_device_bytes() / 3;
    for (std::size_t i = 0; i < count; ++i) {
      const auto bytes = static_cast<std::size_t>(std::exp(exponent(random))) / 256 * 256;
      if (total + bytes > cap) break;
      sizes.push_back(bytes);
      total += bytes;
    }
    const TagPart many = tag_part(config.device, stream.get(), sizes, 0, timed);
    add_rows(results, many_parameter(sizes.size(), total), total, kOurs, true, many.times, true,
             to_host, to_device);
    results.back().extra["copies"] = static_cast<double>(many.copies);
  }
  // The same blocks apart: vram's worst case for the same live bytes (a copy per block).
  progress.step("sleep: 10,000 blocks apart");
  {
    const TagPart apart = tag_part(config.device, stream.get(), sizes, kApartGap, timed);
    add_rows(results, apart_parameter(sizes.size(), apart.bytes), apart.bytes, kOurs, true,
             apart.times, true, to_host, to_device);
    results.back().extra["copies"] = static_cast<double>(apart.copies);
  }
  cuda::check(cudaStreamSynchronize(stream.get()), "cudaStreamSynchronize");

  progress.step("sleep: torch_memory_saver");
  if (const std::optional<SleepPeerLines> peer = torch_memory_saver(each, timed, sizes)) {
    add_rows(results, weights_parameter, peer->bytes.at("weights"), kPeer, false,
             peer->parts.at("weights"), true, to_host, to_device);
    add_rows(results, weights_parameter + asleep_suffix(), peer->bytes.at("weights_asleep"), kPeer,
             false, peer->parts.at("weights_asleep"), true, to_host, to_device);
    add_rows(results, kv_parameter, peer->bytes.at("kv"), kPeer, false, peer->parts.at("kv"), false,
             to_host, to_device);
    add_rows(results, many_parameter(sizes.size(), peer->bytes.at("many")), peer->bytes.at("many"),
             kPeer, false, peer->parts.at("many"), true, to_host, to_device);
    add_rows(results, apart_parameter(sizes.size(), peer->bytes.at("many")), peer->bytes.at("many"),
             kPeerTogether, false, peer->parts.at("many"), true, to_host, to_device);
  }
}

}  // namespace vram::bench
