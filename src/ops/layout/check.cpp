// The arguments of get_dispatch_layout.
#include <string>

#include "ops/layout/layout.hpp"
#include "ops/require.hpp"
#include "turnout/config.hpp"
#include "turnout/error.hpp"

namespace turnout::layout {

void check(const LayoutArgs& a, const Topology& topology) {
  constexpr const char* op = "get_dispatch_layout";
  using ops::require;
  const int num_ranks = topology.num_ranks;
  require(a.num_tokens >= 0, op, [&] { return "num_tokens must be >= 0, got " + std::to_string(a.num_tokens); });
  require(a.num_topk >= 1 && a.num_topk <= kMaxTopk, op, [&] {
    return "num_topk must be in [1, " + std::to_string(kMaxTopk) + "], got " + std::to_string(a.num_topk);
  });
  require(a.num_experts > 0 && a.num_experts % num_ranks == 0, op, [&] {
    return "num_experts must be a positive multiple of the number of ranks (" + std::to_string(num_ranks) + "), got " +
           std::to_string(a.num_experts);
  });
  require(a.num_tokens == 0 || (a.topk_idx && a.is_token_in_rank), op,
          "topk_idx and is_token_in_rank must be non-null");
  require(a.num_tokens_per_rank && a.num_tokens_per_expert, op,
          "num_tokens_per_rank and num_tokens_per_expert must be non-null");
  const int counters = a.num_experts + num_ranks + topology.num_rdma_ranks();
  if (counters > kMaxCounters)
    throw NotSupported(std::string(op) + ": " + std::to_string(a.num_experts) + " experts and " +
                       std::to_string(num_ranks) + " ranks exceed the " + std::to_string(kMaxCounters) +
                       " counters one block holds");
}

}  // namespace turnout::layout
