// A device barrier over one NVL domain, as a kernel of its own.
#include <cuda_runtime.h>

#include "kernels/device/nvl_barrier.cuh"
#include "kernels/launch.hpp"
#include "turnout/error.hpp"

namespace turnout::kernels {
namespace {

__global__ void barrier_kernel(void* const* control, int nvl_rank, int num_nvl_ranks, WaitContext ctx) {
  device::nvl_barrier(control, nvl_rank, num_nvl_ranks, ctx);
}

}  // namespace

void launch_barrier(void* const* control, int nvl_rank, int num_nvl_ranks, const WaitContext& ctx,
                    cudaStream_t stream) {
  barrier_kernel<<<1, 32, 0, stream>>>(control, nvl_rank, num_nvl_ranks, ctx);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace turnout::kernels
