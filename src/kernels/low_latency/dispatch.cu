// Low-latency dispatch over NVLink: every peer in load/store reach.
#include "kernels/low_latency/dispatch_kernel.cuh"

namespace turnout::kernels::low_latency {

void launch_dispatch(const LowLatencyDispatchArgs& args, const Region& region, const Group& group,
                     LowLatencyPhase phase, cudaStream_t stream) {
  launch_dispatch_on<NvlinkTransport>(args, region, group, phase, stream);
}

}  // namespace turnout::kernels::low_latency
