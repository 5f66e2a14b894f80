// Kernels never trap (that would kill the user's CUDA context) and never spin
// forever: on a timeout or a bad input they write a record into host-mapped
// memory and return. The host turns the record into an exception: before a
// local op, and after the launches of a collective one, so that a rank that
// raises has still launched every kernel its peers wait for.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/cuda_resources.hpp"
#include "turnout/topology.hpp"

namespace turnout {

enum class DeviceErrorCode : int32_t {
  kNone = 0,
  kTimeout = 1,              // sticky: peers are out of step, the buffer is unusable
  kInvalidExpert = 2,        // cleared once reported: nothing was written for the call
  kWorstTokensExceeded = 3,  // cleared once reported: the dispatch moved nothing
  kPeerInputError = 4,       // cleared once reported: a peer's input was bad, nothing moved
  kBadHandle = 5,            // cleared once reported: combine's handle does not fit, nothing moved
};

// The op whose kernel left a record: errors are raised by a later call, so the
// message names the one that caused them.
enum class OpKind : int32_t {
  kNone = 0,
  kLayout = 1,
  kDispatch = 2,
  kCombine = 3,
  kBarrier = 4,
  kLowLatencyDispatch = 5,
  kLowLatencyCombine = 6,
};

const char* op_name(OpKind op);

// Values of the claim word. An input error holds it until the host reports
// it; a timeout may take it over (it ends every wait, an input error none).
inline constexpr int32_t kClaimInput = 1;
inline constexpr int32_t kClaimTimeout = 2;

// Which wait timed out (the `where` field of a timeout record).
enum class WaitSite : int32_t {
  kBarrier = 1,
  kDispatchCounts = 2,
  kDispatchData = 3,
  kCombineData = 4,
  kDispatchOutputs = 5,     // the host's output pointers (peer: this rank)
  kLowLatencyDispatch = 6,  // a source rank's tokens
  kLowLatencyCombine = 7,   // an expert rank's rows
  kLeftOut = 8,             // internode shrink: the peers left this rank out of the call (peer: one of them)
};

const char* wait_site_name(WaitSite site);

// Host-mapped; written by one GPU thread with plain stores, `code` last (after
// a system fence) so a host that sees the code sees the fields.
struct DeviceErrorRecord {
  int32_t code;
  int32_t rank;    // rank that recorded the error
  int32_t peer;    // timeout: the peer rank waited for; invalid expert: the slot; peer error: the peer
  int32_t where;   // timeout: WaitSite; peer error: the OpKind on the peer that found its bad input;
                   // worst tokens: 1 where an internode forwarder's count broke D x the bound
  int64_t detail;  // timeout: elapsed ns; invalid expert: the token; worst tokens: the bound
  int64_t value;   // invalid expert: the offending id; worst tokens: the receive (or forward) count
  int64_t call;    // the Buffer call (1, 2, ... per Buffer) whose kernel recorded it
  int32_t op;      // that call's OpKind
  // Input errors: every NVL peer skipped a dispatch for it (the error of a
  // layout call is not, until the next dispatch's counts step tells them).
  int32_t shared;
  // Written by the host: raised while unshared, so it stays until shared.
  int32_t reported;
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
  OpKind op;
  int64_t call;
};

class DeviceErrorWord {
 public:
  DeviceErrorWord();
  // What the kernels of call `call` (an `op`) get.
  DeviceErrorSlot device(OpKind op, int64_t call) const {
    return {static_cast<int32_t*>(claim_.get()), device_, op, call};
  }
  // Throws TimeoutError / InvalidArgument if a kernel left a record; `op` names
  // the raising call, the message the call that caused it. Input errors are
  // cleared once thrown, except an unshared one that a dispatch launched
  // after it (`last_dispatch_call`) has still to tell the peers: that one is
  // thrown once and cleared once shared. `first_nvl_rank` turns the
  // missing-peer indices into ranks.
  void check(const char* op, int first_nvl_rank = 0, int64_t last_dispatch_call = 0);
  bool timed_out() const;
  void clear();

 private:
  HostMemory memory_;
  DeviceMemory claim_;
  DeviceErrorRecord* host_ = nullptr;
  DeviceErrorRecord* device_ = nullptr;
};

}  // namespace turnout
