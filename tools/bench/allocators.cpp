#include "bench/allocators.hpp"

#include <cub/util_allocator.cuh>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>

#include "tier/segment_tier.hpp"
#include "vram/cuda/error.hpp"
#include "vram/device_pool.hpp"
#include "vram/stream_ordered_pool.hpp"
#include "vram/units.hpp"

namespace vram::bench {
namespace {

using namespace vram::literals;

DevicePool::Options bench_pool_options() {
  DevicePool::Options options;
  options.max_cached_bytes = 16_GiB;
  options.validate_deallocations = false;
  return options;
}

// `stream_ordered`: allocate_async / deallocate_async on the caller's stream instead of
// allocate / deallocate.
class OurDevicePool final : public BenchAllocator {
 public:
  explicit OurDevicePool(std::shared_ptr<Upstream> upstream, std::string label,
                         bool stream_ordered = false)
      : pool_(std::move(upstream), bench_pool_options()),
        label_(std::move(label)),
        stream_ordered_(stream_ordered) {}
  std::string name() const override { return label_; }
  bool ours() const override { return true; }
  void* allocate(std::size_t bytes, cudaStream_t stream) override {
    return stream_ordered_ ? pool_.allocate_async(bytes, stream) : pool_.allocate(bytes);
  }
  void deallocate(void* block, std::size_t bytes, cudaStream_t stream) override {
    if (stream_ordered_) {
      pool_.deallocate_async(block, bytes, stream);
    } else {
      pool_.deallocate(block, bytes);
    }
  }
  void finish(cudaStream_t stream) override {
    if (stream_ordered_ && stream != nullptr) {
      cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    }
  }
  std::size_t peak_reserved_bytes() override { return pool_.stats().peak_bytes_reserved; }
  void reset_peak() override {
    pool_.trim(0);
    pool_.reset_peak();
  }
  void release_cache() override { pool_.trim(0); }
  double device_synchronizes() override { return static_cast<double>(pool_.stats().quiesces); }
  std::map<std::string, double> counters() override {
    const DevicePoolStats s = pool_.stats();
    return {{"upstream_allocations", static_cast<double>(s.upstream_allocations)},
            {"upstream_frees", static_cast<double>(s.upstream_frees)},
            {"stream_quiesces", static_cast<double>(s.stream_quiesces)},
            {"stream_marker_wants", static_cast<double>(s.stream_marker_wants)},
            {"stream_markers", static_cast<double>(s.stream_markers)},
            {"misses", static_cast<double>(s.misses)}};
  }

 private:
  DevicePool pool_;
  std::string label_;
  bool stream_ordered_;
};

class OurStreamOrderedPool final : public BenchAllocator {
 public:
  explicit OurStreamOrderedPool(int device) : pool_(StreamOrderedPool::Options{.device = device}) {}
  std::string name() const override { return "vram StreamOrderedPool"; }
  bool ours() const override { return true; }
  void* allocate(std::size_t bytes, cudaStream_t stream) override {
    return pool_.allocate_async(bytes, stream);
  }
  void deallocate(void* block, std::size_t bytes, cudaStream_t stream) override {
    pool_.deallocate_async(block, bytes, stream);
  }
  void finish(cudaStream_t stream) override {
    cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  std::size_t peak_reserved_bytes() override { return pool_.pool_reserved_high_water(); }
  void reset_peak() override {
    cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    pool_.trim(0);
    pool_.reset_pool_high_water();
  }
  void release_cache() override {
    cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    pool_.trim(0);
  }

 private:
  StreamOrderedPool pool_;
};

// `private_pool`: a pool made for this peer (cudaMemPoolCreate) and cudaMallocFromPoolAsync,
// so no other allocation in the process shares it; otherwise the device's default pool.
class CudaMallocAsyncPeer final : public BenchAllocator {
 public:
  explicit CudaMallocAsyncPeer(int device, bool private_pool = false) : owned_(private_pool) {
    if (private_pool) {
      cudaMemPoolProps props{};
      props.allocType = cudaMemAllocationTypePinned;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = device;
      cuda::check(cudaMemPoolCreate(&pool_, &props), "cudaMemPoolCreate");
    } else {
      cuda::check(cudaDeviceGetDefaultMemPool(&pool_, device), "cudaDeviceGetDefaultMemPool");
    }
    std::uint64_t retain_all = UINT64_MAX;
    cuda::check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &retain_all),
                "cudaMemPoolSetAttribute");
  }
  ~CudaMallocAsyncPeer() override {
    if (owned_) {
      (void)cudaDeviceSynchronize();
      (void)cudaMemPoolDestroy(pool_);
    }
  }
  std::string name() const override {
    return owned_ ? "cudaMallocAsync (private pool)" : "cudaMallocAsync";
  }
  bool ours() const override { return false; }
  void* allocate(std::size_t bytes, cudaStream_t stream) override {
    void* block = nullptr;
    cuda::check(cudaMallocFromPoolAsync(&block, bytes, pool_, stream), "cudaMallocFromPoolAsync");
    return block;
  }
  void deallocate(void* block, std::size_t, cudaStream_t stream) override {
    cuda::check(cudaFreeAsync(block, stream), "cudaFreeAsync");
  }
  void finish(cudaStream_t stream) override {
    cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  std::size_t peak_reserved_bytes() override {
    std::uint64_t value = 0;
    cuda::check(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &value),
                "cudaMemPoolGetAttribute");
    return value;
  }
  void reset_peak() override {
    release_cache();
    std::uint64_t zero = 0;
    cuda::check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero),
                "cudaMemPoolSetAttribute");
  }
  void release_cache() override {
    cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cuda::check(cudaMemPoolTrimTo(pool_, 0), "cudaMemPoolTrimTo");
  }

 private:
  cudaMemPool_t pool_ = nullptr;
  bool owned_;
};

