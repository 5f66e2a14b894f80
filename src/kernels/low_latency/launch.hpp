// Host-callable launchers of the low-latency kernels. The ops layer
// (src/ops/low_latency/) validates the arguments first; these size the grid
// and launch. Kernel names contain "dispatch" or "combine", so profilers that
// look for those names find them.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/low_latency/region.hpp"
#include "kernels/wait_context.hpp"
#include "turnout/low_latency.hpp"

namespace turnout::kernels::low_latency {

// Where a rank's kernels reach the group.
struct Group {
  void* const* regions = nullptr;  // device table: every NVL peer's low-latency region
  int rank = 0;                    // this rank's index in the table
  int num_ranks = 0;
  int num_blocks = 1;  // at most the rank's SM budget: receives spin, peers need SMs too
  // No other rank of the group runs on this GPU: every block of a grid is
  // resident at once, so a call's send and receive can share one kernel.
  bool gpu_to_itself = false;
  WaitContext wait;
};

// A phase of a call, or the whole call: sends never wait (each writes its
// messages, then one flag per peer); receives wait for every peer's flag,
// then place the rows (dispatch) or sum them (combine). A whole call is one
// kernel where group.gpu_to_itself, else the send's kernel and the receive's.
void launch_dispatch(const LowLatencyDispatchArgs& args, const Region& region, const Group& group,
                     LowLatencyPhase phase, cudaStream_t stream);
void launch_combine(const LowLatencyCombineArgs& args, const Region& region, const Group& group, LowLatencyPhase phase,
                    cudaStream_t stream);

}  // namespace turnout::kernels::low_latency
