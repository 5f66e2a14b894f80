// Call numbers and the arrival protocol of the low-latency kernels (see
// region.hpp). Every block reads its phases' call numbers at its start. Where
// a launch runs one phase, the last block to finish it stores the number, so
// the next launch reads the next one: the phase's own blocks meet by an
// atomic in local memory, and nothing is assumed about how many blocks are
// resident at once (ranks sharing a GPU share its SMs). Where a launch runs
// both, every block is resident and block 0 stores both numbers once this
// rank's own blocks have all arrived (so all have read them): no atomic, no
// block waits for the last one.
#pragma once

#include <cstdint>

#include "kernels/device/bounded_wait.cuh"
#include "kernels/device/dependent_launch.cuh"
#include "kernels/device/memory_order.cuh"
#include "kernels/device/rank_mask.cuh"
#include "kernels/low_latency/launch.hpp"
#include "kernels/low_latency/peer_set.cuh"
#include "kernels/low_latency/region.hpp"

namespace turnout::kernels::low_latency {

// Phases of a launch (a bit each): one launch runs one or both.
inline constexpr int kPhaseSend = 1;
inline constexpr int kPhaseReceive = 2;

__host__ __device__ constexpr int phase_bits(LowLatencyPhase phase) {
  return phase == LowLatencyPhase::kSend      ? kPhaseSend
         : phase == LowLatencyPhase::kReceive ? kPhaseReceive
                                              : kPhaseSend | kPhaseReceive;
}

// A call's launches of `kernel(params, phases)` on `blocks` (grid.hpp): one
// launch of the phase asked for, or of both where every block of the grid is
// resident at once (group.gpu_to_itself); else the send, then the receive.
template <typename Params>
void launch_phases(void (*kernel)(Params, int), int blocks, int threads, const Group& group, LowLatencyPhase phase,
                   cudaStream_t stream, const Params& params) {
  if (phase != LowLatencyPhase::kSendAndReceive || group.gpu_to_itself) {
    device::launch_dependent(kernel, blocks, threads, stream, params, phase_bits(phase));
  } else {
    device::launch_dependent(kernel, blocks, threads, stream, params, kPhaseSend);
    device::launch_dependent(kernel, blocks, threads, stream, params, kPhaseReceive);
  }
}

// The number of the call this phase runs (the first call is 1).
__device__ __forceinline__ uint64_t call_number(const CallCounter* counter) {
  return *static_cast<const volatile uint64_t*>(&counter->seq) + 1;
}

// Every thread of every block calls it once, after the block's part of the
// phase. In the last block to arrive, `closing()` runs on all its threads
// (every block's reads and writes of this rank happen before it), then the
// counter advances. Returns true in that block.
template <typename Closing>
__device__ __forceinline__ bool finish_phase(CallCounter* counter, uint64_t seq, Closing closing) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(&counter->done, 1u) == gridDim.x - 1;
    if (last) __threadfence();
  }
  __syncthreads();
  if (!last) return false;
  closing();
  __syncthreads();
  if (threadIdx.x == 0) {
    counter->done = 0;
    *static_cast<volatile uint64_t*>(&counter->seq) = seq;
  }
  return true;
}

// A sending block, once all its threads' puts are issued: thread x adds this
// block's share of kArrivalsPerCall to the counters at `offset` of peers x,
// x + blockDim, ... (block 0 adds what makes the grid's total exact), for the
// peers of `live`.
template <class Transport>
__device__ __forceinline__ void arrive_at_peers(const Transport& tr, int num_ranks, int64_t offset, PeerSet live) {
  __syncthreads();
  for (int d = static_cast<int>(threadIdx.x); d < num_ranks; d += static_cast<int>(blockDim.x))
    if (live.has(d)) tr.arrive(d, offset, blockIdx.x == 0 ? kArrivalsPerCall - (gridDim.x - 1) : 1u);
}

// Thread-level, shrink mode aware: whether call `seq` of peer `peer` (NVL
// index) counts. Without shrink mode it waits (bounded) and a timeout is an
// error: `failed` is set. In shrink mode a peer that is masked, or that does
// not come in time (then masked), does not count, and every block of the call
// takes the first block's verdict (`verdict`).
template <typename Arrived>
__device__ __forceinline__ bool peer_counts(const WaitContext& wait, int peer, WaitSite site, uint32_t* verdict,
                                            uint32_t seq, bool live, bool& failed, Arrived arrived) {
  const bool came = live && device::bounded_wait(wait, wait.first_nvl_rank + peer, site, arrived);
  if (wait.mask == nullptr) {
    failed = !came;
    return came;
  }
  failed = !came && !device::rank_masked(wait, wait.first_nvl_rank + peer) && live;
  return device::agree_on_peer(verdict, seq, came);
}

// Block 0 of a launch that runs both phases, after its receive's wait: once
// every block of this rank has arrived (each read the numbers first), the
// next launch may read the next numbers. This rank's own blocks never wait
// before they arrive, so the spin ends whatever its peers do.
__device__ __forceinline__ void advance_both(CallCounter* send, uint64_t send_seq, CallCounter* receive,
                                             uint64_t recv_seq, const uint32_t* own_arrivals) {
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const uint32_t target = arrivals_after(send_seq);
    while (static_cast<int32_t>(device::load_acquire_sys(own_arrivals) - target) < 0) {
    }
    *static_cast<volatile uint64_t*>(&send->seq) = send_seq;
    *static_cast<volatile uint64_t*>(&receive->seq) = recv_seq;
  }
}

}  // namespace turnout::kernels::low_latency
