// offload.hpp: the plug-in's weight pager over a module's host weights, behind the
// vram_torch_pager_* functions (vram_torch.h, "Offload"); python/vram_offload.py pages a
// PyTorch module's parameters through it.
//
// Rules:
// - Everything is validated before anything is allocated or pinned: a budget below
//   min_offload_budget() is refused with the least budget that works.
// - The plan keeps the requested prefetch depth or the pager is not made (no silent lowering:
//   a smaller ring than asked for streams at a fraction of the link's rate).
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "vram/weight_pager.hpp"

namespace vram_torch {

// The least budget holding the pieces that must stay resident (those larger than the slot)
// plus (depth + 1) slots, over every slot size; the pieces' total when that is less (always
// so when (depth + 1) slots pass the address space: that ring never fits). Sizes are
// rounded up to `alignment` as the pager's arena does. Throws vram::InvalidArgument for
// what the pager refuses at any budget: no pieces, a piece of 0 bytes, a piece or the
// pieces' total past the address space once aligned. Every sum is checked: nothing wraps.
std::size_t min_offload_budget(std::span<const std::size_t> bytes, std::size_t depth,
                               std::size_t alignment = 256);

// Throws vram::InvalidArgument when `budget` is below min_offload_budget(bytes, depth) (or
// that throws), naming the least budget and the fix.
void check_offload_budget(std::span<const std::size_t> bytes, std::size_t budget,
                          std::size_t depth);

// A WeightPager for `layers` (the pieces) that keeps options.plan.prefetch_depth. Throws
// vram::InvalidArgument (bad input, a budget below min_offload_budget), and what the
// pager's constructor throws. `device` null: the CUDA device of options.device.
std::unique_ptr<vram::WeightPager> make_offload_pager(std::vector<vram::WeightLayer> layers,
                                                      vram::WeightPagerOptions options,
                                                      std::unique_ptr<vram::PagerDevice> device);

// Host memory standing in for the device (a test seam: the whole offload path runs without
// a GPU). Page-ins are memcpy at once; events are not needed (everything is synchronous).
std::unique_ptr<vram::PagerDevice> make_host_pager_device();

}  // namespace vram_torch
