// A kernel launched from its description (launch.hpp): the same launch as
// `kernel<<<grid, block, shared, stream>>>(args...)`.
#include <cuda_runtime.h>

#include "kernels/launch.hpp"
#include "turnout/error.hpp"

namespace turnout::kernels {

void launch(const KernelLaunch& k, void** args, cudaStream_t stream) {
  TURNOUT_CUDA_CHECK(cudaLaunchKernel(k.func, k.grid, k.block, args, k.shared_bytes, stream));
}

}  // namespace turnout::kernels
