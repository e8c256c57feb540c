// vram/pending_work.hpp: keep pool blocks out of the free list until queued GPU work ends.
//
// A block handed to GPU work must not return to a pool before that work has completed.
// PendingWork takes the leases of one dispatch together with a fence recorded after the
// dispatch (a vram::cuda::Event in production) and returns the leases to their pools only
// once the fence is ready: ready() checks without blocking, poll() checks and returns the
// leases, wait() blocks until the work completed and returns them. The pool itself
// makes no driver call for this; the event is the one the engine records anyway.
//
//   vram::cuda::Event done;
//   launch(kernel, a.data(), b.data(), stream);
//   done.record(stream);
//   vram::PendingWorkQueue<vram::cuda::Event> in_flight;
//   in_flight.submit(std::move(done), std::move(a), std::move(b));
//   ...
//   in_flight.collect();   // each step: returns the blocks of every completed dispatch
//
// Fence: any vram::Completion (completion.hpp): `ready()` non-blocking, `wait()` blocking.
// Destroying or move-assigning over pending work waits for its fence first. A PendingWork
// is itself a Completion.
#pragma once

#include <cstdio>
#include <deque>
#include <exception>
#include <utility>
#include <vector>

#include "vram/completion.hpp"
#include "vram/cuda/event.hpp"
#include "vram/device_pool.hpp"

namespace vram {

template <Completion Fence>
class PendingWork {
 public:
  using Lease = DevicePool::Lease;

  template <class... Leases>
  explicit PendingWork(Fence fence, Leases&&... leases) : fence_(std::move(fence)) {
    leases_.reserve(sizeof...(leases));
    (leases_.push_back(std::forward<Leases>(leases)), ...);
  }
  PendingWork(Fence fence, std::vector<Lease> leases)
      : fence_(std::move(fence)), leases_(std::move(leases)) {}
  PendingWork(PendingWork&& other) noexcept
      : fence_(std::move(other.fence_)), leases_(std::exchange(other.leases_, {})) {}
  // Waits for this object's own unfinished work first (as the destructor does), so the
  // blocks it holds cannot go back to their pools while that work may still use them.
  PendingWork& operator=(PendingWork&& other) noexcept {
    if (this != &other) {
      wait_or_leak();
      fence_ = std::move(other.fence_);
      leases_ = std::exchange(other.leases_, {});
    }
    return *this;
  }
  PendingWork(const PendingWork&) = delete;
  PendingWork& operator=(const PendingWork&) = delete;

  // Destroying pending work waits for it first, so its blocks can never be reused early.
  // If the wait fails (device lost, driver shut down), the blocks are leaked deliberately
  // rather than handed out while they may still be in use.
  ~PendingWork() { wait_or_leak(); }

  // True once the work has completed (or nothing is held); never blocks, returns nothing.
  bool ready() const { return leases_.empty() || static_cast<bool>(fence_.ready()); }

  // Returns true once the work has completed and the leases went back to their pools.
  bool poll() {
    if (leases_.empty()) return true;
    if (!fence_.ready()) return false;
    leases_.clear();
    return true;
  }

  void wait() {
    if (leases_.empty()) return;
    fence_.wait();
    leases_.clear();
  }

  bool released() const noexcept { return leases_.empty(); }
  std::size_t held() const noexcept { return leases_.size(); }

 private:
  void wait_or_leak() noexcept {
    if (leases_.empty()) return;
    try {
      fence_.wait();
    } catch (const std::exception& error) {
      std::fprintf(stderr, "vram::PendingWork: wait failed (%s); leaking %zu block(s)\n",
                   error.what(), leases_.size());
      for (auto& lease : leases_) (void)lease.release();
    } catch (...) {
      std::fprintf(stderr, "vram::PendingWork: wait failed; leaking %zu block(s)\n",
                   leases_.size());
      for (auto& lease : leases_) (void)lease.release();
    }
    leases_.clear();
  }

  Fence fence_;
  std::vector<Lease> leases_;
};

// In-order queue of dispatches; collect() releases every completed one at the front.
template <Completion Fence>
class PendingWorkQueue {
 public:
  template <class... Leases>
  void submit(Fence fence, Leases&&... leases) {
    queue_.emplace_back(std::move(fence), std::forward<Leases>(leases)...);
  }
  // Non-blocking; returns how many dispatches were released.
  std::size_t collect() {
    std::size_t released = 0;
    while (!queue_.empty() && queue_.front().poll()) {
      queue_.pop_front();
      ++released;
    }
    return released;
  }
  void drain() {
    for (auto& work : queue_) work.wait();
    queue_.clear();
  }
  std::size_t size() const noexcept { return queue_.size(); }

 private:
  std::deque<PendingWork<Fence>> queue_;
};

// The production fence and the work it guards are completions.
static_assert(Completion<cuda::Event>);
static_assert(Completion<PendingWork<cuda::Event>>);

}  // namespace vram
