// Writing the host-mapped error record from a kernel: the first thread to
// claim it (in device memory) fills the fields, then publishes the code.
#pragma once

#include <cstdint>

#include "runtime/device_error.hpp"

namespace turnout::device {

// Input errors claim a free record; a timeout also takes one over from an
// input error, since it must end every wait.
__device__ __forceinline__ bool claim_record(DeviceErrorSlot slot, DeviceErrorCode code) {
  if (code != DeviceErrorCode::kTimeout) return atomicCAS(slot.claim, 0, kClaimInput) == 0;
  const int32_t old = atomicCAS(slot.claim, 0, kClaimTimeout);
  return old == 0 || (old == kClaimInput && atomicCAS(slot.claim, kClaimInput, kClaimTimeout) == kClaimInput);
}

// `shared`: every NVL peer learns of the error in the same call (see
// DeviceErrorRecord::shared).
__device__ __forceinline__ void record_error(DeviceErrorSlot slot, DeviceErrorCode code, int rank, int peer, int where,
                                             int64_t detail, int64_t value, bool shared = true) {
  if (!claim_record(slot, code)) return;
  volatile DeviceErrorRecord* rec = slot.record;
  rec->rank = rank;
  rec->peer = peer;
  rec->where = where;
  rec->detail = detail;
  rec->value = value;
  rec->call = slot.call;
  rec->op = static_cast<int32_t>(slot.op);
  rec->shared = shared;
  __threadfence_system();
  rec->code = static_cast<int32_t>(code);
  __threadfence_system();
}

// A wait already timed out on this rank: stop waiting so the kernel drains
// quickly. An input error left by an earlier call stops nothing.
__device__ __forceinline__ bool wait_abandoned(DeviceErrorSlot slot) {
  return *static_cast<volatile int32_t*>(slot.claim) == kClaimTimeout;
}

// An input error of an earlier call on this rank that no peer knows of yet
// (a layout call's): the OpKind that found it, else 0.
__device__ __forceinline__ int unshared_input_error(DeviceErrorSlot slot) {
  if (*static_cast<volatile int32_t*>(slot.claim) != kClaimInput) return 0;
  const volatile DeviceErrorRecord* rec = slot.record;
  if (rec->code == 0 || rec->shared) return 0;
  return rec->op;
}

// Called once the peers have been told of the unshared error.
__device__ __forceinline__ void mark_shared(DeviceErrorSlot slot) {
  static_cast<volatile DeviceErrorRecord*>(slot.record)->shared = 1;
}

}  // namespace turnout::device
