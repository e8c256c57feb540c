// A probe, not part of the build: the host-to-device copy rate into device memory mapped long
// before against memory mapped (cuMemCreate, cuMemMap, cuMemSetAccess) right after, 200 ms
// after and 1 s after the release of other memory, in runs of 1 GiB, 256 MiB and 64 MiB; 8 GiB
// of pinned host memory copied in 64 MiB cudaMemcpyAsync pieces. Driver functions through
// cudaGetDriverEntryPointByVersion (no libcuda at link time). Build and run on the GPU machine:
//   nvcc -O2 -arch=sm_90 -cudart static -o copy_after_release bench/probes/copy_after_release.cu
//   ./copy_after_release
// Each line: GB/s of A (mapped long before), B (mapped run by run, each run's copy queued after
// its map, right after the last release), C (all runs mapped first, the maps' time, then
// copied), D (all mapped, 100 ms idle, then copied), E (as B on two streams), F and G (as B,
// 200 ms and 1 s after the last release). Then, per run size: a sleep's copies to the host
// released all at once after the last copy (S) against released run by run as each run's copy
// is seen complete (P), each followed at once by the wake's pipeline (rates of both); and the
// wake's pipeline copying with a kernel that reads the pinned memory (K: mapped long before;
// KB: right after a release). Results: bench/RESULTS.md, "Sleep and wake".
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>
#define CK(x)                                               \
  do {                                                      \
    auto e = (x);                                           \
    if (e != 0) {                                           \
      printf("ERR %s:%d %d\n", __FILE__, __LINE__, (int)e); \
      exit(1);                                              \
    }                                                       \
  } while (0)
