// get_dispatch_layout: argument checks, then the kernel.
#include <string>

#include "kernels/launch.hpp"
#include "ops/require.hpp"
#include "turnout/config.hpp"
#include "turnout/error.hpp"
#include "turnout/layout.hpp"

namespace turnout {
namespace {

using ops::require;
constexpr const char* kOp = "get_dispatch_layout";

}  // namespace

void get_dispatch_layout(const LayoutArgs& a, const Topology& topology, DeviceErrorSlot errors, void* workspace,
                         cudaStream_t stream) {
  const int num_ranks = topology.num_ranks;
  require(a.num_tokens >= 0, kOp, [&] { return "num_tokens must be >= 0, got " + std::to_string(a.num_tokens); });
  require(a.num_topk >= 1 && a.num_topk <= kMaxTopk, kOp, [&] {
    return "num_topk must be in [1, " + std::to_string(kMaxTopk) + "], got " + std::to_string(a.num_topk);
  });
  require(a.num_experts > 0 && a.num_experts % num_ranks == 0, kOp, [&] {
    return "num_experts must be a positive multiple of the number of ranks (" + std::to_string(num_ranks) +
           "), got " + std::to_string(a.num_experts);
  });
  require(a.num_tokens == 0 || (a.topk_idx && a.is_token_in_rank), kOp,
          "topk_idx and is_token_in_rank must be non-null");
  require(a.num_tokens_per_rank && a.num_tokens_per_expert, kOp,
          "num_tokens_per_rank and num_tokens_per_expert must be non-null");
  const int counters = a.num_experts + num_ranks + topology.num_rdma_ranks();
  if (counters > kMaxLayoutCounters)
    throw NotSupported("get_dispatch_layout: " + std::to_string(a.num_experts) + " experts and " +
                       std::to_string(num_ranks) + " ranks exceed the " + std::to_string(kMaxLayoutCounters) +
                       " counters one block holds");
  require(workspace != nullptr, kOp, "workspace must be non-null");
  kernels::launch_dispatch_layout({a, num_ranks, topology.num_nvl_ranks, topology.rank, errors,
                                   static_cast<int32_t*>(workspace)},
                                  stream);
}

}  // namespace turnout
