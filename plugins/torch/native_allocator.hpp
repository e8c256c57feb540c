// native_allocator.hpp: vram as PyTorch's own CUDA allocator: a
// c10::cuda::CUDACachingAllocator::CUDAAllocator over each device's DevicePool
// (device_registry.hpp), installed by vram_torch_install_native() before CUDA initialises,
// as torch.cuda.memory.change_current_allocator does. Built only where Torch is found.
//
// Every entry point of the interface has an implementation, so torch.cuda's memory calls
// work (enable(false), use_on_oom and no_split are accepted and change nothing; emptyCache
// of a pool trims the whole cache):
// - Requests come from the pool stream-ordered on the current stream; a free returns the
//   block on its allocation stream (record_stream: held back as in the pluggable route).
// - Statistics (memory_stats, memory_allocated, max_memory_reserved, ...) are counted by
//   the allocator; reserved bytes, device allocations and frees are the pool's.
// - History and snapshots: PyTorch's trace entries and stacks (memory_history.hpp). A
//   segment is a unit of the pool's memory (SegmentUnits, device_registry.hpp: a cudaMalloc
//   segment, a mapped run of virtual memory, a sleep tag's run), cut where a private pool's
//   blocks begin. SEGMENT_ALLOC follows a unit's growth and SEGMENT_FREE precedes its
//   give-back (trim, empty_cache, growth past the budget, sleep), both to the history and
//   the trace trackers, so NCCL's registration hooks (TORCH_NCCL_USE_TENSOR_REGISTER_
//   ALLOCATOR_HOOK) deregister a unit before its memory goes: what they registered from a
//   snapshot is always a whole unit or a piece at its start. Mapped runs are reported as
//   SEGMENT_ALLOC/FREE, not SEGMENT_MAP/UNMAP: each is one allocation mapped and unmapped
//   whole, and NCCL's hooks act only on the former.
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
