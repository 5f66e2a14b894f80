// Host time of the CUDA calls an op enqueues, each alone, the stream busy behind a
// spin kernel or not: a launch, copies, stream queries, event calls. Built with the
// tests (turnout_call_costs_launch_and_copy); run it on a GPU host, no arguments.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>
#define CK(x)                                        \
  do {                                               \
    cudaError_t e = (x);                             \
    if (e != cudaSuccess) {                          \
      printf("%s: %s\n", #x, cudaGetErrorString(e)); \
      exit(1);                                       \
    }                                                \
  } while (0)
struct Big {
  char b[1200];
};
__global__ void spin(long long ns) {
  long long t0 = clock64();
  while (clock64() - t0 < ns) {
  }
}
__global__ void small_params(int* p) {
  if (p && threadIdx.x == 9999) *p = 1;
}
__global__ void big_params(const __grid_constant__ Big b) {
  if (threadIdx.x == 9999) printf("%d", b.b[0]);
}
__global__ void two_big(const __grid_constant__ Big a, const __grid_constant__ Big b) {
  if (threadIdx.x == 9999) printf("%d", a.b[0] + b.b[1]);
}
int main() {
  size_t rowb = 7168 * 2;
  size_t rows = 16384;
  char *src, *dst;
  CK(cudaMalloc(&src, rows * rowb));
  CK(cudaMalloc(&dst, rows * rowb));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t ev;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  Big big{};
  std::vector<std::pair<const char*, std::function<void()>>> tests = {
      {"memcpy 50 MB", [&] { CK(cudaMemcpyAsync(dst, src, 50 << 20, cudaMemcpyDeviceToDevice, s)); }},
      {"memcpy 512 KB", [&] { CK(cudaMemcpyAsync(dst, src, 512 << 10, cudaMemcpyDeviceToDevice, s)); }},
      {"launch, 8 B params, 24 blocks", [&] { small_params<<<24, 768, 0, s>>>(nullptr); }},
      {"launch, 1200 B params, 24 blocks", [&] { big_params<<<24, 768, 0, s>>>(big); }},
      {"launch, 2x1200 B params, 24 blocks", [&] { two_big<<<24, 768, 0, s>>>(big, big); }},
      {"cudaStreamIsCapturing",
       [&] {
         cudaStreamCaptureStatus c;
         CK(cudaStreamIsCapturing(s, &c));
       }},
      {"cudaGetLastError", [&] { CK(cudaGetLastError()); }},
      {"cudaEventRecord", [&] { CK(cudaEventRecord(ev, s)); }},
      {"cudaStreamWaitEvent", [&] { CK(cudaStreamWaitEvent(s, ev, 0)); }},
      {"memsetAsync 4 KB", [&] { CK(cudaMemsetAsync(dst, 0, 4096, s)); }},
  };
  for (int busy = 0; busy < 2; ++busy)
    for (auto& [name, fn] : tests) {
      std::vector<double> host;
      for (int it = 0; it < 400; ++it) {
        if (it % 20 == 0) {
          CK(cudaStreamSynchronize(s));
          if (busy) spin<<<1, 32, 0, s>>>(2000000);
        }
        auto t0 = std::chrono::steady_clock::now();
        fn();
        auto t1 = std::chrono::steady_clock::now();
        if (it % 20 != 0) host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
      CK(cudaStreamSynchronize(s));
      std::sort(host.begin(), host.end());
      printf("%s %-38s host us median %.2f p10 %.2f p90 %.2f\n", busy ? "busy" : "idle", name, host[host.size() / 2],
             host[host.size() / 10], host[host.size() * 9 / 10]);
    }
  return 0;
}
