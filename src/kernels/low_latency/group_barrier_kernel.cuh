// The low-latency group barrier (group_barrier.hpp) as a template on the
// transport (transport.cuh). One block, a thread per rank: each thread
// arrives at its peer, then, once every thread has, waits for it; no rank's
// arrival depends on its waits.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/device/bounded_wait.cuh"
#include "kernels/device/memory_order.cuh"
#include "kernels/device/rank_mask.cuh"
#include "kernels/low_latency/group_barrier.hpp"
#include "turnout/error.hpp"

namespace turnout::kernels::low_latency {
namespace {

constexpr int kBarrierThreads = 1024;
static_assert(kMaxGroupRanks <= kBarrierThreads, "the group barrier takes a thread per rank");

// One meeting of every unmasked rank, thread d for peer d; `vote` goes to
// each peer ahead of this rank's arrival. False on every thread where a peer
// never came outside shrink mode (recorded).
template <class Transport>
__device__ __forceinline__ bool meet(const Transport& tr, const Group& group, BarrierArea* area, int64_t area_offset,
                                     bool vote) {
  const WaitContext& ctx = group.wait;
  const int me = group.rank;
  const int d = static_cast<int>(threadIdx.x);
  // Read once, so that this thread waits for exactly the peer it arrived at.
  const bool live = d < group.num_ranks && d != me && !device::rank_masked(ctx, d);
  // What ran before (on this stream, or in this kernel) is visible
  // system-wide before any arrival; far arrivals are ordered after earlier
  // puts by the transport's fence.
  __threadfence_system();
  __syncthreads();
  if (live) {
    const int64_t mine = int64_t(sizeof(uint32_t)) * me;
    if (vote) tr.set_word(d, area_offset + offsetof(BarrierArea, leaving_alone) + mine, 1u);
    tr.arrive(d, area_offset + offsetof(BarrierArea, arrivals) + mine, 1u);
  }
  __syncthreads();
  bool ok = true;
  if (live) {
    const uint32_t epoch = area->epochs[d] + 1;
    const bool came = device::bounded_wait(ctx, d, WaitSite::kBarrier, [&] {
      return static_cast<int32_t>(device::load_acquire_sys(&area->arrivals[d]) - epoch) >= 0;
    });
    // A peer given up on (masked) still got this rank's arrival.
    area->epochs[d] = epoch;
    ok = came || ctx.mask != nullptr;
  }
  return __syncthreads_and(ok);
}

// Block-wide: whether some peer is masked, or (`votes`) voted to leave alone.
__device__ __forceinline__ bool any_peer_lost(const Group& group, const BarrierArea* area, bool votes) {
  const int d = static_cast<int>(threadIdx.x);
  bool lost = false;
  if (d < group.num_ranks && d != group.rank)
    lost = device::rank_masked(group.wait, d) || (votes && device::load_acquire_sys(&area->leaving_alone[d]) != 0);
  return __syncthreads_or(lost);
}

template <class Transport>
__global__ void __launch_bounds__(kBarrierThreads) group_barrier_kernel(Group group, BarrierArgs args) {
  const Transport tr = Transport::in_block(group.regions, group);
  auto* area = reinterpret_cast<BarrierArea*>(tr.local() + args.area);
  const bool ok = meet(tr, group, area, args.area, false);
  if (args.leave_verdict == nullptr) return;
  // Destroy's vote. The first meeting masked whoever did not come; the second
  // tells every peer met whether this rank has lost one. A peer that voted
  // did so before its arrival, which this rank acquired; one that did not
  // come to the second is masked by now.
  const bool vote = !ok || any_peer_lost(group, area, false);
  const bool again = meet(tr, group, area, args.area, vote);
  const bool alone = vote || !again || any_peer_lost(group, area, true);
  if (threadIdx.x == 0) *args.leave_verdict = alone ? 1 : 0;
}

template <class Transport>
void launch_group_barrier_on(const BarrierArgs& args, const Group& group, cudaStream_t stream) {
  const int threads = (group.num_ranks + 31) / 32 * 32;
  group_barrier_kernel<Transport><<<1, threads, 0, stream>>>(group, args);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace
}  // namespace turnout::kernels::low_latency
