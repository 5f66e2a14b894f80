// The call number of a low-latency kernel and the end of its call: every
// block reads the number at its start; the last block to finish runs the
// kernel's closing step (its signals) and then stores the next number. No
// block waits for another, so no assumption is made about how many blocks
// are resident (ranks sharing a GPU share its SMs).
#pragma once

#include <cstdint>

#include "kernels/low_latency/region.hpp"

namespace turnout::kernels::low_latency {

// The number of the call this kernel runs (the first call is 1).
__device__ __forceinline__ uint32_t call_number(const CallCounter* counter) {
  return *static_cast<const volatile uint32_t*>(&counter->seq) + 1;
}

// Every thread of every block calls it once, after the block's work. In the
// last block to arrive, `closing()` runs on all its threads (after a system
// fence: every block's writes, peers' included, happen before it), then the
// counter advances. Returns true in that block.
template <typename Closing>
__device__ __forceinline__ bool finish_call(CallCounter* counter, uint32_t seq, Closing closing) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(&counter->done, 1u) == gridDim.x - 1;
    if (last) __threadfence_system();
  }
  __syncthreads();
  if (!last) return false;
  closing();
  __syncthreads();
  if (threadIdx.x == 0) {
    counter->done = 0;
    *static_cast<volatile uint32_t*>(&counter->seq) = seq;
  }
  return true;
}

}  // namespace turnout::kernels::low_latency
