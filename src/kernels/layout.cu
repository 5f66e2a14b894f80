// get_dispatch_layout: a group of lanes per token, one lane per top-k slot, so
// a warp reads its rows in coalesced loads and finds repeated experts, ranks
// and RDMA ranks of a token with match instructions instead of loops over the
// row. Counts go to shared memory first so each block adds to the workspace
// once per nonzero counter.
#include <cuda_runtime.h>

#include "kernels/device/error_record.cuh"
#include "kernels/launch.hpp"
#include "turnout/config.hpp"
#include "turnout/error.hpp"

namespace turnout::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kStepsPerWarp = 2;  // token groups one warp takes in turn

// Lanes per token: the top-k rounded up to a power of two, so groups tile a warp.
__host__ __device__ inline int lanes_per_token(int num_topk) {
  int g = 1;
  while (g < num_topk) g *= 2;
  return g;
}

// Out of line: the rare path stays out of the loop's instructions.
__device__ __noinline__ void report_invalid(const LayoutParams& p, int token, int slot, int64_t expert) {
  // Not shared: only this rank knows until its next dispatch tells the peers.
  device::record_error(p.errors, DeviceErrorCode::kInvalidExpert, p.rank, slot, 0, token, expert, false);
}

// True on the lowest lane of those whose `key` matches (lanes with `valid`
// false match nobody and get false): the first slot of a token to name it.
__device__ __forceinline__ bool first_of_its_kind(bool valid, int key, int lane) {
  const unsigned same = __match_any_sync(~0u, valid ? key : -1 - lane);
  return valid && (same & ((1u << lane) - 1)) == 0;
}

__global__ void __launch_bounds__(kThreads) dispatch_layout_kernel(LayoutParams p) {
  extern __shared__ int32_t counts[];  // [experts | ranks | rdma ranks]
  const LayoutArgs& a = p.args;
  const int R = p.num_ranks, E = a.num_experts;
  const int num_rdma_ranks = R / p.num_nvl_ranks;
  const int experts_per_rank = E / R;
  int32_t* s_expert = counts;
  int32_t* s_rank = counts + E;
  int32_t* s_rdma = s_rank + R;
  for (int i = threadIdx.x; i < E + R + num_rdma_ranks; i += kThreads) counts[i] = 0;
  __syncthreads();

  const int lane = threadIdx.x % 32;
  const int group_lanes = lanes_per_token(a.num_topk), tokens_per_step = 32 / group_lanes;
  const int slot = lane % group_lanes, group = lane / group_lanes;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
#pragma unroll 1
  for (int step = 0; step < kStepsPerWarp; ++step) {
    const int first_token = (warp * kStepsPerWarp + step) * tokens_per_step;
    if (first_token >= a.num_tokens) break;  // the same for the whole warp
    const int t = first_token + group;
    const bool live = t < a.num_tokens;
    int64_t e = live && slot < a.num_topk ? __ldg(a.topk_idx + static_cast<int64_t>(t) * a.num_topk + slot) : -1;
    if (e < -1 || e >= E) {
      report_invalid(p, t, slot, e);
      e = -1;
    }
    // Shrink mode: a masked rank's experts get no token.
    if (p.mask != nullptr && e >= 0 && p.mask[e / experts_per_rank] != 0) e = -1;
    const bool valid = e >= 0;
    const int expert = static_cast<int>(e), rank = valid ? expert / experts_per_rank : 0;
    const int rdma = rank / p.num_nvl_ranks;
    // Keys carry the token's group so tokens sharing the warp stay apart.
    if (first_of_its_kind(valid, group * E + expert, lane)) atomicAdd(&s_expert[expert], 1);
    const bool new_rank = first_of_its_kind(valid, group * R + rank, lane);
    if (new_rank) atomicAdd(&s_rank[rank], 1);
    if (first_of_its_kind(valid, group * num_rdma_ranks + rdma, lane)) atomicAdd(&s_rdma[rdma], 1);

    bool* in_rank = a.is_token_in_rank + static_cast<int64_t>(t) * R;
    if (live)
      for (int r = slot; r < R; r += group_lanes) in_rank[r] = false;
    __syncwarp();  // the clears land before the sets
    if (new_rank) in_rank[rank] = true;
  }
  __syncthreads();

  // Block totals into the workspace; the last block to finish copies them out
  // and zeroes the workspace for the next call.
  const int num_counters = E + R + num_rdma_ranks;
  int32_t* totals = p.workspace;
  int32_t* finished = p.workspace + num_counters;
  for (int i = threadIdx.x; i < num_counters; i += kThreads)
    if (counts[i]) atomicAdd(&totals[i], counts[i]);
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(finished, 1) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = threadIdx.x; i < num_counters; i += kThreads) {
    const int32_t n = __ldcg(&totals[i]);
    totals[i] = 0;
    if (i < E)
      a.num_tokens_per_expert[i] = n;
    else if (i < E + R)
      a.num_tokens_per_rank[i - E] = n;
    else if (a.num_tokens_per_rdma_rank)
      a.num_tokens_per_rdma_rank[i - E - R] = n;
  }
  if (threadIdx.x == 0) *finished = 0;
}

}  // namespace

void launch_dispatch_layout(const LayoutParams& p, cudaStream_t stream) {
  const LayoutArgs& a = p.args;
  const int num_rdma_ranks = p.num_ranks / p.num_nvl_ranks;
  // At least one block, so the counts of zero tokens are written too.
  const int tokens_per_block = kWarps * kStepsPerWarp * (32 / lanes_per_token(a.num_topk));
  const int blocks = a.num_tokens > 0 ? (a.num_tokens + tokens_per_block - 1) / tokens_per_block : 1;
  const size_t smem = (a.num_experts + p.num_ranks + num_rdma_ranks) * sizeof(int32_t);
  dispatch_layout_kernel<<<blocks, kThreads, smem, stream>>>(p);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace turnout::kernels
