// Host-callable launchers of the low-latency kernels. The ops layer
// (src/ops/low_latency/) validates the arguments first; these size the grid
// and launch. Each op is one kernel symbol whose name holds "dispatch" or
// "combine", the phase a runtime argument, so a profiler sees one row per op
// however the call was split (DeepEP's benchmarking helper relies on it).
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/low_latency/region.hpp"
#include "kernels/wait_context.hpp"
#include "turnout/low_latency.hpp"

namespace turnout::kernels::low_latency {

inline constexpr int kRegionsByValue = kMaxNvlRanks;

// Where a rank's kernels reach the group.
struct Group {
  // Device table of every rank's low-latency region as this rank reaches it
  // by stores, null where only a network put reaches it (other NVL domains,
  // or every peer without NVLink for low-latency mode).
  void* const* regions = nullptr;
  // The same table by value where the group has at most kRegionsByValue
  // ranks: a block copies it from the launch's parameters, with no load from
  // global memory before its first store.
  void* regions_by_value[kRegionsByValue] = {};
  int rank = 0;  // this rank's index in the table
  int num_ranks = 0;
  int num_blocks = 1;  // the rank's SM budget, the most a launch takes (grid.hpp): receives spin, peers need SMs too
  // No other rank of the group runs on this GPU: every block of a grid is
  // resident at once, so a call's send and receive can share one launch.
  bool gpu_to_itself = false;
  WaitContext wait;
  WaitContext receive_wait;  // combine's wait for its expert ranks (shrink mode: twice as patient)
};

// A phase of a call, or the whole call: sends never wait for a peer (each
// block writes its messages, then adds to each peer's arrival counter);
// receives wait for every peer's arrivals, then place the rows (dispatch) or
// sum them (combine). A whole call is one launch where group.gpu_to_itself,
// else a launch per phase.
void launch_dispatch(const LowLatencyDispatchArgs& args, const Region& region, const Group& group,
                     LowLatencyPhase phase, cudaStream_t stream);
void launch_combine(const LowLatencyCombineArgs& args, const Region& region, const Group& group, LowLatencyPhase phase,
                    cudaStream_t stream);

}  // namespace turnout::kernels::low_latency
