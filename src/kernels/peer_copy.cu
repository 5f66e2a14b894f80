// Plain 16-byte SM copies to and from peers' buffers over NVLink: the peer
// memory test and the bench's NVLink ceiling.
#include <cuda_runtime.h>

#include "kernels/launch.hpp"
#include "turnout/error.hpp"

namespace turnout::kernels {
namespace {

constexpr int kThreads = 512;

__global__ void __launch_bounds__(kThreads)
    store_to_peers_kernel(void* const* peers, int nvl_rank, int num_nvl_ranks, const int4* src, size_t n16,
                          size_t dst_offset, bool include_self) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  const size_t dst_index = (dst_offset + nvl_rank * n16 * sizeof(int4)) / sizeof(int4);
  for (size_t i = blockIdx.x * static_cast<size_t>(kThreads) + threadIdx.x; i < n16; i += stride) {
    const int4 v = __ldg(src + i);
    // Start at the next peer so ranks do not all hit peer 0 first.
    for (int s = 1; s <= num_nvl_ranks; ++s) {
      const int p = (nvl_rank + s) % num_nvl_ranks;
      if (p == nvl_rank && !include_self) continue;
      static_cast<int4*>(peers[p])[dst_index + i] = v;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    load_from_peers_kernel(void* const* peers, int num_nvl_ranks, int4* dst, size_t n16, size_t src_offset) {
  const size_t stride = static_cast<size_t>(gridDim.x) * kThreads;
  const size_t src_index = src_offset / sizeof(int4);
  for (size_t i = blockIdx.x * static_cast<size_t>(kThreads) + threadIdx.x; i < n16; i += stride)
    for (int p = 0; p < num_nvl_ranks; ++p)
      // Another GPU wrote this: bypass the (non-coherent) L1.
      dst[p * n16 + i] = __ldcv(static_cast<const int4*>(peers[p]) + src_index + i);
}

}  // namespace

void launch_store_to_peers(void* const* peers, int nvl_rank, int num_nvl_ranks, const void* src, size_t bytes,
                           size_t dst_offset, bool include_self, int num_sms, cudaStream_t stream) {
  if (bytes == 0) return;
  store_to_peers_kernel<<<num_sms, kThreads, 0, stream>>>(peers, nvl_rank, num_nvl_ranks, static_cast<const int4*>(src),
                                                          bytes / sizeof(int4), dst_offset, include_self);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

void launch_load_from_peers(void* const* peers, int num_nvl_ranks, void* dst, size_t bytes, size_t src_offset,
                            int num_sms, cudaStream_t stream) {
  if (bytes == 0) return;
  load_from_peers_kernel<<<num_sms, kThreads, 0, stream>>>(peers, num_nvl_ranks, static_cast<int4*>(dst),
                                                           bytes / sizeof(int4), src_offset);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace turnout::kernels
