// What a kernel needs to give up on a wait: where to record it, after how
// long, and who it is. Plain data, passed by value to kernels.
#pragma once

#include <cstdint>

#include "runtime/device_error.hpp"

namespace turnout::kernels {

struct WaitContext {
  DeviceErrorSlot errors;
  uint64_t timeout_ns;
  int rank;
  int first_nvl_rank;  // global rank of NVL index 0 (peers are marked by index)
};

}  // namespace turnout::kernels
