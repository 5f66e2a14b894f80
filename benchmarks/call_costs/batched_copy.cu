// Three copies (a rank's rows around its own and its weights) as three
// cudaMemcpyAsync calls against one cudaMemcpyBatchAsync: host time of the
// enqueue and device time of the copies; and whether the runtime takes a batch
// on the legacy default stream, where torch's default stream is. Built with the
// tests (turnout_call_costs_batched_copy).
#include "call_timer.cuh"

int main() {
  size_t rowb = 7168 * 2;
  size_t rows = 16384;
  size_t own0 = 4096, own = 4096;
  char *src, *dst, *w, *wd;
  CHECK(cudaMalloc(&src, rows * rowb));
  CHECK(cudaMalloc(&dst, rows * rowb + 4096));
  CHECK(cudaMalloc(&w, rows * 32));
  CHECK(cudaMalloc(&wd, rows * 32));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  void* dsts[3] = {dst, dst + (own0 + own) * rowb, wd};
  const void* srcs[3] = {src, src + (own0 + own) * rowb, w};
  size_t sizes[3] = {own0 * rowb, (rows - own0 - own) * rowb, rows * 32};
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t idx = 0;
  printf("cudaMemcpyBatchAsync on the legacy default stream: error %d; on the per-thread one: error %d\n",
         static_cast<int>(cudaMemcpyBatchAsync(dsts, srcs, sizes, 3, &attr, &idx, 1, cudaStreamLegacy)),
         static_cast<int>(cudaMemcpyBatchAsync(dsts, srcs, sizes, 3, &attr, &idx, 1, cudaStreamPerThread)));
  CHECK(cudaDeviceSynchronize());
  for (int mode = 0; mode < 4; ++mode)
    for (int rep = 0; rep < 2; ++rep) {
      std::vector<double> host;
      float dev_total = 0;
      for (int it = 0; it < 300; ++it) {
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaEventRecord(e0, s));
        auto t0 = std::chrono::steady_clock::now();
        if (mode == 0) {
          for (int i = 0; i < 3; ++i) CHECK(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDeviceToDevice, s));
        } else if (mode == 1) {
          CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, 3, &attr, &idx, 1, s));
        } else if (mode == 2) {
          CHECK(cudaMemcpyAsync(dsts[0], srcs[0], sizes[0], cudaMemcpyDeviceToDevice, s));
        } else {
          CHECK(cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, &idx, 1, s));
        }
        auto t1 = std::chrono::steady_clock::now();
        CHECK(cudaEventRecord(e1, s));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        if (it >= 20) dev_total += ms;
        if (it >= 20) host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
      std::sort(host.begin(), host.end());
      const char* names[] = {"3 x cudaMemcpyAsync", "1 x cudaMemcpyBatchAsync(3)", "1 x cudaMemcpyAsync",
                             "1 x cudaMemcpyBatchAsync(1)"};
      printf("%-30s host us median %.2f p10 %.2f p90 %.2f | device us mean %.1f\n", names[mode], host[host.size() / 2],
             host[host.size() / 10], host[host.size() * 9 / 10], dev_total * 1000 / 280);
    }
  return 0;
}
