// The peers `vram replay` compares DevicePool with: cudaMallocAsync on a private pool,
// CUB's CachingDeviceAllocator and plain cudaMalloc. All three are stream-ordered by
// construction (see replay_allocator.hpp), so the driver calls them in trace order.
#include <cub/util_allocator.cuh>

#include <algorithm>
#include <mutex>

#include "replay/replay_allocator.hpp"
#include "vram/cuda/error.hpp"

namespace vram::replay {
namespace {

// cudaErrorMemoryAllocation becomes vram::OutOfMemory (a failed_at in the replay); any
// other error a vram::CudaError.
void check_allocation(cudaError_t result, std::size_t bytes, const char* call) {
  if (result == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw OutOfMemory(bytes, 0, 0, std::string(call) + ": cudaErrorMemoryAllocation");
  }
  cuda::check(result, call);
}

// cudaMallocFromPoolAsync on a pool of its own, release threshold UINT64_MAX (keeps all).
class CudaMallocAsyncPeer final : public ReplayAllocator {
 public:
  explicit CudaMallocAsyncPeer(int device) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cuda::check(cudaMemPoolCreate(&pool_, &props), "cudaMemPoolCreate");
    std::uint64_t keep_all = UINT64_MAX;
    cuda::check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep_all),
                "cudaMemPoolSetAttribute(cudaMemPoolAttrReleaseThreshold)");
  }
  ~CudaMallocAsyncPeer() override {
    if (cudaDeviceSynchronize() != cudaSuccess || cudaMemPoolDestroy(pool_) != cudaSuccess) {
      (void)cudaGetLastError();
    }
  }
  void* allocate(std::size_t bytes, ReplayStream stream) override {
    void* block = nullptr;
    check_allocation(cudaMallocFromPoolAsync(&block, bytes, pool_, stream.handle), bytes,
                     "cudaMallocFromPoolAsync");
    return block;
  }
  void deallocate(void* block, std::size_t, ReplayStream stream) override {
    cuda::check(cudaFreeAsync(block, stream.handle), "cudaFreeAsync");
  }
  bool stream_ordered() const override { return true; }
  void synchronize() override { cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
  std::size_t peak_reserved_bytes() override {
    std::uint64_t value = 0;
    cuda::check(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &value),
                "cudaMemPoolGetAttribute(cudaMemPoolAttrReservedMemHigh)");
    return value;
  }
  std::size_t reserved_bytes() override {
    std::uint64_t value = 0;
    cuda::check(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &value),
                "cudaMemPoolGetAttribute(cudaMemPoolAttrReservedMemCurrent)");
    return value;
  }
  std::optional<std::uint64_t> upstream_allocations() override { return std::nullopt; }

 private:
  cudaMemPool_t pool_ = nullptr;
};

// CUB with bins of powers of two from 256 B to 1 GiB and a 16 GiB cache (as `vram bench`),
// so every size a model asks for below 1 GiB is cached. Its reserved bytes are its cached
// plus live bytes; they only grow inside DeviceAllocate, when it called cudaMalloc.
class CubPeer final : public ReplayAllocator {
 public:
  explicit CubPeer(int device) : device_(device), cub_(2, 8, 30, std::size_t{16} << 30, true) {}
  ~CubPeer() override { (void)cub_.FreeAllCached(); }
  void* allocate(std::size_t bytes, ReplayStream stream) override {
    void* block = nullptr;
    check_allocation(cub_.DeviceAllocate(device_, &block, bytes, stream.handle), bytes,
                     "cub::CachingDeviceAllocator::DeviceAllocate");
    const std::size_t now = reserved();
    if (now > reserved_) ++upstream_allocations_;
    reserved_ = now;
    peak_ = std::max(peak_, now);
    return block;
  }
  void deallocate(void* block, std::size_t, ReplayStream) override {
    cuda::check(cub_.DeviceFree(device_, block), "cub::CachingDeviceAllocator::DeviceFree");
    reserved_ = reserved();
  }
  bool stream_ordered() const override { return true; }
  void synchronize() override { cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
  std::size_t peak_reserved_bytes() override { return peak_; }
  std::size_t reserved_bytes() override { return reserved(); }
  std::optional<std::uint64_t> upstream_allocations() override { return upstream_allocations_; }

 private:
  std::size_t reserved() {
    std::lock_guard lock(cub_.mutex);
    auto it = cub_.cached_bytes.find(device_);
    return it == cub_.cached_bytes.end() ? 0 : it->second.free + it->second.live;
  }
  int device_;
  cub::CachingDeviceAllocator cub_;
  std::size_t reserved_ = 0;
  std::size_t peak_ = 0;
  std::uint64_t upstream_allocations_ = 0;
};

// cudaMalloc/cudaFree per event: reserved is what is live (granularity not counted).
class CudaMallocPeer final : public ReplayAllocator {
 public:
  ~CudaMallocPeer() override = default;
  void* allocate(std::size_t bytes, ReplayStream) override {
    void* block = nullptr;
    check_allocation(cudaMalloc(&block, bytes), bytes, "cudaMalloc");
    live_ += bytes;
    peak_ = std::max(peak_, live_);
    ++allocations_;
    return block;
  }
  void deallocate(void* block, std::size_t bytes, ReplayStream) override {
    cuda::check(cudaFree(block), "cudaFree");
    live_ -= bytes;
  }
  bool stream_ordered() const override { return true; }
  std::size_t peak_reserved_bytes() override { return peak_; }
  std::size_t reserved_bytes() override { return live_; }
  std::optional<std::uint64_t> upstream_allocations() override { return allocations_; }

 private:
  std::size_t live_ = 0;
  std::size_t peak_ = 0;
  std::uint64_t allocations_ = 0;
};

}  // namespace

std::vector<AllocatorSpec> cuda_peer_specs() {
  std::vector<AllocatorSpec> specs;
  specs.push_back({"cudaMallocAsync (private pool)", true,
                   "cudaMemPoolCreate, release threshold UINT64_MAX; peak reserved = "
                   "cudaMemPoolAttrReservedMemHigh; upstream allocations not exposed",
                   [](const ReplayContext& c) -> std::unique_ptr<ReplayAllocator> {
                     return std::make_unique<CudaMallocAsyncPeer>(c.device_id);
                   }});
  specs.push_back({"CUB CachingDeviceAllocator", true,
                   "bins 2^8..2^30, 16 GiB cache; reserved = cached + live bytes",
                   [](const ReplayContext& c) -> std::unique_ptr<ReplayAllocator> {
                     return std::make_unique<CubPeer>(c.device_id);
                   }});
  specs.push_back({"cudaMalloc", true, "reserved = live requested bytes",
                   [](const ReplayContext&) -> std::unique_ptr<ReplayAllocator> {
                     return std::make_unique<CudaMallocPeer>();
                   }});
  return specs;
}

std::vector<AllocatorSpec> all_replay_allocators() {
  std::vector<AllocatorSpec> specs;
  specs.push_back(device_pool_spec());
  specs.push_back(device_pool_segments_spec());
  specs.push_back(device_pool_split_every_segment_spec());
  for (auto& spec : cuda_peer_specs()) specs.push_back(std::move(spec));
  for (auto& spec : torch_peer_specs()) specs.push_back(std::move(spec));
  return specs;
}

}  // namespace vram::replay
