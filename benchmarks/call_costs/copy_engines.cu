// Whether a device-to-device copy needs the GPU's SMs: a kernel holds every
// thread slot of every SM until the host lets it go, and meanwhile a copy on
// another stream either finishes (a copy engine moved it) or waits (a kernel
// moves it). An op that promises to use at most num_sms SMs may only copy in
// a way that does not need them. Each way: cudaMemcpyAsync, a graph's memcpy
// node, and a plain copy kernel (which must wait: it shows the hold works).
// Built with the tests (turnout_call_costs_copy_engines); argv[1] megabytes
// (comma-separated; default 2,58).
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

__global__ void copy_words(const int4* __restrict__ src, int4* __restrict__ dst, size_t words) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
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

  const char* names[] = {"cudaMemcpyAsync", "graph memcpy node", "copy kernel"};
  for (size_t mb : megabytes) {
    const size_t bytes = mb << 20;
    for (int way = 0; way < 3; ++way) {
      *reinterpret_cast<volatile int*>(release) = 0;
      int* device_release = nullptr;
      CHECK(cudaHostGetDevicePointer(&device_release, release, 0));
      hold<<<sms * per_sm, kHoldThreads, 0, held>>>(device_release, 2000000000LL);
      CHECK(cudaGetLastError());
      // Give the holding blocks time to take their SMs before the copy is enqueued.
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      if (way == 0) {
        CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, other));
      } else if (way == 1) {
        CHECK(cudaGraphExecMemcpyNodeSetParams1D(exec, node, dst, src, bytes, cudaMemcpyDeviceToDevice));
        CHECK(cudaGraphLaunch(exec, other));
      } else {
        copy_words<<<2 * sms, 512, 0, other>>>(reinterpret_cast<const int4*>(src), reinterpret_cast<int4*>(dst),
                                               bytes / 16);
        CHECK(cudaGetLastError());
      }
      CHECK(cudaEventRecord(done, other));
      // A copy engine moves 58 MB in well under 1 ms; wait 20 ms.
      bool finished = false;
      const auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(20)) {
        const cudaError_t q = cudaEventQuery(done);
        if (q == cudaSuccess) {
          finished = true;
          break;
        }
        if (q != cudaErrorNotReady) CHECK(q);
      }
      const bool hold_running = cudaStreamQuery(held) == cudaErrorNotReady;
      *reinterpret_cast<volatile int*>(release) = 1;
      CHECK(cudaStreamSynchronize(held));
      CHECK(cudaStreamSynchronize(other));
      std::printf("%4zu MB  %-18s  %s%s\n", mb, names[way],
                  finished ? "finished while every SM was held: needs no SM" : "waited for the SMs: runs on SMs",
                  hold_running ? "" : "  (the hold had ended: no answer)");
    }
  }
  return 0;
}
