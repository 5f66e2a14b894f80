#include "turnout/device_error.hpp"

#include <chrono>
#include <cstring>
#include <thread>
#include <string>

#include "turnout/error.hpp"

namespace turnout {

const char* wait_site_name(WaitSite site) {
  switch (site) {
    case WaitSite::kBarrier: return "barrier";
    case WaitSite::kDispatchCounts: return "dispatch: receive counts";
    case WaitSite::kDispatchData: return "dispatch: token data";
    case WaitSite::kCombineData: return "combine: token data";
    case WaitSite::kDispatchOutputs: return "dispatch: output tensors from the host";
  }
  return "unknown wait";
}

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

void DeviceErrorWord::check(const char* op, int first_nvl_rank) {
  const int32_t code = __atomic_load_n(&host_->code, __ATOMIC_ACQUIRE);
  if (code == 0) return;
  if (code == static_cast<int32_t>(DeviceErrorCode::kTimeout)) {
    // Every waiter gives up within microseconds of the first: let the others
    // mark their peers before the list is read.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const DeviceErrorRecord rec = *host_;
  switch (static_cast<DeviceErrorCode>(code)) {
    case DeviceErrorCode::kTimeout: {
      std::string missing;
      for (int i = 0; i < kMaxNvlRanks; ++i)
        if (rec.missing[i]) missing += (missing.empty() ? "" : ", ") + std::to_string(first_nvl_rank + i);
      if (missing.empty()) missing = std::to_string(rec.peer);
      throw TimeoutError(std::string(op) + ": rank " + std::to_string(rec.rank) + " timed out after " +
                         std::to_string(rec.detail / 1000000) + " ms waiting for rank " + std::to_string(rec.peer) +
                         " (" + wait_site_name(static_cast<WaitSite>(rec.where)) + "); ranks that did not answer: " +
                         missing + "; this buffer is no longer usable: create a new one");
    }
    case DeviceErrorCode::kWorstTokensExceeded:
      clear();
      throw InvalidArgument(std::string(op) +
                            ": num_worst_tokens must be >= the number of tokens a rank receives: rank " +
                            std::to_string(rec.peer) + " passed num_worst_tokens=" + std::to_string(rec.detail) +
                            " but receives " + std::to_string(rec.value) + " tokens; nothing was dispatched");
    case DeviceErrorCode::kPeerInputError:
      clear();
      throw InvalidArgument(std::string(op) + ": rank " + std::to_string(rec.peer) +
                            " passed invalid input (an expert id outside [-1, num_experts)); nothing was dispatched");
    case DeviceErrorCode::kInvalidExpert: {
      clear();
      throw InvalidArgument(std::string(op) + ": topk_idx[" + std::to_string(rec.detail) + ", " +
                            std::to_string(rec.peer) + "] = " + std::to_string(rec.value) +
                            " is outside [-1, num_experts)");
    }
    default:
      throw Error(std::string(op) + ": unknown device error code " + std::to_string(code));
  }
}

}  // namespace turnout
