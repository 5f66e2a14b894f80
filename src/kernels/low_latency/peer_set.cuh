// Sets of the group's ranks as a block sees them, for groups of any size up
// to kMaxGroupRanks: a bitset in shared memory, one bit per rank.
//
// The live set is read from shrink mode's mask once per block and call, so
// that all of a block's sends and waits of a call agree on it. A token's
// destinations are at most its top-k: a lane mask over the top-k slots (the
// first slot naming each destination rank) stands for them.
#pragma once

#include <cstdint>

#include "kernels/device/rank_mask.cuh"
#include "kernels/low_latency/region.hpp"

namespace turnout::kernels::low_latency {

inline constexpr int kRankWords = kMaxGroupRanks / 32;

struct PeerSet {
  const uint32_t* bits;  // shared memory, kRankWords words

  __device__ __forceinline__ bool has(int rank) const { return (bits[rank >> 5] >> (rank & 31) & 1u) != 0; }
};

// Every thread of the block calls it: bit d is set where rank d is this rank
// or is not masked. `bits` holds kRankWords words of shared memory; the
// bitsets of `cleared` (as many words) are zeroed in the same pass, so one
// barrier serves all.
template <class... Cleared>
__device__ __forceinline__ PeerSet block_live_set(const WaitContext& wait, int num_ranks, int self, uint32_t* bits,
                                                  Cleared*... cleared) {
  const int words = (num_ranks + 31) / 32;
  for (int w = static_cast<int>(threadIdx.x); w < kRankWords; w += static_cast<int>(blockDim.x)) {
    ((cleared[w] = 0u), ...);
    const int in_word = min(max(num_ranks - 32 * w, 0), 32);
    uint32_t word = in_word == 32 ? ~0u : (1u << in_word) - 1;
    if (wait.mask != nullptr && w < words) {
      for (int b = 0; b < in_word; ++b) {
        const int d = w * 32 + b;
        if (d != self && device::rank_masked(wait, wait.first_nvl_rank + d)) word &= ~(1u << b);
      }
    }
    bits[w] = word;
  }
  __syncthreads();
  return {bits};
}

__device__ __forceinline__ void set_rank_bit(uint32_t* bits, int rank) {
  atomicOr(bits + (rank >> 5), 1u << (rank & 31));
}

// The lowest set rank of `bits` other than `except`, or -1.
__device__ __forceinline__ int first_rank(const uint32_t* bits, int num_ranks, int except) {
  for (int w = 0; w * 32 < num_ranks; ++w) {
    uint32_t word = bits[w];
    if (except >> 5 == w) word &= ~(1u << (except & 31));
    if (word != 0) return w * 32 + __ffs(static_cast<int>(word)) - 1;
  }
  return -1;
}

// Per lane k < num_topk of a warp: the rank holding `expert` (expert >= 0),
// and the lane mask of the first slot naming each such rank. Warp-wide.
struct TokenRanks {
  int rank;         // this lane's expert's rank, -1 for none
  unsigned firsts;  // bit k: slot k is the first to name its rank
};

__device__ __forceinline__ TokenRanks token_ranks(int expert, int experts_per_rank, int lane) {
  const bool named = expert >= 0;
  const int rank = named ? expert / experts_per_rank : -1;
  const unsigned same = __match_any_sync(~0u, named ? rank : -1 - lane);
  const unsigned firsts = __ballot_sync(~0u, named && (same & ((1u << lane) - 1)) == 0);
  return {rank, firsts};
}

}  // namespace turnout::kernels::low_latency
