// get_dispatch_layout: from each token's top-k experts, how many tokens go to
// each rank, RDMA rank and expert, and which ranks each token must reach.
#pragma once

#include <cstdint>

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

}  // namespace turnout
