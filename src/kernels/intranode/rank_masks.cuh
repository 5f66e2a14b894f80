// Which of 32 consecutive tokens go to which rank, as one ballot a rank: the
// walk of the kernels that hand a window's tokens to their warps.
#pragma once

#include <cstdint>

namespace turnout::kernels {

// masks[j] bit i: token base + i (below end) goes to rank j. Warp-wide.
template <int kRows>
__device__ __forceinline__ void rank_masks(const bool* is_token_in_rank, int num_ranks, int base, int end, int lane,
                                           uint32_t (&masks)[kRows]) {
  const int t = base + lane;
#pragma unroll
  for (int j = 0; j < kRows; ++j)
    masks[j] =
        j < num_ranks ? __ballot_sync(~0u, t < end && is_token_in_rank[static_cast<int64_t>(t) * num_ranks + j]) : 0;
}

}  // namespace turnout::kernels
