// get_dispatch_layout: one thread per token. Counts go to shared memory first
// so each block adds to global memory once per nonzero counter.
#include <cuda_runtime.h>

#include "kernels/device/error_record.cuh"
#include "kernels/launch.hpp"
#include "turnout/config.hpp"
#include "turnout/error.hpp"

namespace turnout::kernels {
namespace {

// Small blocks: each thread walks one token serially, so more blocks in flight
// hide more of that latency.
constexpr int kThreads = 64;

__global__ void __launch_bounds__(kThreads) dispatch_layout_kernel(LayoutParams p) {
  extern __shared__ int32_t counts[];  // [experts | ranks | rdma ranks]
  const LayoutArgs& a = p.args;
  const int num_rdma_ranks = p.num_ranks / p.num_nvl_ranks;
  const int experts_per_rank = a.num_experts / p.num_ranks;
  int32_t* s_expert = counts;
  int32_t* s_rank = counts + a.num_experts;
  int32_t* s_rdma = s_rank + p.num_ranks;
  const int num_counters = a.num_experts + p.num_ranks + num_rdma_ranks;
  for (int i = threadIdx.x; i < num_counters; i += kThreads) counts[i] = 0;
  __syncthreads();

  const int t = blockIdx.x * kThreads + threadIdx.x;
  if (t < a.num_tokens) {
    const int64_t* row = a.topk_idx + static_cast<int64_t>(t) * a.num_topk;
    bool* in_rank = a.is_token_in_rank + static_cast<int64_t>(t) * p.num_ranks;
    for (int r = 0; r < p.num_ranks; ++r) in_rank[r] = false;
    // The row in registers first, every load in flight at once: the walk
    // below would otherwise wait out one memory round trip per slot.
    int64_t ids[kMaxTopk];
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) ids[k] = k < a.num_topk ? __ldg(row + k) : -1;
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      const int64_t e = ids[k];
      if (e == -1) continue;
      if (e < -1 || e >= a.num_experts) {
        device::record_error(p.errors, DeviceErrorCode::kInvalidExpert, p.rank, k, 0, t, e);
        continue;
      }
      const int rank = static_cast<int>(e) / experts_per_rank;
      const int rdma = rank / p.num_nvl_ranks;
      // A token counts once per distinct expert, rank and RDMA rank: compare
      // with the earlier valid slots of the same row (top-k is short).
      bool new_expert = true, new_rank = true, new_rdma = true;
#pragma unroll
      for (int j = 0; j < k; ++j) {
        const int64_t f = ids[j];
        if (f < 0 || f >= a.num_experts) continue;
        const int frank = static_cast<int>(f) / experts_per_rank;
        new_expert &= f != e;
        new_rank &= frank != rank;
        new_rdma &= frank / p.num_nvl_ranks != rdma;
      }
      if (new_expert) atomicAdd(&s_expert[e], 1);
      if (new_rank) {
        atomicAdd(&s_rank[rank], 1);
        in_rank[rank] = true;
      }
      if (new_rdma) atomicAdd(&s_rdma[rdma], 1);
    }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < a.num_experts; i += kThreads)
    if (s_expert[i]) atomicAdd(&a.num_tokens_per_expert[i], s_expert[i]);
  for (int i = threadIdx.x; i < p.num_ranks; i += kThreads)
    if (s_rank[i]) atomicAdd(&a.num_tokens_per_rank[i], s_rank[i]);
  if (a.num_tokens_per_rdma_rank)
    for (int i = threadIdx.x; i < num_rdma_ranks; i += kThreads)
      if (s_rdma[i]) atomicAdd(&a.num_tokens_per_rdma_rank[i], s_rdma[i]);
}

}  // namespace

void launch_dispatch_layout(const LayoutParams& p, cudaStream_t stream) {
  const LayoutArgs& a = p.args;
  const int num_rdma_ranks = p.num_ranks / p.num_nvl_ranks;
  // Counters are accumulated with atomics, so they start at zero. The three
  // arrays are usually one allocation (the Python layer makes them so).
  int32_t* first = a.num_tokens_per_rank;
  const bool contiguous = a.num_tokens_per_rdma_rank
                              ? a.num_tokens_per_rdma_rank == first + p.num_ranks &&
                                    a.num_tokens_per_expert == a.num_tokens_per_rdma_rank + num_rdma_ranks
                              : a.num_tokens_per_expert == first + p.num_ranks;
  if (contiguous) {
    const size_t n = p.num_ranks + (a.num_tokens_per_rdma_rank ? num_rdma_ranks : 0) + a.num_experts;
    TURNOUT_CUDA_CHECK(cudaMemsetAsync(first, 0, n * sizeof(int32_t), stream));
  } else {
    TURNOUT_CUDA_CHECK(cudaMemsetAsync(a.num_tokens_per_rank, 0, p.num_ranks * sizeof(int32_t), stream));
    if (a.num_tokens_per_rdma_rank)
      TURNOUT_CUDA_CHECK(cudaMemsetAsync(a.num_tokens_per_rdma_rank, 0, num_rdma_ranks * sizeof(int32_t), stream));
    TURNOUT_CUDA_CHECK(cudaMemsetAsync(a.num_tokens_per_expert, 0, a.num_experts * sizeof(int32_t), stream));
  }
  if (a.num_tokens == 0) return;
  const int blocks = (a.num_tokens + kThreads - 1) / kThreads;
  const size_t smem = (a.num_experts + p.num_ranks + num_rdma_ranks) * sizeof(int32_t);
  dispatch_layout_kernel<<<blocks, kThreads, smem, stream>>>(p);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace turnout::kernels
