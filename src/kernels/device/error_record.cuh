// Writing the host-mapped error record from a kernel: the first thread to
// claim it (in device memory) fills the fields, then publishes the code.
#pragma once

#include <cstdint>

#include "turnout/device_error.hpp"

namespace turnout::device {

__device__ __forceinline__ void record_error(DeviceErrorSlot slot, DeviceErrorCode code, int rank, int peer,
                                             int where, int64_t detail, int64_t value) {
  if (atomicCAS(slot.claim, 0, 1) != 0) return;
  volatile DeviceErrorRecord* rec = slot.record;
  rec->rank = rank;
  rec->peer = peer;
  rec->where = where;
  rec->detail = detail;
  rec->value = value;
  __threadfence_system();
  rec->code = static_cast<int32_t>(code);
  __threadfence_system();
}

// Another thread already gave up: stop waiting so the kernel drains quickly.
__device__ __forceinline__ bool error_recorded(DeviceErrorSlot slot) {
  return *static_cast<volatile int32_t*>(slot.claim) != 0;
}

}  // namespace turnout::device
