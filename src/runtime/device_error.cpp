#include "runtime/device_error.hpp"

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "turnout/error.hpp"

namespace turnout {

const char* wait_site_name(WaitSite site) {
  switch (site) {
    case WaitSite::kBarrier:
      return "barrier";
    case WaitSite::kDispatchCounts:
      return "dispatch: receive counts";
    case WaitSite::kDispatchData:
      return "dispatch: token data";
    case WaitSite::kCombineData:
      return "combine: token data";
    case WaitSite::kDispatchOutputs:
      return "dispatch: output tensors from the host";
    case WaitSite::kLowLatencyDispatch:
      return "low_latency_dispatch: a source rank's tokens";
    case WaitSite::kLowLatencyCombine:
      return "low_latency_combine: an expert rank's rows";
    case WaitSite::kLeftOut:
      return "dispatch: the live set of the call";
  }
  return "unknown wait";
}

const char* op_name(OpKind op) {
  switch (op) {
    case OpKind::kLayout:
      return "get_dispatch_layout";
    case OpKind::kDispatch:
      return "dispatch";
    case OpKind::kCombine:
      return "combine";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kLowLatencyDispatch:
      return "low_latency_dispatch";
    case OpKind::kLowLatencyCombine:
      return "low_latency_combine";
    case OpKind::kNone:
      break;
  }
  return "an op";
}

namespace {

// "get_dispatch_layout (call 12 of this buffer)": the call that caused a record.
std::string origin(const DeviceErrorRecord& rec) {
  return std::string(op_name(static_cast<OpKind>(rec.op))) + " (call " + std::to_string(rec.call) + " of this buffer)";
}

// The exception of an input error's record, raised by the call `op`.
InvalidArgument input_error(const char* op, const DeviceErrorRecord& rec) {
  const std::string prefix = std::string(op) + ": " + origin(rec) + ": ";
  switch (static_cast<DeviceErrorCode>(rec.code)) {
    case DeviceErrorCode::kWorstTokensExceeded:
      if (rec.where == 1)
        return InvalidArgument(prefix + "num_worst_tokens must be >= the number of tokens a rank receives: rank " +
                               std::to_string(rec.peer) + " forwards " + std::to_string(rec.value) +
                               " tokens into its NVL domain, more than the " + std::to_string(rec.detail) +
                               " (NVL ranks x num_worst_tokens) that its handle[9] holds, so a rank of its domain "
                               "receives more than num_worst_tokens; nothing was dispatched (its outputs hold only "
                               "padding rows)");
      return InvalidArgument(prefix + "num_worst_tokens must be >= the number of tokens a rank receives: rank " +
                             std::to_string(rec.peer) + " passed num_worst_tokens=" + std::to_string(rec.detail) +
                             " but receives " + std::to_string(rec.value) +
                             " tokens; nothing was dispatched (its outputs hold only padding rows)");
    case DeviceErrorCode::kPeerInputError: {
      const auto found_by = static_cast<OpKind>(rec.where);
      return InvalidArgument(prefix + "rank " + std::to_string(rec.peer) + " passed invalid input: " +
                             (found_by == OpKind::kCombine || found_by == OpKind::kLowLatencyCombine
                                  ? std::string("a handle that does not fit its combine's inputs; nothing was combined")
                                  : std::string("an expert id outside [-1, num_experts) in the topk_idx of its ") +
                                        op_name(found_by) + " call; nothing was dispatched"));
    }
    case DeviceErrorCode::kInvalidExpert:
      return InvalidArgument(prefix + "topk_idx[" + std::to_string(rec.detail) + ", " + std::to_string(rec.peer) +
                             "] = " + std::to_string(rec.value) + " is outside [-1, num_experts); " +
                             (static_cast<OpKind>(rec.op) == OpKind::kLayout
                                  ? "its outputs are not usable, and the next dispatch moves nothing on any rank"
                                  : "nothing was dispatched"));
    case DeviceErrorCode::kBadHandle:
      if (static_cast<OpKind>(rec.op) == OpKind::kLowLatencyCombine)
        return InvalidArgument(prefix + "handle does not fit: " +
                               (rec.detail == 2 ? std::string("it comes from a low_latency_dispatch that failed")
                                                : std::string("its dispatch had another shape (tokens, top-k, hidden, "
                                                              "num_max_dispatch_tokens_per_rank or num_experts)")) +
                               "; nothing was combined");
      return InvalidArgument(prefix + "handle does not fit: " +
                             (rec.detail == 2 ? std::string("it comes from a dispatch that failed")
                                              : "its rank_prefix_matrix counts " + std::to_string(rec.value) +
                                                    " rows for this rank, x has " + std::to_string(rec.peer)) +
                             "; nothing was combined");
    default:
      return InvalidArgument(prefix + "unknown device error code " + std::to_string(rec.code));
  }
}

}  // namespace

DeviceErrorWord::DeviceErrorWord()
    : memory_(allocate_host_mapped(sizeof(DeviceErrorRecord))), claim_(allocate_device(sizeof(int32_t))) {
  TURNOUT_CUDA_CHECK(cudaMemset(claim_.get(), 0, sizeof(int32_t)));
  TURNOUT_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  host_ = static_cast<DeviceErrorRecord*>(memory_.get());
  std::memset(host_, 0, sizeof(DeviceErrorRecord));
  void* d = nullptr;
  TURNOUT_CUDA_CHECK(cudaHostGetDevicePointer(&d, host_, 0));
  device_ = static_cast<DeviceErrorRecord*>(d);
}

bool DeviceErrorWord::timed_out() const {
  return __atomic_load_n(&host_->code, __ATOMIC_ACQUIRE) == static_cast<int32_t>(DeviceErrorCode::kTimeout);
}

void DeviceErrorWord::clear() {
  std::memset(host_, 0, sizeof(DeviceErrorRecord));
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  // Error path only: wait for the reset of the claim (the legacy stream does
  // not order with the library's non-blocking streams, so it waits for no op).
  TURNOUT_CUDA_CHECK(cudaMemset(claim_.get(), 0, sizeof(int32_t)));
  TURNOUT_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void DeviceErrorWord::check(const char* op, int first_nvl_rank, int64_t last_dispatch_call) {
  const int32_t code = __atomic_load_n(&host_->code, __ATOMIC_ACQUIRE);
  if (code == 0) return;
  if (code == static_cast<int32_t>(DeviceErrorCode::kTimeout)) {
    // Every waiter gives up within microseconds of the first: let the others
    // mark their peers before the list is read.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const DeviceErrorRecord rec = *host_;
    if (static_cast<WaitSite>(rec.where) == WaitSite::kLeftOut)
      throw TimeoutError(std::string(op) + ": " + origin(rec) + ": rank " + std::to_string(rec.rank) +
                         " was left out of the call by rank " + std::to_string(rec.peer) +
                         " and the others (shrink mode: it came after their shrink timeout; they masked it and went "
                         "on without it); this buffer is no longer usable: create a new one");
    std::string missing;
    for (int i = 0; i < kMaxNvlRanks; ++i)
      if (rec.missing[i]) missing += (missing.empty() ? "" : ", ") + std::to_string(first_nvl_rank + i);
    if (missing.empty()) missing = std::to_string(rec.peer);
    throw TimeoutError(std::string(op) + ": " + origin(rec) + ": rank " + std::to_string(rec.rank) +
                       " timed out after " + std::to_string(rec.detail / 1000000) + " ms waiting for rank " +
                       std::to_string(rec.peer) + " (" + wait_site_name(static_cast<WaitSite>(rec.where)) +
                       "); ranks that did not answer: " + missing +
                       "; this buffer is no longer usable: create a new one");
  }
  const DeviceErrorRecord rec = *host_;
  if (!rec.shared && rec.call < last_dispatch_call) {
    // A dispatch launched since must still find it and tell the peers.
    if (rec.reported) return;
    host_->reported = 1;
    throw input_error(op, rec);
  }
  clear();
  if (!rec.reported) throw input_error(op, rec);  // else thrown while unshared
}

}  // namespace turnout
