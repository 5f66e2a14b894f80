// Every spin has a deadline. Past it the waiter records which peer and which
// wait it gave up on and returns false; the kernel then exits normally. In
// shrink mode (ctx.mask) it masks the peer instead, and a wait for a peer that
// is masked (before or during it) returns false at once: the caller goes on
// without that peer.
#pragma once

#include <cstdint>

#include "kernels/device/error_record.cuh"
#include "kernels/device/memory_order.cuh"
#include "kernels/device/rank_mask.cuh"
#include "kernels/wait_context.hpp"

namespace turnout::device {

using kernels::WaitContext;

// Spins until `ready()` holds. Returns false on timeout (recorded, or the
// peer masked), when the peer is masked, or when another wait of this rank
// already timed out.
template <typename Ready>
__device__ __forceinline__ bool bounded_wait(const WaitContext& ctx, int peer, WaitSite site, Ready ready) {
  const uint64_t start = global_timer_ns();
  for (uint32_t spin = 0;; ++spin) {
    if (ready()) return true;
    if ((spin & 63) == 63) {
      const uint64_t elapsed = global_timer_ns() - start;
      if (wait_abandoned(ctx.errors) || rank_masked(ctx, peer)) return false;
      if (elapsed > ctx.timeout_ns && ctx.mask != nullptr) {
        mask_rank(ctx, peer);
        return false;
      }
      if (elapsed > ctx.timeout_ns) {
        const int index = peer - ctx.first_nvl_rank;
        if (index >= 0 && index < kMaxNvlRanks) ctx.errors.record->missing[index] = 1;
        record_error(ctx.errors, DeviceErrorCode::kTimeout, ctx.rank, peer, static_cast<int>(site),
                     static_cast<int64_t>(elapsed), 0);
        return false;
      }
    }
  }
}

}  // namespace turnout::device
