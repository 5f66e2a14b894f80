// A device-to-device copy by a kernel, for an op's graph (ops/op_graph.hpp):
// in a graph the runtime's memcpy nodes slowed a combine that this kernel
// does not (docs/PERFORMANCE.md).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/launch.hpp"

namespace turnout::kernels {
namespace {

constexpr int kThreads = 512;

__global__ void __launch_bounds__(kThreads) copy_bytes_kernel(const char* src, char* dst, size_t bytes) {
  const size_t thread = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t done = 0;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
    const auto* s = reinterpret_cast<const int4*>(src);
    auto* d = reinterpret_cast<int4*>(dst);
    const size_t words = bytes / 16;
    for (size_t i = thread; i < words; i += threads) d[i] = s[i];
    done = words * 16;
  }
  for (size_t i = done + thread; i < bytes; i += threads) dst[i] = src[i];
}

}  // namespace

KernelLaunch copy_bytes_launch(int num_sms) {
  return {reinterpret_cast<const void*>(copy_bytes_kernel), dim3(2 * num_sms), dim3(kThreads), 0};
}

}  // namespace turnout::kernels