template <class F>
F get(const char* n) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion(n, &p, 12000, cudaEnableDefault, &q));
  return (F)p;
}
// Copies n16 16-byte words from (mapped, pinned) host memory to device memory.
__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n16) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n16; i += stride) dst[i] = src[i];
}
static decltype(&cuMemCreate) pCreate;
static decltype(&cuMemMap) pMap;
static decltype(&cuMemSetAccess) pAccess;
static decltype(&cuMemAddressReserve) pReserve;
static decltype(&cuMemUnmap) pUnmap;
static decltype(&cuMemRelease) pRelease;
int main() {
  CK(cudaSetDevice(0));
  CK(cudaFree(0));
  pCreate = get<decltype(&cuMemCreate)>("cuMemCreate");
  pMap = get<decltype(&cuMemMap)>("cuMemMap");
  pAccess = get<decltype(&cuMemSetAccess)>("cuMemSetAccess");
  pReserve = get<decltype(&cuMemAddressReserve)>("cuMemAddressReserve");
  pUnmap = get<decltype(&cuMemUnmap)>("cuMemUnmap");
  pRelease = get<decltype(&cuMemRelease)>("cuMemRelease");
  const size_t GiB = 1ull << 30, total = 8 * GiB, chunk = 64ull << 20;
  char* host;
  CK(cudaHostAlloc((void**)&host, total, 0));
  for (size_t i = 0; i < total; i += 4096) host[i] = 1;
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemAccessDesc acc{};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr base;
  CK(pReserve(&base, total, 0, 0, 0));
  cudaStream_t s, s2;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  auto now = [] { return std::chrono::steady_clock::now(); };
  auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  std::vector<CUmemGenericAllocationHandle> h;
  auto map_one = [&](size_t o, size_t run) {
    CUmemGenericAllocationHandle x;
    CK(pCreate(&x, run, &prop, 0));
    CK(pMap(base + o, run, 0, x, 0));
    CK(pAccess(base + o, run, &acc, 1));
    h.push_back(x);
  };
  auto mapall = [&](size_t run) {
    for (size_t o = 0; o < total; o += run) map_one(o, run);
  };
  auto unmapall = [&](size_t run) {
    size_t i = 0;
    for (size_t o = 0; o < total; o += run) {
      CK(pUnmap(base + o, run));
      CK(pRelease(h[i++]));
    }
    h.clear();
    CK(cudaDeviceSynchronize());
  };
  auto copy = [&](size_t off, size_t n, cudaStream_t st) {
    for (size_t d = 0; d < n; d += chunk)
      CK(cudaMemcpyAsync((void*)(base + off + d), host + off + d, std::min(chunk, n - d),
                         cudaMemcpyHostToDevice, st));
  };
  // Maps run by run, each run's copy queued right after its map (the wake's order; on two
  // streams taking turns when `two`), until the copies end: seconds.
  auto pipeline = [&](size_t run, bool two) {
    const auto t0 = now();
    size_t i = 0;
    for (size_t o = 0; o < total; o += run) {
      map_one(o, run);
      copy(o, run, two && (i++ & 1) ? s2 : s);
    }
    CK(cudaDeviceSynchronize());
    return secs(t0, now());
  };
  auto timed_copy = [&] {  // the whole 8 GiB on one stream: seconds
    const auto t0 = now();
    copy(0, total, s);
    CK(cudaStreamSynchronize(s));
    return secs(t0, now());
  };
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  char* host_dev = nullptr;
  CK(cudaHostGetDevicePointer((void**)&host_dev, host, 0));
  auto kcopy = [&](size_t off, size_t n, cudaStream_t st) {
    for (size_t d = 0; d < n; d += chunk) {
      const size_t m = std::min(chunk, n - d);
      copy_kernel<<<sms * 4, 512, 0, st>>>((const uint4*)(host_dev + off + d),
                                           (uint4*)(base + off + d), m / 16);
    }
    CK(cudaGetLastError());
  };
  auto kpipeline = [&](size_t run) {
    const auto t0 = now();
    for (size_t o = 0; o < total; o += run) {
      map_one(o, run);
      kcopy(o, run, s);
    }
    CK(cudaDeviceSynchronize());
    return secs(t0, now());
  };
  auto to_host = [&](size_t off, size_t n) {
    for (size_t d = 0; d < n; d += chunk)
      CK(cudaMemcpyAsync(host + off + d, (void*)(base + off + d), std::min(chunk, n - d),
                         cudaMemcpyDeviceToHost, s));
  };
  // A sleep: copies to the host, then every run released (seconds).
  auto sleep_at_end = [&](size_t run) {
    const auto t0 = now();
    to_host(0, total);
    CK(cudaStreamSynchronize(s));
    size_t i = 0;
    for (size_t o = 0; o < total; o += run) {
      CK(pUnmap(base + o, run));
      CK(pRelease(h[i++]));
    }
    const double t = secs(t0, now());
    h.clear();
    return t;
  };
  // A sleep releasing each run as soon as its copy is seen complete (seconds).
  auto sleep_pipelined = [&](size_t run) {
    const auto t0 = now();
    std::vector<cudaEvent_t> ev;
    for (size_t o = 0; o < total; o += run) {
      to_host(o, run);
      cudaEvent_t done;
      CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      CK(cudaEventRecord(done, s));
      ev.push_back(done);
    }
    size_t i = 0;
    for (size_t o = 0; o < total; o += run, ++i) {
      CK(cudaEventSynchronize(ev[i]));
      CK(pUnmap(base + o, run));
      CK(pRelease(h[i]));
    }
    const double t = secs(t0, now());
    for (cudaEvent_t done : ev) CK(cudaEventDestroy(done));
    h.clear();
    return t;
  };
  for (int round = 0; round < 3; ++round) {
    for (size_t run : std::vector<size_t>{1 * GiB, 256ull << 20}) {
      auto gbs = [&](double t) { return total / t / 1e9; };
      mapall(run);
      copy(0, total, s);
      CK(cudaDeviceSynchronize());
      const double s_end = sleep_at_end(run);
      const double w_end = pipeline(run, false);
      const double s_pipe = sleep_pipelined(run);
      const double w_pipe = pipeline(run, false);
      CK(cudaDeviceSynchronize());
      // K: the kernel's copy into memory mapped long before, against the copy engine's
      auto t0 = now();
      kcopy(0, total, s);
      CK(cudaStreamSynchronize(s));
      const double k = secs(t0, now());
      const double a = timed_copy();
      const double s_k = sleep_at_end(run);
      const double kb = kpipeline(run);
      unmapall(run);
      printf(
          "sleep round %d run %4zu MiB: S sleep %.2f then wake %.2f  P sleep %.2f then wake %.2f"
          "  | A link %.2f  K kernel %.2f  KB kernel wake after sleep %.2f (its sleep %.2f) GB/s\n",
          round, run >> 20, gbs(s_end), gbs(w_end), gbs(s_pipe), gbs(w_pipe), gbs(a), gbs(k),
          gbs(kb), gbs(s_k));
      fflush(stdout);
    }
  }
  for (int round = 0; round < 2; ++round) {
    for (size_t run : std::vector<size_t>{1 * GiB, 256ull << 20, 64ull << 20}) {
      // A: mapped long ago (map, copy once, then time a second copy)
      mapall(run);
      copy(0, total, s);
      CK(cudaStreamSynchronize(s));
      double a = timed_copy();
      unmapall(run);
      // B: map run by run, copy each run right after its map (the wake's pipeline)
      double b = pipeline(run, false);
      unmapall(run);
      // C: map all first (timed separately), then copy
      auto t0 = now();
      mapall(run);
      double cm = secs(t0, now());
      double c = timed_copy();
      unmapall(run);
      // D: map all, wait 100 ms, then copy
      mapall(run);
      CK(cudaDeviceSynchronize());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      double d = timed_copy();
      unmapall(run);
      // E: pipeline as B, copies alternating on two streams
      double e = pipeline(run, true);
      unmapall(run);
      // F: released 200 ms before, then the pipeline
      mapall(run);
      unmapall(run);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      double f = pipeline(run, false);
      unmapall(run);
      // G: released 1 s before, then the pipeline
      std::this_thread::sleep_for(std::chrono::milliseconds(1000));
      double g = pipeline(run, false);
      unmapall(run);
      auto gbs = [&](double t) { return total / t / 1e9; };
      printf(
          "round %d run %4zu MiB: F released 200 ms before %.2f  G released 1 s before %.2f GB/s\n",
          round, run >> 20, gbs(f), gbs(g));
      printf(
          "round %d run %4zu MiB: A old %.2f  B pipeline %.2f  C mapall %.2f ms then copy %.2f "
          "GB/s (total %.2f)  D after 100ms %.2f  E 2 streams %.2f GB/s\n",
          round, run >> 20, gbs(a), gbs(b), cm * 1e3, gbs(c), gbs(cm + c), gbs(d), gbs(e));
      fflush(stdout);
    }
  }
  return 0;
}
