#include <cuda_runtime_api.h>

#include "ops/low_latency/low_latency.hpp"
#include "turnout/error.hpp"

namespace turnout::low_latency {

void clean(BufferCore& core, cudaStream_t stream) {
  const char* op = "clean_low_latency_buffer";
  core.require_alive(op);
  if (!core.options().low_latency_mode)
    throw InvalidArgument(std::string(op) + ": this buffer was created without low_latency_mode=True");
  // Everything, the call counters and arrival counters too: every rank starts
  // again from call 1 with nothing of an earlier call left to pass for a
  // later one's (no stale sequence number survives either). In shrink mode
  // the unmasked ranks meet, and one that does not come is masked.
  core.barrier(stream, true);
  TURNOUT_CUDA_CHECK(cudaMemsetAsync(core.local_low_latency(), 0, core.low_latency_bytes(), stream));
  core.barrier(stream, true);
  core.check_errors(op);
}

}  // namespace turnout::low_latency
