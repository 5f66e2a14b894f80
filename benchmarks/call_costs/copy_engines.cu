// Whether a device-to-device copy needs the GPU's SMs: a kernel holds every
// thread slot of every SM until the host lets it go, and meanwhile a copy on
// another stream either finishes (a copy engine moved it) or waits (a kernel
// moves it). An op that promises to use at most num_sms SMs may only copy in
// a way that does not need them. Each way: cudaMemcpyAsync, a graph's memcpy
// node, a plain copy kernel (which must wait: it shows the hold works), and a
// copy from pinned host memory (which must not: a copy engine's, it shows
// that nothing else holds the copy back).
// Built with the tests (turnout_call_costs_copy_engines); argv[1] megabytes
// (comma-separated; default 2,58).
#include <algorithm>
#include <sstream>
#include <string>
#include <thread>

#include "call_timer.cuh"

namespace {

constexpr int kHoldThreads = 1024;

// Spins until *release is set, or for `cycles` at most so that a lost host
// never hangs the GPU.
__global__ void __launch_bounds__(kHoldThreads) hold(const volatile int* release, long long cycles) {
  const long long t0 = clock64();
  while (*release == 0 && clock64() - t0 < cycles) {
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<size_t> megabytes;
  std::stringstream list(argc > 1 ? argv[1] : "2,58");
  for (std::string item; std::getline(list, item, ',');) megabytes.push_back(std::stoul(item));
  size_t most = 0;
  for (size_t mb : megabytes) most = std::max(most, mb << 20);
  char *src, *dst;
  CHECK(cudaMalloc(&src, most));
  CHECK(cudaMalloc(&dst, most));
  int* release = nullptr;
  CHECK(cudaHostAlloc(&release, sizeof(int), cudaHostAllocMapped));
  cudaStream_t held, other;
  CHECK(cudaStreamCreateWithFlags(&held, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  int sms = 0, per_sm = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, hold, kHoldThreads, 0));
  int max_threads = 0;
  CHECK(cudaDeviceGetAttribute(&max_threads, cudaDevAttrMaxThreadsPerMultiProcessor, 0));
  std::printf("%d SMs, %d holding blocks of %d threads each (of %d thread slots an SM)\n", sms, per_sm, kHoldThreads,
              max_threads);

  cudaGraph_t graph;
  cudaGraphNode_t node;
  cudaGraphExec_t exec;
  CHECK(cudaGraphCreate(&graph, 0));
  CHECK(cudaGraphAddMemcpyNode1D(&node, graph, nullptr, 0, dst, src, most, cudaMemcpyDeviceToDevice));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t done;
  CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));

  char* host = nullptr;
  CHECK(cudaHostAlloc(&host, most, cudaHostAllocDefault));
  const char* names[] = {"cudaMemcpyAsync", "graph memcpy node", "copy kernel", "from pinned host"};
  auto enqueue = [&](int way, size_t bytes) {
    if (way == 0) {
      CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, other));
    } else if (way == 1) {
      CHECK(cudaGraphExecMemcpyNodeSetParams1D(exec, node, dst, src, bytes, cudaMemcpyDeviceToDevice));
      CHECK(cudaGraphLaunch(exec, other));
    } else if (way == 3) {
      CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, other));
    } else {
      copy_words<<<2 * sms, 512, 0, other>>>(reinterpret_cast<const int4*>(src), reinterpret_cast<int4*>(dst),
                                             bytes / 16);
      CHECK(cudaGetLastError());
    }
    CHECK(cudaEventRecord(done, other));
  };
  using Ms = std::chrono::duration<double, std::milli>;
  for (size_t mb : megabytes) {
    const size_t bytes = mb << 20;
    for (int way = 0; way < 4; ++way) {
      // The copy alone, from enqueue to its end as the host sees it (the last of three).
      double alone = 0;
      for (int it = 0; it < 3; ++it) {
        const auto t0 = std::chrono::steady_clock::now();
        enqueue(way, bytes);
        CHECK(cudaEventSynchronize(done));
        alone = Ms(std::chrono::steady_clock::now() - t0).count();
      }
      *reinterpret_cast<volatile int*>(release) = 0;
      int* device_release = nullptr;
      CHECK(cudaHostGetDevicePointer(&device_release, release, 0));
      hold<<<sms * per_sm, kHoldThreads, 0, held>>>(device_release, 2000000000LL);
      CHECK(cudaGetLastError());
      // Give the holding blocks time to take their SMs before the copy is enqueued.
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      enqueue(way, bytes);
      // Twenty times what it took alone, at least 300 ms: a copy engine held back a while still ends.
      const double patience = std::max(300.0, 20 * alone);
      bool finished = false;
      const auto t0 = std::chrono::steady_clock::now();
      while (Ms(std::chrono::steady_clock::now() - t0).count() < patience) {
        const cudaError_t q = cudaEventQuery(done);
        if (q == cudaSuccess) {
          finished = true;
          break;
        }
        if (q != cudaErrorNotReady) CHECK(q);
      }
      const double held_ms = Ms(std::chrono::steady_clock::now() - t0).count();
      const bool hold_running = cudaStreamQuery(held) == cudaErrorNotReady;
      *reinterpret_cast<volatile int*>(release) = 1;
      CHECK(cudaStreamSynchronize(held));
      CHECK(cudaStreamSynchronize(other));
      std::printf("%4zu MB  %-18s  alone %7.3f ms; SMs held: %s after %.1f ms%s\n", mb, names[way], alone,
                  finished ? "finished (needs no SM)" : "still waiting (runs on SMs)", held_ms,
                  hold_running ? "" : "  (the hold had ended: no answer)");
    }
  }
  return 0;
}
