// Low-latency dispatch, combine and the group barrier for groups that span
// NVL domains: the kernels of src/kernels/low_latency/ instantiated on
// NvshmemTransport,
// compiled here (separable compilation, NVSHMEM's device library) so that
// the core's NVLink instantiations keep their own code generation.
#include "kernels/low_latency/combine_kernel.cuh"
#include "kernels/low_latency/dispatch_kernel.cuh"
#include "kernels/low_latency/group_barrier_kernel.cuh"
#include "nvshmem/low_latency.hpp"
#include "nvshmem/low_latency_transport.cuh"

namespace turnout::nvshmem {

void launch_low_latency_dispatch(const LowLatencyDispatchArgs& args, const kernels::low_latency::Region& region,
                                 const kernels::low_latency::Group& group, LowLatencyPhase phase, cudaStream_t stream) {
  kernels::low_latency::launch_dispatch_on<NvshmemTransport>(args, region, group, phase, stream);
}

void launch_low_latency_combine(const LowLatencyCombineArgs& args, const kernels::low_latency::Region& region,
                                const kernels::low_latency::Group& group, LowLatencyPhase phase, cudaStream_t stream) {
  kernels::low_latency::launch_combine_on<NvshmemTransport>(args, region, group, phase, stream);
}

void launch_low_latency_barrier(const kernels::low_latency::BarrierArgs& args, const kernels::low_latency::Group& group,
                                cudaStream_t stream) {
  kernels::low_latency::launch_group_barrier_on<NvshmemTransport>(args, group, stream);
}

}  // namespace turnout::nvshmem
