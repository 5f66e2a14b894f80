// The NVL-domain barrier as a block-level step, so a kernel can meet its peers
// in the middle of its work. Arrival counters only grow and each rank keeps its
// completed-barrier count in device memory: a peer one barrier ahead cannot be
// mistaken for a late one, and nothing depends on a host-side epoch.
#pragma once

#include "kernels/device/bounded_wait.cuh"
#include "runtime/control_region.hpp"

namespace turnout::device {

// Every thread of the block calls it (blockDim.x >= num_nvl_ranks). Writes made
// by any thread of the block before the call are visible to every peer after
// it. Returns false on every thread if some peer never came (recorded). In
// shrink mode (ctx.mask) masked peers are left out and one that never comes is
// masked. A pair counts the barriers it meets in, so a peer that was masked
// and skipped some (asleep, say) is in step again once unmasked.
__device__ __forceinline__ bool nvl_barrier(void* const* control, int nvl_rank, int num_nvl_ranks,
                                            const WaitContext& ctx) {
  __syncthreads();
  auto* self = static_cast<ControlRegion*>(control[nvl_rank]);
  bool ok = true;
  const int i = threadIdx.x;
  if (i < num_nvl_ranks && (i == nvl_rank || !rank_masked(ctx, ctx.first_nvl_rank + i))) {
    const uint32_t epoch = self->barrier_epochs[i] + 1;
    auto* peer = static_cast<ControlRegion*>(control[i]);
    __threadfence_system();
    atomic_add_release_sys(&peer->barrier_arrivals[nvl_rank], 1);
    const bool came = bounded_wait(ctx, ctx.first_nvl_rank + i, WaitSite::kBarrier, [&] {
      return static_cast<int32_t>(load_acquire_sys(&self->barrier_arrivals[i]) - epoch) >= 0;
    });
    // A peer given up on (masked) still got our arrival: the pair stays in step if it ever comes.
    self->barrier_epochs[i] = epoch;
    ok = came || ctx.mask != nullptr;
  }
  ok = __syncthreads_and(ok);
  return ok;
}

}  // namespace turnout::device
