// A launch of both steps of an intranode op (the counts or handle check step
// in block 0, the data step in every block), where the rank has its GPU to
// itself: every block is resident at once, so the others can wait for block 0.
#pragma once

#include <cstdint>

#include "kernels/device/error_record.cuh"
#include "kernels/device/memory_order.cuh"
#include "kernels/intranode/launch.hpp"
#include "runtime/control_region.hpp"

namespace turnout::kernels {

// Every block waits here until block 0 has run the first step: a barrier of
// the grid on two words of this rank's control region (where no user data
// lies: the arrivals read 0 at every launch), which a CUDA graph's replays
// pass as eager launches do. A block reads the generation before it arrives;
// the last to arrive (block 0, as a rule) clears the arrivals for the next
// launch and moves the generation on. False where the wait gave up (another
// wait of this rank timed out, or block 0 never came, recorded at `site`):
// the block then does nothing.
__device__ __forceinline__ bool wait_for_first_block(const Peers& peers, const WaitContext& ctx, WaitSite site) {
  __shared__ bool passed;
  if (threadIdx.x == 0) {
    uint32_t* words = static_cast<ControlRegion*>(peers.control[peers.rank])->first_block;
    volatile uint32_t* generation = words + 1;
    const uint32_t seen = *generation;
    // Block 0's first step (what it wrote, and what its barriers saw of the
    // peers') comes before its arrival.
    __threadfence_system();
    if (atomicAdd(words, 1u) == gridDim.x - 1) {
      words[0] = 0;
      __threadfence();
      *generation = seen + 1;
      passed = true;
    } else {
      // Block 0 may wait out its peers twice (two barriers), each within the
      // timeout: past four the wait gives up.
      const uint64_t start = device::global_timer_ns();
      passed = false;
      for (uint32_t spin = 0;; ++spin) {
        if (*generation != seen) {
          passed = true;
          break;
        }
        if ((spin & 63) != 63) continue;
        if (device::wait_abandoned(ctx.errors)) break;
        const uint64_t elapsed = device::global_timer_ns() - start;
        if (elapsed > 4 * ctx.timeout_ns) {
          device::record_error(ctx.errors, DeviceErrorCode::kTimeout, ctx.rank, ctx.rank, static_cast<int>(site),
                               static_cast<int64_t>(elapsed), 0);
          break;
        }
      }
      __threadfence();
    }
  }
  __syncthreads();
  return passed;
}

}  // namespace turnout::kernels
