// Device barrier over one NVL domain. Arrival counters only grow, and each
// rank keeps its own completed-barrier count in device memory, so a peer that
// is one barrier ahead cannot be mistaken for a late one and the kernel can be
// captured in a CUDA graph (no host-side epoch).
#include <cuda_runtime.h>

#include "kernels/device/bounded_wait.cuh"
#include "kernels/launch.hpp"
#include "runtime/control_region.hpp"
#include "turnout/error.hpp"

namespace turnout::kernels {
namespace {

__global__ void barrier_kernel(void* const* control, int nvl_rank, int num_nvl_ranks, int first_peer_rank,
                               WaitContext ctx) {
  auto* self = static_cast<ControlRegion*>(control[nvl_rank]);
  const uint32_t epoch = self->barrier_epoch + 1;
  const int i = threadIdx.x;
  if (i < num_nvl_ranks) {
    auto* peer = static_cast<ControlRegion*>(control[i]);
    // Release: everything this rank wrote before the barrier is visible to a
    // peer that sees the arrival.
    __threadfence_system();
    device::atomic_add_release_sys(&peer->barrier_arrivals[nvl_rank], 1);
    device::bounded_wait(ctx, first_peer_rank + i, WaitSite::kBarrier, [&] {
      return static_cast<int32_t>(device::load_acquire_sys(&self->barrier_arrivals[i]) - epoch) >= 0;
    });
  }
  __syncthreads();
  if (i == 0) self->barrier_epoch = epoch;
}

}  // namespace

void launch_barrier(void* const* control, int nvl_rank, int num_nvl_ranks, int first_peer_rank,
                    const WaitContext& ctx, cudaStream_t stream) {
  barrier_kernel<<<1, 32, 0, stream>>>(control, nvl_rank, num_nvl_ranks, first_peer_rank, ctx);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace turnout::kernels
