// An op's graph (ops/op_graph.hpp) on one GPU against memcmp: copies of many
// sizes and alignments, each followed by a launch, through one graph that is
// set anew each call. The copy kernel's grid follows the copy's size, so the
// graph must take a new grid when set, not be made again: graphs_made counts.
// A launch before copies makes them wait for it. Prints "N passed, 0
// failed"; exit 1 on any failure. Run by test_op_graph.py.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ops/op_graph.hpp"

namespace {

// Sets bytes [0, n) of p to `value`, slowly enough that a copy not made to
// wait for it would read the bytes before.
__global__ void fill_slowly(unsigned char* p, size_t n, unsigned char value) {
  const long long t0 = clock64();
  while (clock64() - t0 < 200000) {
  }
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

__global__ void bump(int* counter) {
  atomicAdd(counter, 1);
}

int failures = 0, passes = 0;

void expect(bool ok, const std::string& what) {
  if (ok) {
    ++passes;
  } else {
    ++failures;
    std::printf("FAIL %s\n", what.c_str());
  }
}

#define CUDA(x)                                                                    \
  do {                                                                             \
    const cudaError_t e = (x);                                                     \
    if (e != cudaSuccess) {                                                        \
      std::printf("FAIL %s: %s (line %d)\n", #x, cudaGetErrorString(e), __LINE__); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

}  // namespace

int main() {
  const size_t most = (120u << 20) + 64;
  std::vector<unsigned char> pattern(most), back(most);
  for (size_t i = 0; i < most; ++i) pattern[i] = static_cast<unsigned char>(i * 131 + (i >> 13));
  char *src = nullptr, *dst = nullptr;
  int* counter = nullptr;
  CUDA(cudaMalloc(&src, most));
  CUDA(cudaMalloc(&dst, most));
  CUDA(cudaMalloc(&counter, sizeof(int)));
  CUDA(cudaMemcpy(src, pattern.data(), most, cudaMemcpyHostToDevice));
  CUDA(cudaMemset(counter, 0, sizeof(int)));
  cudaStream_t stream;
  CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const turnout::kernels::KernelLaunch bump_launch{reinterpret_cast<const void*>(bump), dim3(1), dim3(1), 0};
  void* bump_args[] = {&counter};

  struct Case {
    size_t bytes, src_at, dst_at;
  };
  // A row of hidden 7168 BF16 is 14336 bytes; 4096 and 8192 such rows are a
  // combine's stage at EP2. Odd sizes and offsets take the byte loop.
  const Case cases[] = {{16, 0, 0},
                        {14336, 0, 0},
                        {4096 * 14336, 16, 32},
                        {1, 0, 0},
                        {1000003, 3, 5},
                        {64 * 14336, 0, 48},
                        {8192 * 14336, 0, 0},
                        {15, 7, 1},
                        {(2u << 20) + 16, 0, 16},
                        {4096 * 14336, 0, 0},
                        {17, 16, 16}};
  turnout::OpGraph one;
  int calls = 0;
  for (const Case& c : cases) {
    CUDA(cudaMemset(dst, 0, most));
    const turnout::GraphStep steps[] = {turnout::GraphStep::copy(dst + c.dst_at, src + c.src_at, c.bytes),
                                        turnout::GraphStep::launch(bump_launch, bump_args)};
    one.enqueue(steps, stream);
    ++calls;
    CUDA(cudaStreamSynchronize(stream));
    CUDA(cudaMemcpy(back.data(), dst, most, cudaMemcpyDeviceToHost));
    const std::string what =
        std::to_string(c.bytes) + " bytes from +" + std::to_string(c.src_at) + " to +" + std::to_string(c.dst_at);
    expect(std::memcmp(back.data() + c.dst_at, pattern.data() + c.src_at, c.bytes) == 0, what + ": copied");
    bool untouched = true;
    for (size_t i = 0; i < c.dst_at; ++i) untouched &= back[i] == 0;
    for (size_t i = c.dst_at + c.bytes; i < std::min(most, c.dst_at + c.bytes + 4096); ++i) untouched &= back[i] == 0;
    expect(untouched, what + ": nothing written around it");
  }
  int launched = 0;
  CUDA(cudaMemcpy(&launched, counter, sizeof(int), cudaMemcpyDeviceToHost));
  expect(launched == calls,
         "every call's launch ran once: " + std::to_string(launched) + " of " + std::to_string(calls));
  expect(one.graphs_made() == 1, "one graph set anew for every size: made " + std::to_string(one.graphs_made()));

  // Two copies side by side, then the launch: a shape of its own, made once.
  turnout::OpGraph two;
  for (size_t half : {size_t{14336}, size_t{3000 * 14336}, size_t{100}}) {
    CUDA(cudaMemset(dst, 0, most));
    const turnout::GraphStep steps[] = {turnout::GraphStep::copy(dst, src, half),
                                        turnout::GraphStep::copy(dst + half + 16, src + half + 16, half),
                                        turnout::GraphStep::launch(bump_launch, bump_args)};
    two.enqueue(steps, stream);
    CUDA(cudaStreamSynchronize(stream));
    CUDA(cudaMemcpy(back.data(), dst, 2 * half + 32, cudaMemcpyDeviceToHost));
    const std::string what = "two copies of " + std::to_string(half) + " bytes";
    expect(std::memcmp(back.data(), pattern.data(), half) == 0 &&
               std::memcmp(back.data() + half + 16, pattern.data() + half + 16, half) == 0,
           what + ": copied");
    bool gap = true;
    for (size_t i = half; i < half + 16; ++i) gap &= back[i] == 0;
    expect(gap, what + ": the 16 bytes between them untouched");
  }
  expect(two.graphs_made() == 1, "two copies: one graph, made " + std::to_string(two.graphs_made()));

  // A launch, then two copies of what it wrote (a landing dispatch's shape):
  // the copies wait for the launch, in each call of the graph.
  turnout::OpGraph after;
  const turnout::kernels::KernelLaunch fill{reinterpret_cast<const void*>(fill_slowly), dim3(132), dim3(256), 0};
  const size_t half = 1000 * 14336;
  for (unsigned char value : {0x5a, 0xa5, 0x3c}) {
    CUDA(cudaMemset(dst, 0, 2 * half + 64));
    unsigned char* target = reinterpret_cast<unsigned char*>(src);
    size_t n = 2 * half + 64;
    void* fill_args[] = {&target, &n, &value};
    const turnout::GraphStep steps[] = {turnout::GraphStep::launch(fill, fill_args),
                                        turnout::GraphStep::copy(dst, src, half),
                                        turnout::GraphStep::copy(dst + half + 64, src + half + 64, half)};
    after.enqueue(steps, stream);
    CUDA(cudaStreamSynchronize(stream));
    CUDA(cudaMemcpy(back.data(), dst, 2 * half + 64, cudaMemcpyDeviceToHost));
    bool filled = true, gap = true;
    for (size_t i = 0; i < half; ++i) filled &= back[i] == value && back[half + 64 + i] == value;
    for (size_t i = half; i < half + 64; ++i) gap &= back[i] == 0;
    expect(filled, "copies after a launch: every byte the launch's value " + std::to_string(value));
    expect(gap, "copies after a launch: the 64 bytes between them untouched");
  }
  expect(after.graphs_made() == 1, "a launch and two copies: one graph, made " + std::to_string(after.graphs_made()));
  CUDA(cudaGetLastError());
  std::printf("%d passed, %d failed\n", passes, failures);
  return failures == 0 ? 0 : 1;
}
