// What the call-cost programs share: a check that ends the program on a CUDA
// error, a kernel that keeps a stream busy, a plain copy kernel, a kernel with
// an op's parameters, and the host-side timing loop.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

// Runtime and driver calls alike: both return 0 on success.
#define CHECK(x)                                                   \
  do {                                                             \
    const auto e = (x);                                            \
    if (static_cast<int>(e) != 0) {                                \
      std::printf("%s: CUDA error %d\n", #x, static_cast<int>(e)); \
      std::exit(1);                                                \
    }                                                              \
  } while (0)

__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// 16-byte words from src to dst, a grid-stride loop.
__global__ void copy_words(const int4* __restrict__ src, int4* __restrict__ dst, size_t words) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<size_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// The size of the combine kernel's parameters, about.
struct OpParams {
  char bytes[1200];
};
__global__ void op_kernel(const __grid_constant__ OpParams p) {
  if (threadIdx.x == 9999) printf("%d", p.bytes[0]);
}

struct HostTimes {
  double median, p10, p90;  // microseconds
};

// Host time of `call`, 400 calls each alone between two clock reads. Every
// 20th call the stream drains first (that call is not counted) and, when
// `busy`, gets a spin kernel of 2M cycles ahead of the next ones.
inline HostTimes time_on_host(cudaStream_t stream, bool busy, const std::function<void()>& call) {
  std::vector<double> host;
  for (int it = 0; it < 400; ++it) {
    if (it % 20 == 0) {
      CHECK(cudaStreamSynchronize(stream));
      if (busy) spin<<<1, 32, 0, stream>>>(2000000);
    }
    const auto t0 = std::chrono::steady_clock::now();
    call();
    const auto t1 = std::chrono::steady_clock::now();
    if (it % 20 != 0) host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  CHECK(cudaStreamSynchronize(stream));
  std::sort(host.begin(), host.end());
  return {host[host.size() / 2], host[host.size() / 10], host[host.size() * 9 / 10]};
}
