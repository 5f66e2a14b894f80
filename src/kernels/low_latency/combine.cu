#include "kernels/low_latency/launch.hpp"
#include "turnout/error.hpp"

namespace turnout::kernels::low_latency {

void launch_combine_send(const LowLatencyCombineArgs&, const Region&, const Group&, cudaStream_t) {
  throw NotSupported("low_latency_combine: not available in this version of turnout");
}

void launch_combine_recv(const LowLatencyCombineArgs&, const Region&, const Group&, cudaStream_t) {
  throw NotSupported("low_latency_combine: not available in this version of turnout");
}

}  // namespace turnout::kernels::low_latency
