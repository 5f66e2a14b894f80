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
// it. Returns false on every thread if some peer never came (recorded).
__device__ __forceinline__ bool nvl_barrier(void* const* control, int nvl_rank, int num_nvl_ranks,
                                            const WaitContext& ctx) {
  __syncthreads();
  auto* self = static_cast<ControlRegion*>(control[nvl_rank]);
  const uint32_t epoch = self->barrier_epoch + 1;
  bool ok = true;
  const int i = threadIdx.x;
  if (i < num_nvl_ranks) {
    auto* peer = static_cast<ControlRegion*>(control[i]);
    __threadfence_system();
    atomic_add_release_sys(&peer->barrier_arrivals[nvl_rank], 1);
    ok = bounded_wait(ctx, ctx.first_nvl_rank + i, WaitSite::kBarrier,
                      [&] { return static_cast<int32_t>(load_acquire_sys(&self->barrier_arrivals[i]) - epoch) >= 0; });
  }
  ok = __syncthreads_and(ok);
  if (i == 0) self->barrier_epoch = epoch;
  __syncthreads();
  return ok;
}

}  // namespace turnout::device
