#include "kernels/low_latency/launch.hpp"
#include "turnout/error.hpp"

namespace turnout::kernels::low_latency {

void launch_dispatch_send(const LowLatencyDispatchArgs&, const Region&, const Group&, cudaStream_t) {
  throw NotSupported("low_latency_dispatch: not available in this version of turnout");
}

void launch_dispatch_recv(const LowLatencyDispatchArgs&, const Region&, const Group&, cudaStream_t) {
  throw NotSupported("low_latency_dispatch: not available in this version of turnout");
}

}  // namespace turnout::kernels::low_latency
