// src/staging/parallel_copy.hpp: a host memcpy split over a few long-lived threads.
//
// The weight pager fills pinned staging buffers from pageable weights with it: a staged
// page-in wants more host bandwidth than one thread copies. Each part is a memcpy, or a
// streaming_copy (non-temporal stores) when asked; which is faster depends on the machine
// (bench/ measures both). run() splits a
// copy into one contiguous part per thread (parts of at least 1 MiB), the caller copies a part too,
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

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define VRAM_STREAMING_COPY 1
#endif

namespace vram::detail {

// memcpy for a destination the CPU will not read again (a staging buffer the DMA engine
// reads): non-temporal 16-byte stores (SSE2, part of x86-64) skip the read-for-ownership
// of every destination line and keep the source and destination out of the caches, so
// several threads copy at more of the DRAM bandwidth than memcpy's cached stores (glibc
// switches to non-temporal stores only for copies larger than a share of the L3). The
// stores are fenced before it returns. Elsewhere: memcpy.
inline void streaming_copy(std::byte* destination, const std::byte* source, std::size_t bytes) {
#ifdef VRAM_STREAMING_COPY
  constexpr std::size_t kBlock = 64;
  const std::size_t misalignment = reinterpret_cast<std::uintptr_t>(destination) & 15;
  std::size_t head = misalignment == 0 ? 0 : 16 - misalignment;
  if (bytes < head + kBlock) {
    std::memcpy(destination, source, bytes);
    return;
  }
  std::memcpy(destination, source, head);
  auto* to = reinterpret_cast<__m128i*>(destination + head);
  const std::byte* from = source + head;
  const std::size_t blocks = (bytes - head) / kBlock;
  for (std::size_t i = 0; i < blocks; ++i, to += 4, from += kBlock) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + 48));
    _mm_stream_si128(to, a);
    _mm_stream_si128(to + 1, b);
    _mm_stream_si128(to + 2, c);
    _mm_stream_si128(to + 3, d);
  }
  const std::size_t done = head + blocks * kBlock;
  std::memcpy(destination + done, source + done, bytes - done);
  _mm_sfence();  // the non-temporal stores are visible before the caller signals anyone
#else
  std::memcpy(destination, source, bytes);
#endif
}

class ParallelCopy {
 public:
  // streaming: each part with streaming_copy (non-temporal stores), else memcpy. Up to
  // threads - 1 workers: when the system cannot start one (out of memory or threads), the
  // copy runs on those that started (at least the caller's own thread) instead of failing.
  explicit ParallelCopy(unsigned threads, bool streaming = false) : streaming_(streaming) {
    try {
      workers_.reserve(threads > 0 ? threads - 1 : 0);
      for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this] { loop(); });
    } catch (const std::exception&) {  // std::system_error, std::bad_alloc: fewer workers
    }
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
      copy(destination, source, bytes);
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

  void copy(std::byte* destination, const std::byte* source, std::size_t bytes) const {
    if (streaming_) {
      streaming_copy(destination, source, bytes);
    } else {
      std::memcpy(destination, source, bytes);
    }
  }

  void work(const Job& job) {
    for (;;) {
      const std::size_t index = next_part_.fetch_add(1);
      if (index >= job.parts) return;
      const std::size_t begin = index * job.part;
      const std::size_t length = std::min(job.part, job.bytes - std::min(job.bytes, begin));
      if (length > 0) copy(job.destination + begin, job.source + begin, length);
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

  const bool streaming_;
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
