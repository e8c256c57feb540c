#include "graph_hooks.hpp"

#include <atomic>
#include <exception>
#include <functional>
#include <string>
#include <utility>

#include "device_registry.hpp"
#include "errors.hpp"

#ifdef VRAM_TORCH_WITH_C10
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#endif

namespace vram_torch {

namespace {
std::atomic<bool> g_hooks_installed{false};
}  // namespace

bool graph_hooks_installed() noexcept { return g_hooks_installed.load(std::memory_order_relaxed); }

#ifdef VRAM_TORCH_WITH_C10
namespace {

GraphRoutes::MempoolId key_of(const c10::cuda::MempoolId_t& id) {
  return {static_cast<std::uint64_t>(id.first), static_cast<std::uint64_t>(id.second)};
}

}  // namespace

int install_graph_hooks() noexcept {
  using torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
  auto* pluggable = dynamic_cast<CUDAPluggableAllocator*>(c10::cuda::CUDACachingAllocator::get());
  if (pluggable == nullptr) {
    note_error(
        "graph hooks: PyTorch's current CUDA allocator is not the pluggable allocator over "
        "vram; call vram_torch.enable() before the first CUDA allocation",
        false);
    return -1;
  }
  try {
    // An exception thrown here reaches torch.cuda.graph's capture_begin as a RuntimeError.
    pluggable->set_begin_allocate_to_pool(
        [](int device, c10::cuda::MempoolId_t id, std::function<bool(cudaStream_t)> filter) {
          state_for(device).graphs.begin(key_of(id), std::move(filter));
        });
    pluggable->set_end_allocate_to_pool_fn([](int device, c10::cuda::MempoolId_t id) {
      if (DeviceState* state = find_state(device)) state->graphs.end(key_of(id));
    });
    pluggable->set_release_pool([](int device, c10::cuda::MempoolId_t id) {
      if (DeviceState* state = find_state(device)) state->graphs.release(key_of(id));
    });
  } catch (const std::exception& e) {
    note_error_built([&] { return std::string("graph hooks: ") + e.what(); }, false);
    return -1;
  }
  g_hooks_installed.store(true, std::memory_order_relaxed);
  return 1;
}
#else
int install_graph_hooks() noexcept {
  note_error(
      "graph hooks: this libvram_torch.so was built without Torch, so torch.cuda.graph "
      "cannot keep a graph's memory apart. Fix: build it with CMAKE_PREFIX_PATH set to "
      "torch.utils.cmake_prefix_path (README, PyTorch)",
      false);
  return 0;
}
#endif

}  // namespace vram_torch
