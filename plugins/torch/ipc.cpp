// ipc.cpp: CUDA tensors shared between processes (torch.multiprocessing) under
// vram_torch.enable(): the exported vram_torch_ipc_* functions (vram_torch.h).
//
// Rules: a block is exported as the CUDA IPC handle of the cudaMalloc segment it lies in and
// its offset there (cuda/ipc.hpp); blocks over CUDA virtual memory are refused with the fix.
// An importing process maps each handle once and keeps it mapped for its life (a cache by
// handle bytes), as PyTorch's own IPC cache does; the exporter keeps the tensor alive while
// importers use it.
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <string>

#include "cuda/ipc.hpp"
#include "errors.hpp"
#include "ipc.hpp"
#include "vram_torch.h"

#define VRAM_TORCH_API extern "C" __attribute__((visibility("default")))

namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == VRAM_TORCH_IPC_HANDLE_BYTES);

struct Imported {
  std::mutex mutex;
  std::map<std::string, void*> by_handle;  // handle bytes and device -> mapped base
};
Imported& imported() {
  static auto* table = new Imported;  // never destroyed: tensors may outlive static teardown
  return *table;
}

}  // namespace

VRAM_TORCH_API int vram_torch_ipc_export(const void* ptr, void* handle_out, size_t* offset_out) {
  if (ptr == nullptr || handle_out == nullptr || offset_out == nullptr) {
    vram_torch::note_error(
        "CUDA IPC export: null argument (ptr, handle_out or offset_out). Fix: pass a block of "
        "vram_torch, a buffer of VRAM_TORCH_IPC_HANDLE_BYTES and an offset to fill.",
        false);
    return -1;
  }
  try {
    const vram::cuda::IpcExport exported = vram::cuda::export_ipc(ptr);
    std::memcpy(handle_out, &exported.handle, sizeof exported.handle);
    *offset_out = exported.offset;
    return 0;
  } catch (const std::exception& e) {
    vram_torch::note_error(e.what(), false);
    return -1;
  }
}

VRAM_TORCH_API void* vram_torch_ipc_open(const void* handle, int device) {
  if (handle == nullptr) {
    vram_torch::note_error(
        "CUDA IPC import: the handle is NULL. Fix: pass the VRAM_TORCH_IPC_HANDLE_BYTES bytes "
        "vram_torch_ipc_export wrote.",
        false);
    return nullptr;
  }
  try {
    return vram_torch::open_shared(handle, device);
  } catch (const std::exception& e) {
    vram_torch::note_error_built([&] { return std::string("CUDA IPC import: ") + e.what(); },
                                 false);
    return nullptr;
  }
}

void* vram_torch::open_shared(const void* handle, int device) {
  std::string key(static_cast<const char*>(handle), VRAM_TORCH_IPC_HANDLE_BYTES);
  key += std::to_string(device);
  Imported& table = imported();
  std::lock_guard lock(table.mutex);
  if (auto it = table.by_handle.find(key); it != table.by_handle.end()) return it->second;
  cudaIpcMemHandle_t raw;
  std::memcpy(&raw, handle, sizeof raw);
  void* base = vram::cuda::open_ipc(raw, device);
  table.by_handle.emplace(std::move(key), base);
  return base;
}
