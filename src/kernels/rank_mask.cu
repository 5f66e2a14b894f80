// Shrink mode's mask updates as a kernel, so that they take their place in
// stream order among the calls whose waits read the mask.
#include <cuda_runtime.h>

#include "kernels/launch.hpp"
#include "turnout/error.hpp"

namespace turnout::kernels {
namespace {

__global__ void set_mask_kernel(int32_t* word, int32_t value) {
  atomicExch(word, value);
  __threadfence_system();
}

}  // namespace

void launch_set_mask(int32_t* word, int32_t value, cudaStream_t stream) {
  set_mask_kernel<<<1, 1, 0, stream>>>(word, value);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace turnout::kernels
