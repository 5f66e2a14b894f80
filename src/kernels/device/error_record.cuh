// Writing the host-mapped error record from a kernel: the first thread to
// claim it fills the fields, then publishes the code.
#pragma once

#include <cstdint>

#include "turnout/device_error.hpp"

namespace turnout::device {

__device__ __forceinline__ void record_error(DeviceErrorRecord* rec, DeviceErrorCode code, int rank, int peer,
                                             int where, int64_t detail, int64_t value) {
  if (atomicCAS_system(&rec->claim, 0, 1) != 0) return;
  rec->rank = rank;
  rec->peer = peer;
  rec->where = where;
  rec->detail = detail;
  rec->value = value;
  __threadfence_system();
  atomicExch_system(&rec->code, static_cast<int32_t>(code));
}

// Another thread already gave up: stop waiting so the kernel drains quickly.
__device__ __forceinline__ bool error_recorded(const DeviceErrorRecord* rec) {
  return *reinterpret_cast<const volatile int32_t*>(&rec->claim) != 0;
}

}  // namespace turnout::device
