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
  WaitContext wait;
};

// Sends never wait: each writes its messages, then one flag per peer.
void launch_dispatch_send(const LowLatencyDispatchArgs& args, const Region& region, const Group& group,
                          cudaStream_t stream);
// Waits for every peer's flag, then places the rows and writes the outputs.
void launch_dispatch_recv(const LowLatencyDispatchArgs& args, const Region& region, const Group& group,
                          cudaStream_t stream);
void launch_combine_send(const LowLatencyCombineArgs& args, const Region& region, const Group& group,
                         cudaStream_t stream);
void launch_combine_recv(const LowLatencyCombineArgs& args, const Region& region, const Group& group,
                         cudaStream_t stream);

}  // namespace turnout::kernels::low_latency
