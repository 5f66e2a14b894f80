// The counts step in a launch of its own (notify_block.cuh): dispatch's where
// the host waits for its counts or ranks share the GPU, combine's handle check
// where ranks share the GPU.
#include <cuda_runtime.h>

#include "kernels/intranode/launch.hpp"
#include "kernels/intranode/notify_block.cuh"
#include "turnout/error.hpp"

namespace turnout::kernels {
namespace {

constexpr int kThreads = 1024;

__global__ void __launch_bounds__(kThreads, 1) notify_kernel(NotifyParams p) {
  notify_step::notify_block<kThreads>(p);
}

}  // namespace

KernelLaunch intranode_notify_launch() {
  return {reinterpret_cast<const void*>(notify_kernel), dim3(1), dim3(kThreads), 0};
}

void launch_intranode_notify(const NotifyParams& p, cudaStream_t stream) {
  void* args[] = {const_cast<NotifyParams*>(&p)};
  launch(intranode_notify_launch(), args, stream);
}

}  // namespace turnout::kernels
