// Host time of one device-to-device copy through each API (runtime and driver,
// into cudaMalloc and VMM memory, a 2D copy) and of a copy kernel's launch, the
// stream busy. Built with the tests (turnout_call_costs_copy_apis).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>
#define CK(x)                         \
  do {                                \
    auto e = (x);                     \
    if (e != 0) {                     \
      printf("%s: %d\n", #x, (int)e); \
      exit(1);                        \
    }                                 \
  } while (0)
__global__ void spin(long long ns) {
  long long t0 = clock64();
  while (clock64() - t0 < ns) {
  }
}
__global__ void copy16(const int4* __restrict__ s, int4* __restrict__ d, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    d[i] = s[i];
}
int main() {
  size_t bytes = 64 << 20;
  char *src, *dst;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  // VMM memory like a buffer's.
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran;
  CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  size_t vb = (bytes + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle h;
  CK(cuMemCreate(&h, vb, &prop, 0));
  CUdeviceptr vp;
  CK(cuMemAddressReserve(&vp, vb, 0, 0, 0));
  CK(cuMemMap(vp, vb, 0, h, 0));
  CUmemAccessDesc acc{};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(vp, vb, &acc, 1));
  char* vmm = reinterpret_cast<char*>(vp);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  size_t n = 4 << 20;
  std::vector<std::pair<const char*, std::function<void()>>> tests = {
      {"cudaMemcpyAsync D2D", [&] { CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s)); }},
      {"cudaMemcpyAsync Default", [&] { CK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s)); }},
      {"cuMemcpyDtoDAsync", [&] { CK(cuMemcpyDtoDAsync((CUdeviceptr)dst, (CUdeviceptr)src, n, (CUstream)s)); }},
      {"cuMemcpyAsync", [&] { CK(cuMemcpyAsync((CUdeviceptr)dst, (CUdeviceptr)src, n, (CUstream)s)); }},
      {"cudaMemcpyAsync D2D into VMM", [&] { CK(cudaMemcpyAsync(vmm, src, n, cudaMemcpyDeviceToDevice, s)); }},
      {"cuMemcpyDtoDAsync into VMM", [&] { CK(cuMemcpyDtoDAsync(vp, (CUdeviceptr)src, n, (CUstream)s)); }},
      {"cudaMemcpy2DAsync 2 rows",
       [&] { CK(cudaMemcpy2DAsync(dst, n, src, n, n / 2, 2, cudaMemcpyDeviceToDevice, s)); }},
      {"copy kernel launch", [&] { copy16<<<4, 256, 0, s>>>((const int4*)src, (int4*)dst, 16); }},
  };
  for (auto& [name, fn] : tests) {
    std::vector<double> host;
    for (int it = 0; it < 400; ++it) {
      if (it % 20 == 0) {
        CK(cudaStreamSynchronize(s));
        spin<<<1, 32, 0, s>>>(2000000);
      }
      auto t0 = std::chrono::steady_clock::now();
      fn();
      auto t1 = std::chrono::steady_clock::now();
      if (it % 20 != 0) host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    CK(cudaStreamSynchronize(s));
    std::sort(host.begin(), host.end());
    printf("%-32s host us median %.2f p10 %.2f p90 %.2f\n", name, host[host.size() / 2], host[host.size() / 10],
           host[host.size() * 9 / 10]);
  }
  return 0;
}
