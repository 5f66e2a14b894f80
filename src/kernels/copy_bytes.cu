// A device-to-device copy by a kernel, for an op's graph (ops/op_graph.hpp):
// in a graph the runtime's memcpy nodes slowed a combine that this kernel
// does not (docs/PERFORMANCE.md). One pass of four words a lane, loaded
// before any is stored: 3 us less than a grid-stride loop of one word at a
// time on 58 MB (benchmarks/call_costs/copy_sizes).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/launch.hpp"

namespace turnout::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWordsPerLane = 4;

__global__ void __launch_bounds__(kThreads) copy_bytes_kernel(const char* src, char* dst, size_t bytes) {
  const size_t lanes = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t lane = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  size_t done = 0;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const auto* s = reinterpret_cast<const int4*>(src);
    auto* d = reinterpret_cast<int4*>(dst);
    const size_t words = bytes / 16;  // at most lanes * kWordsPerLane (copy_bytes_launch)
    int4 w[kWordsPerLane];
#pragma unroll
    for (int k = 0; k < kWordsPerLane; ++k)
      if (lane + k * lanes < words) w[k] = s[lane + k * lanes];
#pragma unroll
    for (int k = 0; k < kWordsPerLane; ++k)
      if (lane + k * lanes < words) d[lane + k * lanes] = w[k];
    done = words * 16;
  }
  for (size_t i = done + lane; i < bytes; i += lanes) dst[i] = src[i];
}

}  // namespace

KernelLaunch copy_bytes_launch(size_t bytes) {
  const size_t per_block = static_cast<size_t>(kThreads) * kWordsPerLane * 16;
  const size_t blocks = std::max<size_t>(1, (bytes + per_block - 1) / per_block);
  return {reinterpret_cast<const void*>(copy_bytes_kernel), dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0};
}

}  // namespace turnout::kernels
