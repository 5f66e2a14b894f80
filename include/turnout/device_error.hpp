// Kernels never trap (that would kill the user's CUDA context) and never spin
// forever: on a timeout or a bad input they write a record into host-mapped
// memory and return. The host turns the record into an exception.
#pragma once

#include <cstdint>
#include <string>

#include "turnout/cuda_resources.hpp"
#include "turnout/topology.hpp"

namespace turnout {

enum class DeviceErrorCode : int32_t {
  kNone = 0,
  kTimeout = 1,        // sticky: peers are out of step, the buffer is unusable
  kInvalidExpert = 2,  // cleared once reported: nothing was written for the call
  kWorstTokensExceeded = 3,  // cleared once reported: the dispatch moved nothing
  kPeerInputError = 4,       // cleared once reported: a peer's input was bad, nothing moved
};

// Which wait timed out (the `where` field of a timeout record).
enum class WaitSite : int32_t {
  kBarrier = 1,
  kDispatchCounts = 2,
  kDispatchData = 3,
  kCombineData = 4,
  kDispatchOutputs = 5,  // the host's output pointers (peer: this rank)
};

const char* wait_site_name(WaitSite site);

// Host-mapped; written by one GPU thread with plain stores, `code` last (after
// a system fence) so a host that sees the code sees the fields.
struct DeviceErrorRecord {
  int32_t code;
  int32_t rank;    // rank that recorded the error
  int32_t peer;    // timeout: the peer rank waited for; invalid expert: the slot
  int32_t where;   // timeout: WaitSite; invalid expert: unused
  int64_t detail;  // timeout: elapsed ns; invalid expert: token * 2^32 | value's low bits
  int64_t value;   // invalid expert: the offending id; worst tokens: the receive count
  // Timeout: nonzero for every NVL peer (by index in the domain) that some
  // thread of this rank gave up on; plain byte stores, so no claim is needed.
  uint8_t missing[kMaxNvlRanks];
};

// What kernels get: the record, and a claim word in device memory so exactly
// one thread writes it. The claim is a device-memory atomic because atomics on
// host memory are not coherent with host writes on every platform (the host
// could not reset it).
struct DeviceErrorSlot {
  int32_t* claim;
  DeviceErrorRecord* record;
};

class DeviceErrorWord {
 public:
  DeviceErrorWord();
  DeviceErrorSlot device() const { return {static_cast<int32_t*>(claim_.get()), device_}; }
  // Throws TimeoutError / InvalidArgument if a kernel left a record; `op` names
  // the call for the message. Input errors are cleared once thrown.
  // `first_nvl_rank` turns the missing-peer indices into ranks.
  void check(const char* op, int first_nvl_rank = 0);
  bool timed_out() const;
  void clear();

 private:
  HostMemory memory_;
  DeviceMemory claim_;
  DeviceErrorRecord* host_ = nullptr;
  DeviceErrorRecord* device_ = nullptr;
};

}  // namespace turnout
