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
  // Shrink mode (null without): int32 per global rank, nonzero = masked. A
  // wait for a masked peer ends at once, and a peer that does not come within
  // timeout_ns is masked instead of recorded as a timeout.
  int32_t* mask;
};

}  // namespace turnout::kernels
