// Host time of one device-to-device copy through each API (runtime and driver,
// into cudaMalloc and VMM memory, a 2D copy) and of a copy kernel's launch
// (runtime and driver), the stream busy; the list `argv[1]` times over (default
// once), so that an entry's place in it can be told from its API. Built with
// the tests (turnout_call_costs_copy_apis).
#include <cuda.h>
#include <cuda_runtime.h>

#include "call_timer.cuh"

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 1;
  size_t bytes = 64 << 20;
  char *src, *dst;
  CHECK(cudaMalloc(&src, bytes));
  CHECK(cudaMalloc(&dst, bytes));
  // VMM memory like a buffer's.
  CUdevice dev;
  CHECK(cuDeviceGet(&dev, 0));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran;
  CHECK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  size_t vb = (bytes + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle h;
  CHECK(cuMemCreate(&h, vb, &prop, 0));
  CUdeviceptr vp;
  CHECK(cuMemAddressReserve(&vp, vb, 0, 0, 0));
  CHECK(cuMemMap(vp, vb, 0, h, 0));
  CUmemAccessDesc acc{};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CHECK(cuMemSetAccess(vp, vb, &acc, 1));
  char* vmm = reinterpret_cast<char*>(vp);
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  size_t n = 4 << 20;
  cudaFunction_t copy_fn;
  CHECK(cudaGetFuncBySymbol(&copy_fn, reinterpret_cast<const void*>(copy_words)));
  const int4* copy_src = reinterpret_cast<const int4*>(src);
  int4* copy_dst = reinterpret_cast<int4*>(dst);
  size_t copy_n = 16;
  void* copy_args[] = {&copy_src, &copy_dst, &copy_n};
  std::vector<std::pair<const char*, std::function<void()>>> tests = {
      {"cudaMemcpyAsync D2D", [&] { CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, s)); }},
      {"cudaMemcpyAsync Default", [&] { CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s)); }},
      {"cuMemcpyDtoDAsync", [&] { CHECK(cuMemcpyDtoDAsync((CUdeviceptr)dst, (CUdeviceptr)src, n, (CUstream)s)); }},
      {"cuMemcpyAsync", [&] { CHECK(cuMemcpyAsync((CUdeviceptr)dst, (CUdeviceptr)src, n, (CUstream)s)); }},
      {"cudaMemcpyAsync D2D into VMM", [&] { CHECK(cudaMemcpyAsync(vmm, src, n, cudaMemcpyDeviceToDevice, s)); }},
      {"cuMemcpyDtoDAsync into VMM", [&] { CHECK(cuMemcpyDtoDAsync(vp, (CUdeviceptr)src, n, (CUstream)s)); }},
      {"cudaMemcpy2DAsync 2 rows",
       [&] { CHECK(cudaMemcpy2DAsync(dst, n, src, n, n / 2, 2, cudaMemcpyDeviceToDevice, s)); }},
      {"copy kernel launch", [&] { copy_words<<<4, 256, 0, s>>>((const int4*)src, (int4*)dst, 16); }},
      {"copy kernel cuLaunchKernel",
       [&] { CHECK(cuLaunchKernel((CUfunction)copy_fn, 4, 1, 1, 256, 1, 1, 0, (CUstream)s, copy_args, nullptr)); }},
  };
  for (int round = 0; round < rounds; ++round) {
    for (auto& [name, fn] : tests) {
      const HostTimes t = time_on_host(s, true, fn);
      printf("%-32s host us median %.2f p10 %.2f p90 %.2f\n", name, t.median, t.p10, t.p90);
    }
  }
  return 0;
}
