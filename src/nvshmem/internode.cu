// Internode normal mode's kernels (src/kernels/internode/) instantiated on
// NvshmemNetTransport: the core never links NVSHMEM, so they live here.
#include "kernels/internode/combine.cuh"
#include "kernels/internode/dispatch.cuh"
#include "kernels/internode/notify.cuh"
#include "nvshmem/internode.hpp"
#include "nvshmem/internode_transport.cuh"

namespace turnout::nvshmem {

static_assert(kernels::internode::NetTransport<NvshmemNetTransport>);

void launch_internode_notify(const kernels::internode::NotifyParams& params, cudaStream_t stream) {
  kernels::internode::launch_notify_on(params, NvshmemNetTransport{params.net_local}, stream);
}

void launch_internode_dispatch(const kernels::internode::DispatchParams& params, cudaStream_t stream) {
  kernels::internode::launch_dispatch_on(params, NvshmemNetTransport{params.net_local}, stream);
}

void launch_internode_combine(const kernels::internode::CombineParams& params, cudaStream_t stream) {
  kernels::internode::launch_combine_on(params, NvshmemNetTransport{params.net_local}, stream);
}

}  // namespace turnout::nvshmem
