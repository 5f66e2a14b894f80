// Low-latency combine over NVLink: every peer in load/store reach.
#include "kernels/low_latency/combine_kernel.cuh"

namespace turnout::kernels::low_latency {

void launch_combine(const LowLatencyCombineArgs& args, const Region& region, const Group& group, LowLatencyPhase phase,
                    cudaStream_t stream) {
  launch_combine_on<NvlinkTransport>(args, region, group, phase, stream);
}

}  // namespace turnout::kernels::low_latency
