#include <cuda_runtime_api.h>

#include "kernels/low_latency/region.hpp"
#include "ops/low_latency/low_latency.hpp"
#include "turnout/error.hpp"

namespace turnout::low_latency {

void clean(BufferCore& core, cudaStream_t stream) {
  const char* op = "clean_low_latency_buffer";
  core.require_alive(op);
  if (!core.options().low_latency_mode)
    throw InvalidArgument(std::string(op) + ": this buffer was created without low_latency_mode=True");
  // The call counters stay: sequence numbers never repeat, so no message of
  // an earlier call can pass for a later one's.
  constexpr size_t kCounters = offsetof(kernels::low_latency::LocalState, expert_count);
  char* local = static_cast<char*>(core.local_low_latency());
  core.barrier(stream);
  TURNOUT_CUDA_CHECK(cudaMemsetAsync(local + kCounters, 0, core.low_latency_bytes() - kCounters, stream));
  core.barrier(stream);
  core.check_errors(op);
}

}  // namespace turnout::low_latency
