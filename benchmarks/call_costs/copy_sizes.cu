// Device time of one device-to-device copy of a combine's rows (hidden 7168,
// BF16: 14336 bytes a row) by row count: cudaMemcpyAsync, the same copy as a
// graph's memcpy node (set anew each call, as an op's graph does), and a
// plain copy kernel (16-byte words, every SM), eager and as a graph's kernel
// node; then the kernel with four words a lane in flight, on the 24 or 12
// SMs an op's config allows, and in one pass of as many blocks as the words
// need (plain or streaming loads and stores). Whether the runtime's copies
// need SMs at all: copy_engines.
// Built with the tests (turnout_call_costs_copy_sizes); argv[1] row counts
// (comma-separated, at most 8192; default a sweep).
#include <cstdlib>
#include <sstream>
#include <string>

#include "call_timer.cuh"

// Four words a lane loaded before any is stored.
__global__ void copy_four_words(const int4* __restrict__ src, int4* __restrict__ dst, size_t words) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < words; i += 4 * stride) {
    int4 w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = src[i + k * stride];
#pragma unroll
    for (int k = 0; k < 4; ++k) dst[i + k * stride] = w[k];
  }
  for (; i < words; i += stride) dst[i] = src[i];
}

// One pass: as many blocks as cover every word, four words a lane, with
// streaming (evict-first) loads and stores where `streaming`.
template <bool streaming>
__global__ void copy_one_pass(const int4* __restrict__ src, int4* __restrict__ dst, size_t words) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  int4 w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (i + k * stride < words) w[k] = streaming ? __ldcs(src + i + k * stride) : src[i + k * stride];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    if (i + k * stride < words) {
      if (streaming)
        __stcs(dst + i + k * stride, w[k]);
      else
        dst[i + k * stride] = w[k];
    }
}

int main(int argc, char** argv) {
  std::vector<size_t> row_counts;
  std::stringstream list(argc > 1 ? argv[1] : "64,128,512,1000,1024,2000,2048,3000,4080,4096,4200,6000,8160,8192");
  for (std::string item; std::getline(list, item, ',');) row_counts.push_back(std::stoul(item));
  const size_t row_bytes = 7168 * 2, most = 8192 * row_bytes;
  char *src, *dst;
  CHECK(cudaMalloc(&src, most));
  CHECK(cudaMalloc(&dst, most));
  CHECK(cudaMemset(src, 1, most));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const dim3 grid(sms * 2), block(512);

  // One graph per way, made with the largest copy and set to each size.
  cudaGraph_t copy_graph, kernel_graph;
  cudaGraphNode_t copy_node, kernel_node;
  CHECK(cudaGraphCreate(&copy_graph, 0));
  CHECK(cudaGraphAddMemcpyNode1D(&copy_node, copy_graph, nullptr, 0, dst, src, most, cudaMemcpyDeviceToDevice));
  const int4* words_src = reinterpret_cast<const int4*>(src);
  int4* words_dst = reinterpret_cast<int4*>(dst);
  size_t words = most / 16;
  void* args[] = {&words_src, &words_dst, &words};
  cudaKernelNodeParams kernel{};
  kernel.func = reinterpret_cast<void*>(copy_words);
  kernel.gridDim = grid;
  kernel.blockDim = block;
  kernel.kernelParams = args;
  CHECK(cudaGraphCreate(&kernel_graph, 0));
  CHECK(cudaGraphAddKernelNode(&kernel_node, kernel_graph, nullptr, 0, &kernel));
  cudaGraphExec_t copy_exec, kernel_exec;
  CHECK(cudaGraphInstantiate(&copy_exec, copy_graph, 0));
  CHECK(cudaGraphInstantiate(&kernel_exec, kernel_graph, 0));

  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const char* names[] = {"cudaMemcpyAsync",  "graph memcpy node", "copy kernel", "graph copy kernel",  "4 words a lane",
                         "kernel on 24 SMs", "kernel on 12 SMs",  "one pass",    "one pass, streaming"};
  const int ways = 9;
  std::printf("%-8s %-12s", "rows", "MB");
  for (const char* n : names) std::printf(" | %22s", n);
  std::printf("   (device us, median of 50; GB/s read)\n");
  for (size_t rows : row_counts) {
    const size_t bytes = std::min(rows, static_cast<size_t>(8192)) * row_bytes;
    words = bytes / 16;
    std::printf("%-8zu %-12.2f", rows, bytes / 1e6);
    for (int way = 0; way < ways; ++way) {
      std::vector<float> us;
      for (int it = 0; it < 60; ++it) {
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaEventRecord(e0, s));
        if (way == 0) {
          CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
        } else if (way == 1) {
          CHECK(cudaGraphExecMemcpyNodeSetParams1D(copy_exec, copy_node, dst, src, bytes, cudaMemcpyDeviceToDevice));
          CHECK(cudaGraphLaunch(copy_exec, s));
        } else if (way == 2) {
          copy_words<<<grid, block, 0, s>>>(words_src, words_dst, words);
        } else if (way == 3) {
          CHECK(cudaGraphExecKernelNodeSetParams(kernel_exec, kernel_node, &kernel));
          CHECK(cudaGraphLaunch(kernel_exec, s));
        } else if (way == 4) {
          copy_four_words<<<grid, block, 0, s>>>(words_src, words_dst, words);
        } else if (way <= 6) {
          // Two blocks an SM, as the op's num_sms would allow.
          copy_words<<<way == 5 ? 48 : 24, 1024, 0, s>>>(words_src, words_dst, words);
        } else {
          const unsigned blocks = static_cast<unsigned>((words + 4 * 256 - 1) / (4 * 256));
          if (way == 7)
            copy_one_pass<false><<<blocks, 256, 0, s>>>(words_src, words_dst, words);
          else
            copy_one_pass<true><<<blocks, 256, 0, s>>>(words_src, words_dst, words);
        }
        CHECK(cudaEventRecord(e1, s));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= 10) us.push_back(ms * 1000);
      }
      std::sort(us.begin(), us.end());
      const float median = us[us.size() / 2];
      std::printf(" | %9.1f us %6.0f GB/s", median, bytes / (median * 1e3));
    }
    std::printf("\n");
  }
  return 0;
}
