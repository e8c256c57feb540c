// vram/detail/parallel_copy.hpp: a host memcpy split over a few long-lived threads.
//
// The weight pager fills pinned staging buffers from pageable weights with it: one thread
// copies about 10-20 GB/s, a staged page-in wants the link's 50+. run() splits a copy into
// one contiguous part per thread (parts of at least 1 MiB), the caller copies a part too,
// and returns once every part is done and no worker is still inside the job (so the next
// run() may reuse the fields). One run() at a time (the pager's single stager thread).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

namespace vram::detail {

class ParallelCopy {
 public:
  explicit ParallelCopy(unsigned threads) {
    for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~ParallelCopy() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
  }
  ParallelCopy(const ParallelCopy&) = delete;
  ParallelCopy& operator=(const ParallelCopy&) = delete;

  void run(std::byte* destination, const std::byte* source, std::size_t bytes) {
    constexpr std::size_t kMinPart = std::size_t{1} << 20;
    const std::size_t parts =
        std::min<std::size_t>(workers_.size() + 1, std::max<std::size_t>(1, bytes / kMinPart));
    if (parts <= 1) {
      std::memcpy(destination, source, bytes);
      return;
    }
    Job job{destination, source, bytes, (bytes + parts - 1) / parts, parts};
    {
      std::unique_lock lock(mutex_);
      idle_.wait(lock, [&] { return busy_ == 0; });
      job_ = job;
      next_part_.store(0);
      done_parts_.store(0);
      ++generation_;
    }
    wake_.notify_all();
    work(job);
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [&] { return done_parts_.load() == parts && busy_ == 0; });
  }

 private:
  struct Job {
    std::byte* destination = nullptr;
    const std::byte* source = nullptr;
    std::size_t bytes = 0;
    std::size_t part = 0;
    std::size_t parts = 0;
  };

  void work(const Job& job) {
    for (;;) {
      const std::size_t index = next_part_.fetch_add(1);
      if (index >= job.parts) return;
      const std::size_t begin = index * job.part;
      const std::size_t length = std::min(job.part, job.bytes - std::min(job.bytes, begin));
      if (length > 0) std::memcpy(job.destination + begin, job.source + begin, length);
      if (done_parts_.fetch_add(1) + 1 == job.parts) {
        std::lock_guard lock(mutex_);
        idle_.notify_all();
      }
    }
  }

  void loop() {
    std::uint64_t seen = 0;
    for (;;) {
      Job job;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
        ++busy_;
      }
      work(job);
      std::lock_guard lock(mutex_);
      --busy_;
      idle_.notify_all();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  Job job_;
  std::uint64_t generation_ = 0;
  std::size_t busy_ = 0;  // workers inside the current job
  bool stop_ = false;
  std::atomic<std::size_t> next_part_{0};
  std::atomic<std::size_t> done_parts_{0};
};

}  // namespace vram::detail
