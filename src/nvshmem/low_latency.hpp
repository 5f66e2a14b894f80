// The low-latency launchers of libturnout_nvshmem.so (see low_latency.cu);
// the core reaches them through the API table. They throw on a launch error.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/low_latency/group_barrier.hpp"
#include "kernels/low_latency/launch.hpp"
#include "turnout/low_latency.hpp"

namespace turnout::nvshmem {

void launch_low_latency_dispatch(const LowLatencyDispatchArgs& args, const kernels::low_latency::Region& region,
                                 const kernels::low_latency::Group& group, LowLatencyPhase phase, cudaStream_t stream);
void launch_low_latency_combine(const LowLatencyCombineArgs& args, const kernels::low_latency::Region& region,
                                const kernels::low_latency::Group& group, LowLatencyPhase phase, cudaStream_t stream);
void launch_low_latency_barrier(const kernels::low_latency::BarrierArgs& args, const kernels::low_latency::Group& group,
                                cudaStream_t stream);

}  // namespace turnout::nvshmem
