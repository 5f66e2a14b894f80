// The barrier of a low-latency group that spans NVL domains: a small kernel
// over the group's transport, in place of NVSHMEM's barrier, which has no
// timeout and knows no mask. Its state lives past the low-latency region in
// every rank's symmetric allocation, where clean_low_latency_buffer's zeroing
// does not reach.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/low_latency/launch.hpp"
#include "kernels/low_latency/region.hpp"
#include "runtime/align.hpp"

namespace turnout::kernels::low_latency {

// Arrival counters only grow and each rank counts the barriers it met with
// each peer (as the NVL barrier does): a peer one barrier ahead is never
// taken for a late one, and a peer that was masked and skipped some is in
// step again once both sides unmask it.
struct BarrierArea {
  uint32_t arrivals[kMaxGroupRanks];  // [s]: added by rank s, once per barrier it arrives at
  uint32_t epochs[kMaxGroupRanks];    // [s]: this rank's own count of barriers met with rank s
  // [s]: rank s tears its buffer down without NVSHMEM's collectives (set at
  // destroy's vote, never cleared: destroy is a buffer's last barrier).
  uint32_t leaving_alone[kMaxGroupRanks];
};

inline constexpr int64_t kBarrierAreaBytes = align_up(sizeof(BarrierArea), 4096);

struct BarrierArgs {
  int64_t area = 0;  // offset of the BarrierArea in every rank's region (the same on all)
  // Null for a plain barrier. Destroy's vote: the ranks meet twice, and here
  // the barrier stores 1 where this rank must leave NVSHMEM alone (a rank is
  // lost: masked here, or by a peer it met), else 0.
  int32_t* leave_verdict = nullptr;
};

// Every unmasked rank of `group` meets (group.wait: bounded; in shrink mode a
// peer that does not come is masked). Writes and puts this rank made before
// the launch reach each peer before its wait for this rank ends.
void launch_group_barrier(const BarrierArgs& args, const Group& group, cudaStream_t stream);

}  // namespace turnout::kernels::low_latency
