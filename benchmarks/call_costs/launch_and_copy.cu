// Host time of the CUDA calls an op enqueues, each alone, the stream busy behind a
// spin kernel or not: a launch, copies, stream queries, event calls. Built with the
// tests (turnout_call_costs_launch_and_copy); run it on a GPU host, no arguments.
#include "call_timer.cuh"

struct Big {
  char b[1200];
};
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
  CHECK(cudaMalloc(&src, rows * rowb));
  CHECK(cudaMalloc(&dst, rows * rowb));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t ev;
  CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  Big big{};
  std::vector<std::pair<const char*, std::function<void()>>> tests = {
      {"memcpy 50 MB", [&] { CHECK(cudaMemcpyAsync(dst, src, 50 << 20, cudaMemcpyDeviceToDevice, s)); }},
      {"memcpy 512 KB", [&] { CHECK(cudaMemcpyAsync(dst, src, 512 << 10, cudaMemcpyDeviceToDevice, s)); }},
      {"launch, 8 B params, 24 blocks", [&] { small_params<<<24, 768, 0, s>>>(nullptr); }},
      {"launch, 1200 B params, 24 blocks", [&] { big_params<<<24, 768, 0, s>>>(big); }},
      {"launch, 2x1200 B params, 24 blocks", [&] { two_big<<<24, 768, 0, s>>>(big, big); }},
      {"cudaStreamIsCapturing",
       [&] {
         cudaStreamCaptureStatus c;
         CHECK(cudaStreamIsCapturing(s, &c));
       }},
      {"cudaGetLastError", [&] { CHECK(cudaGetLastError()); }},
      {"cudaEventRecord", [&] { CHECK(cudaEventRecord(ev, s)); }},
      {"cudaStreamWaitEvent", [&] { CHECK(cudaStreamWaitEvent(s, ev, 0)); }},
      {"memsetAsync 4 KB", [&] { CHECK(cudaMemsetAsync(dst, 0, 4096, s)); }},
  };
  for (int busy = 0; busy < 2; ++busy)
    for (auto& [name, fn] : tests) {
      const HostTimes t = time_on_host(s, busy, fn);
      printf("%s %-38s host us median %.2f p10 %.2f p90 %.2f\n", busy ? "busy" : "idle", name, t.median, t.p10, t.p90);
    }
  return 0;
}
