// get_dispatch_layout behind the Buffer facade: its argument check (a free
// function, tested on the CPU), its workspaces and its launch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "ops/buffer_core.hpp"
#include "runtime/cuda_resources.hpp"
#include "turnout/layout.hpp"
#include "turnout/topology.hpp"

namespace turnout::layout {

// Counters one call can hold (num_experts + num_ranks + num_rdma_ranks): they
// live in one block's 48 KB of shared memory.
inline constexpr int kMaxCounters = 12 * 1024;

// Device memory the blocks of a call add their counts into, then a count of
// finished blocks: zero before the call, and left zero by it (the last block
// copies the totals out and clears them), so no memset precedes the kernel.
inline constexpr size_t workspace_bytes(int num_counters) {
  return (num_counters + 1) * sizeof(int32_t);
}

// Throws InvalidArgument naming the argument (NotSupported past kMaxCounters).
// Expert ids are not read here: the kernel finds ids outside [-1, E).
void check(const LayoutArgs& args, const Topology& topology);

// The workspaces of one Buffer's layout calls. Eager calls share one (they are
// issued on one stream); a call captured in a CUDA graph gets one of its own
// from the pool, so that its replays cannot overlap an eager call (or another
// graph) on the same counters.
class Workspaces {
 public:
  Workspaces();
  // For a call with `num_counters` counters on `stream`; NotSupported once the
  // pool is spent (about 3600 captured calls with 256 experts).
  void* take(const char* op, int num_counters, cudaStream_t stream);
  void release() { pool_.reset(); }

 private:
  DeviceMemory pool_;
  size_t used_ = 0;
};

// A local op: an error an earlier call left is raised before the launch.
void get_dispatch_layout(BufferCore& core, Workspaces& workspaces, const LayoutArgs& args, cudaStream_t stream);

}  // namespace turnout::layout
