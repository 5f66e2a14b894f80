// Shrink mode's rank mask as kernels see it (WaitContext::mask): masked ranks
// are neither sent to nor waited for.
#pragma once

#include <cstdint>

#include "kernels/device/memory_order.cuh"
#include "kernels/wait_context.hpp"

namespace turnout::device {

using kernels::WaitContext;

__device__ __forceinline__ bool rank_masked(const WaitContext& ctx, int rank) {
  return ctx.mask != nullptr && load_acquire_sys(ctx.mask + rank) != 0;
}

// Bit i: NVL peer i is not masked (every bit without shrink mode). `self`
// always counts as live: a rank never stops waiting for its own blocks.
__device__ __forceinline__ uint32_t live_peers(const WaitContext& ctx, int num_peers, int self) {
  const uint32_t all = num_peers >= 32 ? ~0u : (1u << num_peers) - 1;
  if (ctx.mask == nullptr) return all;
  uint32_t live = 0;
  for (int i = 0; i < num_peers; ++i)
    if (i == self || load_acquire_sys(ctx.mask + ctx.first_nvl_rank + i) == 0) live |= 1u << i;
  return live;
}

// Masks `rank` (a wait gave up on it).
__device__ __forceinline__ void mask_rank(const WaitContext& ctx, int rank) {
  atomicExch(ctx.mask + rank, 1);
  __threadfence_system();
}

// Blocks of one call may judge a peer differently (one gives up on it just
// as another sees it arrive): the first verdict of call `seq` holds for all.
// `verdict` holds seq * 2 + included of the last call that judged.
__device__ __forceinline__ bool agree_on_peer(uint32_t* verdict, uint32_t seq, bool included) {
  const uint32_t tag = seq & 0x7fffffffu;
  const uint32_t mine = tag << 1 | (included ? 1u : 0u);
  uint32_t seen = *static_cast<volatile uint32_t*>(verdict);
  while ((seen >> 1) != tag) {
    const uint32_t old = atomicCAS(verdict, seen, mine);
    if (old == seen) return included;
    seen = old;
  }
  return (seen & 1u) != 0;
}

}  // namespace turnout::device
