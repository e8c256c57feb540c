// native_allocator.hpp: vram as PyTorch's own CUDA allocator: a
// c10::cuda::CUDACachingAllocator::CUDAAllocator over each device's DevicePool
// (device_registry.hpp), installed by vram_torch_install_native() before CUDA initialises,
// as torch.cuda.memory.change_current_allocator does. Built only where Torch is found.
//
// Every entry point of the interface has an implementation, so torch.cuda's memory calls
// work (enable(false), use_on_oom and no_split are accepted and change nothing; emptyCache
// of a pool trims the whole cache; no SEGMENT_* trace events are reported):
// - Requests come from the pool stream-ordered on the current stream; a free returns the
//   block on its allocation stream (record_stream: held back as in the pluggable route).
// - Statistics (memory_stats, memory_allocated, max_memory_reserved, ...) are counted by
//   the allocator; reserved bytes, device allocations and frees are the pool's.
// - History and snapshots: PyTorch's trace entries and stacks (memory_history.hpp);
//   a snapshot's segments are the pool's memory map (DevicePool::memory_map).
// - Private pools (CUDA graphs, graph trees, torch.cuda.MemPool): graph_routes.hpp; a
//   checkpoint of a pool is its live blocks, restored at the same addresses.
// - IPC: a block in a cudaMalloc segment is shared by its CUDA IPC handle and offset; one
//   over CUDA virtual memory cannot be (the error says how to avoid it).
#pragma once

namespace vram_torch {

// Installs the allocator: 1 on success, -1 with the reason in the last error (PyTorch's
// allocator already initialised, or no host memory).
int install_native_allocator() noexcept;

}  // namespace vram_torch
