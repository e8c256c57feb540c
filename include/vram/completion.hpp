// vram/completion.hpp: the one completion vocabulary of the library.
//
// Every "has this GPU work finished?" in vram is one primitive: a CUDA event recorded after
// the work (vram::cuda::Event), observed from the host through two calls:
//   ready()  non-blocking: true once the work before the event has completed;
//   wait()   blocking: returns once it has (throws vram::CudaError if the device failed).
// A type with these two calls is a vram::Completion. The users of the primitive:
//   - PendingWork<Fence> / PendingWorkQueue<Fence> (pending_work.hpp) hold pool blocks
//     until their Fence, any Completion, is ready (cuda::Event in production, host fakes
//     in the CPU tests); a PendingWork is itself a Completion;
//   - PendingCopy (copy.hpp) holds a copy's end event; its wait() is the same wait, but
//     rvalue-qualified because it also consumes the PendingCopy and yields the single
//     CopyCompleted witness: a ConsumingCompletion. A witness is a completion that was
//     observed, made unforgeable: it has no ready()/wait() of its own because it only
//     exists once the wait has returned;
//   - StreamOrderedPool::hand_over(from, to) records the same event on `from` and makes
//     `to` wait for it on the device (cuda::Event::make_wait): the device-side observer
//     of the same primitive, so there is no host wait to express.
#pragma once

#include <concepts>
#include <utility>

namespace vram {

template <class Fence>
concept Completion = std::movable<Fence> && requires(Fence& fence, const Fence& observed) {
  { observed.ready() } -> std::convertible_to<bool>;
  fence.wait();
};

// A completion observed once: ready() as above; wait() on the rvalue blocks, consumes the
// object and yields the proof (`Witness`) that the work completed.
template <class Pending, class Witness>
concept ConsumingCompletion = std::movable<Pending> &&
    requires(Pending&& pending, const Pending& observed) {
  { observed.ready() } -> std::convertible_to<bool>;
  { std::move(pending).wait() } -> std::same_as<Witness>;
};

}  // namespace vram
