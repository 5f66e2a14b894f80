// One FP8 scale of dispatch's input, whatever the scales' strides (DeepGEMM's
// column-major layout among them).
#pragma once

#include <cstdint>

#include "turnout/intranode.hpp"

namespace turnout::kernels {

__device__ __forceinline__ int32_t input_scale(const DispatchArgs& a, int t, int group) {
  return static_cast<const int32_t*>(a.x_scales)[t * a.scale_stride_token + group * a.scale_stride_group];
}

}  // namespace turnout::kernels