// CUB configured so every benchmarked size is cached: bins of powers of two from 256 B to
// 1 GiB (bin_growth 2, min_bin 8, max_bin 30), 16 GiB cache.
class CubCachingPeer final : public BenchAllocator {
 public:
  explicit CubCachingPeer(int device) : device_(device), cub_(2, 8, 30, 16_GiB, true) {}
  ~CubCachingPeer() override { (void)cub_.FreeAllCached(); }
  std::string name() const override { return "CUB CachingDeviceAllocator"; }
  bool ours() const override { return false; }
  void* allocate(std::size_t bytes, cudaStream_t stream) override {
    void* block = nullptr;
    cuda::check(cub_.DeviceAllocate(device_, &block, bytes, stream), "cub::DeviceAllocate");
    return block;
  }
  void deallocate(void* block, std::size_t, cudaStream_t) override {
    cuda::check(cub_.DeviceFree(device_, block), "cub::DeviceFree");
  }
  void finish(cudaStream_t stream) override {
    cuda::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
  std::size_t peak_reserved_bytes() override {
    std::lock_guard lock(cub_.mutex);
    auto it = cub_.cached_bytes.find(device_);
    return it == cub_.cached_bytes.end() ? 0 : it->second.free + it->second.live;
  }
  void reset_peak() override { release_cache(); }
  void release_cache() override { (void)cub_.FreeAllCached(); }

 private:
  int device_;
  cub::CachingDeviceAllocator cub_;
};

// Bytes live and their high-water mark, for the peers that hold exactly what is live
// (cudaMalloc, malloc): their "reserved" is the requested bytes; their own overhead is not
// seen. ReservedGauge keeps the mark exact under concurrent calls.
class LivePeer : public BenchAllocator {
 public:
  std::size_t peak_reserved_bytes() override { return live_.peak.load(); }
  void reset_peak() override { live_.peak.store(live_.reserved.load()); }

 protected:
  detail::ReservedGauge live_;
};

class CudaMallocPeer final : public LivePeer {
 public:
  std::string name() const override { return "cudaMalloc"; }
  bool ours() const override { return false; }
  void* allocate(std::size_t bytes, cudaStream_t) override {
    void* block = nullptr;
    cuda::check(cudaMalloc(&block, bytes), "cudaMalloc");
    live_.add(bytes);
    return block;
  }
  void deallocate(void* block, std::size_t bytes, cudaStream_t) override {
    cuda::check(cudaFree(block), "cudaFree");
    live_.sub(bytes);
  }
};

class MallocPeer final : public LivePeer {
 public:
  std::string name() const override { return "malloc/free (host reference)"; }
  bool ours() const override { return false; }
  void* allocate(std::size_t bytes, cudaStream_t) override {
    void* block = std::malloc(bytes);
    if (block == nullptr) throw std::bad_alloc();
    live_.add(bytes);
    return block;
  }
  void deallocate(void* block, std::size_t bytes, cudaStream_t) override {
    std::free(block);
    live_.sub(bytes);
  }
};

}  // namespace

std::vector<std::unique_ptr<BenchAllocator>> make_device_allocators(int device) {
  std::vector<std::unique_ptr<BenchAllocator>> result;
  result.push_back(std::make_unique<OurDevicePool>(std::make_shared<DeviceMemoryUpstream>(device),
                                                   "vram DevicePool"));
  result.push_back(std::make_unique<OurStreamOrderedPool>(device));
  result.push_back(std::make_unique<CudaMallocAsyncPeer>(device));
  result.push_back(std::make_unique<CubCachingPeer>(device));
  result.push_back(std::make_unique<CudaMallocPeer>());
  return result;
}

std::vector<std::unique_ptr<BenchAllocator>> make_batched_allocators(int device) {
  std::vector<std::unique_ptr<BenchAllocator>> result;
  result.push_back(std::make_unique<OurDevicePool>(std::make_shared<DeviceMemoryUpstream>(device),
                                                   "vram DevicePool"));
  result.push_back(std::make_unique<OurDevicePool>(std::make_shared<DeviceMemoryUpstream>(device),
                                                   "vram DevicePool (stream-ordered)", true));
  result.push_back(std::make_unique<CudaMallocAsyncPeer>(device, /*private_pool=*/true));
  result.push_back(std::make_unique<CubCachingPeer>(device));
  return result;
}

std::vector<std::unique_ptr<BenchAllocator>> make_host_allocators() {
  std::vector<std::unique_ptr<BenchAllocator>> result;
  result.push_back(std::make_unique<OurDevicePool>(std::make_shared<HostMemoryUpstream>(),
                                                   "vram DevicePool (host upstream)"));
  result.push_back(std::make_unique<MallocPeer>());
  return result;
}

}  // namespace vram::bench
