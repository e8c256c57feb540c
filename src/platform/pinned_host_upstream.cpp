#include "vram/pinned_host_upstream.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "cuda/host_registration.hpp"
#include "cuda/memory.hpp"
#include "vram/cuda/error.hpp"

namespace vram {
namespace {

constexpr std::size_t kPage = 4096;
constexpr std::size_t kTouchChunkPerThread = std::size_t{32} << 20;

std::size_t round_to_pages(std::size_t bytes) { return (bytes + kPage - 1) & ~(kPage - 1); }

// The failure's reason (cuda::pin_failure_text) with how to raise the limit. Without a
// driver it is the ordinary CudaError, whose hint says how to get one.
[[noreturn]] void throw_pinning_error(const char* call, cudaError_t status, std::size_t bytes,
                                      std::size_t call_bytes) {
  if (status == cudaErrorInsufficientDriver || status == cudaErrorNoDevice) {
    cuda::check(status, call);
  }
  throw PinningError(
      std::string("vram: pinning ") + std::to_string(bytes) +
      " bytes of host memory failed: " + cuda::pin_failure_text(call, status, call_bytes) +
      ". Fix: raise the locked-memory limit (`ulimit -l unlimited`, "
      "/etc/security/limits.conf, or `docker run --ulimit memlock=-1`), free "
      "host memory, or lower the staging pool's max_bytes.");
}

}  // namespace

std::string memlock_limit_text() { return cuda::memlock_limit_text(); }

void touch_pages_in_parallel(void* data, std::size_t bytes, unsigned threads) {
  auto* base = static_cast<volatile char*>(data);
  auto touch = [base](std::size_t begin, std::size_t end) {
    for (std::size_t offset = begin; offset < end; offset += kPage) base[offset] = 0;
  };
  const std::size_t wanted = std::max<std::size_t>(1, bytes / kTouchChunkPerThread);
  const auto count = static_cast<unsigned>(std::min<std::size_t>(std::max(1U, threads), wanted));
  if (count <= 1) {
    touch(0, bytes);
    return;
  }
  const std::size_t slice = round_to_pages((bytes + count - 1) / count);
  // Slices whose thread could not be started (out of memory or threads) are touched here.
  std::vector<std::thread> workers;
  unsigned started = 1;
  try {
    workers.reserve(count - 1);
    for (; started < count; ++started) {
      const std::size_t begin = std::min(bytes, started * slice);
      const std::size_t end = std::min(bytes, begin + slice);
      workers.emplace_back(touch, begin, end);
    }
  } catch (const std::exception&) {  // std::system_error, std::bad_alloc
  }
  touch(0, std::min(bytes, slice));
  for (unsigned i = started; i < count; ++i) {
    const std::size_t begin = std::min(bytes, i * slice);
    touch(begin, std::min(bytes, begin + slice));
  }
  for (auto& worker : workers) worker.join();
}

PinningMethod PinnedHostUpstream::method_for(std::size_t bytes) const noexcept {
  if (options_.method != PinningMethod::automatic) return options_.method;
  return bytes >= options_.register_min_bytes ? PinningMethod::touch_register
                                              : PinningMethod::host_alloc;
}

void* PinnedHostUpstream::allocate(std::size_t bytes) {
  if (bytes == 0) {
    throw InvalidArgument(
        "vram::PinnedHostUpstream: zero bytes requested. Fix: ask for at "
        "least one byte.");
  }
  if (method_for(bytes) == PinningMethod::host_alloc) {
    void* block = nullptr;
    const cudaError_t status = cuda::try_allocate_pinned_host(&block, bytes);
    if (status != cudaSuccess) throw_pinning_error("cudaHostAlloc", status, bytes, bytes);
    return block;
  }
  if (bytes > SIZE_MAX - kPage) throw OutOfMemory(bytes, 0, 0, "size overflows the address space");
  const std::size_t length = round_to_pages(bytes);
  void* block = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (block == MAP_FAILED) {
    throw OutOfMemory(bytes, 0, 0, "mmap of host memory for pinning failed");
  }
#ifdef MADV_HUGEPAGE
  (void)madvise(block, length, MADV_HUGEPAGE);  // fewer pages to fault and lock; optional
#endif
  unsigned threads = options_.touch_threads;
  if (threads == 0) threads = std::min(16U, std::max(1U, std::thread::hardware_concurrency()));
  touch_pages_in_parallel(block, length, threads);
  std::vector<cuda::HostRegistration> registered;  // one registration: the whole mapping
  const cuda::HostRange range{block, length};
  if (const auto failure = cuda::register_host_pages({&range, 1}, 0, registered)) {
    munmap(block, length);
    throw_pinning_error("cudaHostRegister", failure->status, bytes, length);
  }
  return block;
}

void PinnedHostUpstream::deallocate(void* block, std::size_t bytes) noexcept {
  if (block == nullptr) return;
  if (method_for(bytes) == PinningMethod::host_alloc) {
    cuda::free_pinned_host(block);
    return;
  }
  // Unregister may fail during driver shutdown; the mapping is released either way.
  cuda::unregister_host(block);
  munmap(block, round_to_pages(bytes));
}

}  // namespace vram
