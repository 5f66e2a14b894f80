// get_dispatch_layout: from each token's top-k experts, how many tokens go to
// each rank, RDMA rank and expert, and which ranks each token must reach.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "turnout/device_error.hpp"
#include "turnout/topology.hpp"

namespace turnout {

struct LayoutArgs {
  const int64_t* topk_idx = nullptr;  // [num_tokens, num_topk], -1 = empty slot
  int num_tokens = 0;
  int num_topk = 0;
  int num_experts = 0;
  int32_t* num_tokens_per_rank = nullptr;       // [num_ranks]
  int32_t* num_tokens_per_rdma_rank = nullptr;  // [num_rdma_ranks], may be null
  int32_t* num_tokens_per_expert = nullptr;     // [num_experts]
  bool* is_token_in_rank = nullptr;             // [num_tokens, num_ranks]
};

// Counters one call can hold (num_experts + num_ranks + num_rdma_ranks): they
// live in one block's 48 KB of shared memory.
inline constexpr int kMaxLayoutCounters = 12 * 1024;

// Device memory the blocks of a call add their counts into: zero before the
// call, and left zero by it (the last block to finish copies the totals out
// and clears them), so no memset precedes the kernel. Calls that share a
// workspace must not overlap.
inline constexpr size_t layout_workspace_bytes(int num_counters) { return (num_counters + 1) * sizeof(int32_t); }
inline constexpr size_t kLayoutWorkspaceBytes = layout_workspace_bytes(kMaxLayoutCounters);

// Launches the kernel on `stream`, adding into `workspace` (zero, at least
// layout_workspace_bytes(num_experts + num_ranks + num_rdma_ranks)). Scalars are checked
// here (InvalidArgument); expert ids outside [-1, num_experts) are found by
// the kernel, which skips them (no write outside the outputs) and leaves a
// record in `errors` that its owner's check() throws; the outputs of such a
// call are meaningless.
void get_dispatch_layout(const LayoutArgs& args, const Topology& topology, DeviceErrorSlot errors, void* workspace,
                         cudaStream_t stream);

}  // namespace turnout
