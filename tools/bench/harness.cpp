#include "bench/harness.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <thread>

namespace vram::bench {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Summary summarize(std::vector<double> values) {
  Summary s;
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  auto at = [&](double q) {
    const double position = q * static_cast<double>(values.size() - 1);
    const auto low = static_cast<std::size_t>(std::floor(position));
    const auto high = static_cast<std::size_t>(std::ceil(position));
    return values[low] + (values[high] - values[low]) * (position - static_cast<double>(low));
  };
  s.median = at(0.5);
  s.p10 = at(0.1);
  s.p90 = at(0.9);
  s.samples = values.size();
  return s;
}

std::vector<double> time_per_operation(const std::function<void(std::size_t)>& batch,
                                       std::size_t repetitions, double target_batch_ms) {
  // Warm-up, also used to size the batch.
  std::size_t n = 1;
  double elapsed = 0;
  for (;;) {
    const double start = now_seconds();
    batch(n);
    elapsed = now_seconds() - start;
    if (elapsed * 1e3 >= target_batch_ms / 4 || n >= (std::size_t{1} << 24)) break;
    n *= 4;
  }
  const double per_op = elapsed / static_cast<double>(n);
  n = std::max<std::size_t>(1, static_cast<std::size_t>(target_batch_ms * 1e-3 / per_op));
  std::vector<double> result;
  result.reserve(repetitions);
  for (std::size_t r = 0; r < repetitions; ++r) {
    const double start = now_seconds();
    batch(n);
    result.push_back((now_seconds() - start) * 1e9 / static_cast<double>(n));
  }
  return result;
}

Progress::Progress(std::size_t total)
    : total_(total), terminal_(isatty(STDERR_FILENO) != 0), started_(now_seconds()) {}

void Progress::step(const std::string& label) {
  ++done_;
  if (!terminal_) return;
  std::fprintf(stderr, "\r\033[K[%zu/%zu %4.0fs] %s", done_, total_, now_seconds() - started_,
               label.c_str());
  std::fflush(stderr);
}

void Progress::finish() {
  if (terminal_) std::fprintf(stderr, "\r\033[K");
}

namespace {
// One batch: `live` sizes log-uniform from 256 B to 2^max_exponent, then a shuffled free order,
// both drawn from `random`.
BatchedPlan draw_plan(std::mt19937_64& random, int max_exponent, std::size_t live) {
  BatchedPlan plan;
  std::uniform_real_distribution<double> exponent(8.0, max_exponent);
  for (std::size_t i = 0; i < live; ++i) {
    plan.sizes.push_back(static_cast<std::size_t>(std::exp2(exponent(random))));
  }
  plan.free_order.resize(live);
  std::iota(plan.free_order.begin(), plan.free_order.end(), std::size_t{0});
  std::shuffle(plan.free_order.begin(), plan.free_order.end(), random);
  return plan;
}
}  // namespace

BatchedPlan batched_plan(unsigned t, int max_exponent, std::size_t live) {
  std::mt19937_64 random(1234 + t);
  return draw_plan(random, max_exponent, live);
}

std::vector<BatchedPlan> batched_fresh_plans(unsigned t, int max_exponent, std::size_t live,
                                             std::size_t batches) {
  std::vector<BatchedPlan> plans;
  plans.reserve(batches);
  std::mt19937_64 random(4321 + t);
  for (std::size_t b = 0; b < batches; ++b) plans.push_back(draw_plan(random, max_exponent, live));
  return plans;
}

std::vector<double> threaded_pair_rates(
    unsigned threads, std::size_t repetitions, double seconds,
    const std::function<std::uint64_t(unsigned t, const std::atomic<bool>& stop)>& worker) {
  std::vector<double> samples;
  for (std::size_t r = 0; r <= repetitions; ++r) {  // r == 0 is the warm-up
    std::atomic<bool> stop{false};
    std::atomic<unsigned> ready{0};
    std::atomic<std::uint64_t> total{0};
    std::vector<std::thread> workers;
    for (unsigned t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < threads) {
        }
        total.fetch_add(worker(t, stop));
      });
    }
    while (ready.load() < threads) {
    }
    const double start = now_seconds();
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    stop.store(true);
    for (auto& w : workers) w.join();
    const double elapsed = now_seconds() - start;
    if (r > 0) samples.push_back(static_cast<double>(total.load()) / elapsed / 1e6);
  }
  return samples;
}

}  // namespace vram::bench
