// Programmatic dependent launch (sm_90 and later). A kernel launched by
// launch_dependent may have its blocks placed on the SMs while the kernel
// before it on the stream is still finishing, instead of after that kernel
// has drained; before it reads anything an earlier kernel wrote it calls
// wait_for_prior_grids, which returns once those kernels are complete and
// their writes visible (at once where the launch had no such dependency).
// A kernel that calls allow_dependents early lets the next one's launch
// begin before its own blocks end.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "turnout/error.hpp"

namespace turnout::device {

__device__ __forceinline__ void wait_for_prior_grids() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

__device__ __forceinline__ void allow_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), int blocks, int threads, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  TURNOUT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace turnout::device
