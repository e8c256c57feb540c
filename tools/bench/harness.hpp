// Timing helpers for `vram bench`: batches timed with a steady clock (device work is
// synchronized inside the batch), warm-up excluded, median and spread over repetitions.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace vram::bench {

struct Summary {
  double median = 0;
  double p10 = 0;
  double p90 = 0;
  std::size_t samples = 0;
};

Summary summarize(std::vector<double> values);

// Times `batch(n)` (which runs n operations) and returns nanoseconds per operation for
// each of `repetitions` batches, after one warm-up batch. The batch size is chosen so a
// batch takes about `target_batch_ms`.
std::vector<double> time_per_operation(const std::function<void(std::size_t)>& batch,
                                       std::size_t repetitions, double target_batch_ms);

double now_seconds();

// Many-thread throughput: `threads` workers start together (a spin barrier), run
// `worker(t, stop)` (which loops until `stop` and returns the pairs it made) for about
// `seconds`; repeated repetitions + 1 times, the first a warm-up. Returns M pairs/s per
// timed repetition.
std::vector<double> threaded_pair_rates(
    unsigned threads, std::size_t repetitions, double seconds,
    const std::function<std::uint64_t(unsigned t, const std::atomic<bool>& stop)>& worker);

// The batched scenario's plan for thread `t`: `live` block sizes log-uniform in
// [256 B, 2^max_exponent B] (seed 1234 + t), and the order they are freed in (shuffled).
struct BatchedPlan {
  std::vector<std::size_t> sizes;
  std::vector<std::size_t> free_order;
};
BatchedPlan batched_plan(unsigned t, int max_exponent, std::size_t live);
// The fresh form: `batches` plans for thread `t`, each batch's sizes and order drawn afresh
// (seed 4321 + t); the thread goes through them in turn, so sizes seldom repeat within a
// thread's caches' reach.
inline constexpr std::size_t kFreshBatches = 256;
std::vector<BatchedPlan> batched_fresh_plans(unsigned t, int max_exponent, std::size_t live,
                                             std::size_t batches = kFreshBatches);

// One progress line on a terminal (stderr), rewritten in place; silent otherwise.
class Progress {
 public:
  explicit Progress(std::size_t total);
  void step(const std::string& label);
  void finish();

 private:
  std::size_t total_;
  std::size_t done_ = 0;
  bool terminal_;
  double started_;
};

}  // namespace vram::bench
