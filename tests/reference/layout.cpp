// get_dispatch_layout for one rank: which ranks, RDMA ranks and experts each token reaches.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference.hpp"

namespace turnout::reference {

void check_expert_ids(std::span<const int64_t> topk_idx, int num_experts, int num_ranks, const char* arg) {
  if (num_ranks <= 0) throw std::invalid_argument("num_ranks: must be positive, got " + std::to_string(num_ranks));
  if (num_experts <= 0 || num_experts % num_ranks != 0)
    throw std::invalid_argument("num_experts: must be a positive multiple of num_ranks (" + std::to_string(num_ranks) +
                                "), got " + std::to_string(num_experts));
  for (size_t i = 0; i < topk_idx.size(); ++i) {
    if (topk_idx[i] < -1 || topk_idx[i] >= num_experts)
      throw std::invalid_argument(std::string(arg) + ": expert id " + std::to_string(topk_idx[i]) + " at flat index " +
                                  std::to_string(i) + " is outside [-1, " + std::to_string(num_experts) + ")");
  }
}

DispatchLayout get_dispatch_layout(std::span<const int64_t> topk_idx, int num_tokens, int num_topk, int num_ranks,
                                   int num_experts, int num_nvl_ranks) {
  if (num_tokens < 0) throw std::invalid_argument("num_tokens: must be >= 0, got " + std::to_string(num_tokens));
  if (num_topk <= 0) throw std::invalid_argument("num_topk: must be positive, got " + std::to_string(num_topk));
  if (topk_idx.size() != static_cast<size_t>(num_tokens) * num_topk)
    throw std::invalid_argument("topk_idx: expected " + std::to_string(num_tokens) + " x " + std::to_string(num_topk) +
                                " ids, got " + std::to_string(topk_idx.size()));
  check_expert_ids(topk_idx, num_experts, num_ranks, "topk_idx");
  if (num_nvl_ranks <= 0 || num_ranks % num_nvl_ranks != 0)
    throw std::invalid_argument("num_nvl_ranks: must divide num_ranks (" + std::to_string(num_ranks) + "), got " +
                                std::to_string(num_nvl_ranks));

  const int experts_per_rank = num_experts / num_ranks;
  const int num_rdma_ranks = num_ranks / num_nvl_ranks;
  DispatchLayout layout;
  layout.num_tokens_per_rank.assign(num_ranks, 0);
  layout.num_tokens_per_rdma_rank.assign(num_rdma_ranks, 0);
  layout.num_tokens_per_expert.assign(num_experts, 0);
  layout.is_token_in_rank.assign(static_cast<size_t>(num_tokens) * num_ranks, 0);

  // Per-token "already counted" marks make every count once per distinct target.
  std::vector<uint8_t> expert_hit(num_experts);
  std::vector<uint8_t> rdma_hit(num_rdma_ranks);
  for (int t = 0; t < num_tokens; ++t) {
    std::fill(expert_hit.begin(), expert_hit.end(), 0);
    std::fill(rdma_hit.begin(), rdma_hit.end(), 0);
    uint8_t* in_rank = &layout.is_token_in_rank[static_cast<size_t>(t) * num_ranks];
    for (int k = 0; k < num_topk; ++k) {
      int64_t expert = topk_idx[static_cast<size_t>(t) * num_topk + k];
      if (expert < 0) continue;
      int rank = static_cast<int>(expert / experts_per_rank);
      expert_hit[expert] = 1;
      in_rank[rank] = 1;
      rdma_hit[rank / num_nvl_ranks] = 1;
    }
    for (int e = 0; e < num_experts; ++e) layout.num_tokens_per_expert[e] += expert_hit[e];
    for (int r = 0; r < num_ranks; ++r) layout.num_tokens_per_rank[r] += in_rank[r];
    for (int d = 0; d < num_rdma_ranks; ++d) layout.num_tokens_per_rdma_rank[d] += rdma_hit[d];
  }
  return layout;
}

}  // namespace turnout::reference
