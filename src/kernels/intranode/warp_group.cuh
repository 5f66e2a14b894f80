// A block's warps split into one group per rank: the rank a warp serves and
// its place in the group. Warps past the last group (peer >= num_ranks) have
// no rank and sit the channel out.
#pragma once

namespace turnout::kernels {

struct WarpGroup {
  int size;   // warps per group
  int peer;   // the rank this warp's group serves
  int index;  // this warp's place in the group
};

__device__ __forceinline__ WarpGroup warp_group(int num_warps, int num_ranks) {
  const int warp = threadIdx.x / 32, size = num_warps / num_ranks;
  return {size, warp / size, warp % size};
}

// Groups for the ranks other than `self` only, for a sender whose own rank's
// share skips the ring: every warp of the block then serves a link.
__device__ __forceinline__ WarpGroup remote_warp_group(int num_warps, int num_ranks, int self) {
  if (num_ranks == 1) return {num_warps, num_ranks, 0};
  WarpGroup w = warp_group(num_warps, num_ranks - 1);
  if (w.peer >= self) ++w.peer;
  return w;
}

}  // namespace turnout::kernels
