// get_dispatch_layout: the workspace of the call, then the kernel.
#include "ops/layout/layout.hpp"

#include <string>

#include "kernels/launch.hpp"
#include "runtime/align.hpp"
#include "turnout/error.hpp"

namespace turnout::layout {
namespace {

// The eager calls' workspace first, then the captured calls'.
constexpr size_t kPoolBytes = 4 << 20;
constexpr size_t kEagerBytes = workspace_bytes(kMaxCounters);

}  // namespace

Workspaces::Workspaces() : pool_(allocate_device(kPoolBytes)), used_(kEagerBytes) {
  TURNOUT_CUDA_CHECK(cudaMemset(pool_.get(), 0, kPoolBytes));
}

void* Workspaces::take(const char* op, int num_counters, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TURNOUT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture == cudaStreamCaptureStatusNone) return pool_.get();
  const size_t bytes = align_up(workspace_bytes(num_counters), 128);
  if (used_ + bytes > kPoolBytes)
    throw NotSupported(std::string(op) + ": this buffer has no layout workspace left for another captured call (" +
                       std::to_string(kPoolBytes - kEagerBytes) + " bytes, " + std::to_string(bytes) +
                       " per captured call)");
  void* workspace = static_cast<char*>(pool_.get()) + used_;
  used_ += bytes;
  return workspace;
}

void get_dispatch_layout(BufferCore& core, Workspaces& workspaces, const LayoutArgs& args, cudaStream_t stream) {
  const char* op = "get_dispatch_layout";
  core.require_alive(op);
  core.check_errors(op);
  const Topology& topology = core.topology();
  check(args, topology);
  const int counters = args.num_experts + topology.num_ranks + topology.num_rdma_ranks();
  void* workspace = workspaces.take(op, counters, stream);
  core.begin_call();
  kernels::launch_dispatch_layout({args, topology.num_ranks, topology.num_nvl_ranks, topology.rank,
                                   core.error_slot(OpKind::kLayout), static_cast<int32_t*>(workspace), core.mask()},
                                  stream);
}

}  // namespace turnout::layout
