// The internode launchers of libturnout_nvshmem.so (see internode.cu); the
// core reaches them through the API table. They throw on a launch error.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/internode/launch.hpp"

namespace turnout::nvshmem {

void launch_internode_notify(const kernels::internode::NotifyParams& params, cudaStream_t stream);
void launch_internode_dispatch(const kernels::internode::DispatchParams& params, cudaStream_t stream);
void launch_internode_combine(const kernels::internode::CombineParams& params, cudaStream_t stream);

}  // namespace turnout::nvshmem
