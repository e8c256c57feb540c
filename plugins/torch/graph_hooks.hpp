// graph_hooks.hpp: PyTorch's graph-capture hooks of CUDAPluggableAllocator, set to the
// device states' GraphRoutes (graph_routes.hpp).
#pragma once

namespace vram_torch {

// Sets the begin/end/release-pool hooks of PyTorch's current allocator, which must be the
// CUDAPluggableAllocator made over this library (vram_torch.enable() calls this right after
// change_current_allocator). 1: set; 0: this build has no Torch (the hooks need its headers
// and libtorch_cuda); -1: the current allocator is not a pluggable one. The reason of 0 or
// -1 is the last error.
int install_graph_hooks() noexcept;
// True once install_graph_hooks() set the hooks: the C entry points then route captures.
bool graph_hooks_installed() noexcept;

}  // namespace vram_torch
