// The grid of a low-latency launch. Work goes round-robin over blocks (a
// dispatch's tokens to send) or over the warps of the grid (message slots,
// combine's chunks); a call takes as long as its busiest block or warp. The
// grid is the fewest blocks that leave none busier than the whole SM budget
// would: more blocks add arrivals for the peers to count and receivers that
// spin on them, and save nothing. At 128 tokens on 132 SMs (4x H100) a
// dispatch on 128 blocks and a combine on 112 each took less than on 132.
#pragma once

#include <algorithm>
#include <cstdint>

namespace turnout::kernels::low_latency {

// The fewest blocks, at most `budget`, over which `items` round-robin
// (`per_block` at a time) leave no taker more of them than `budget` blocks do.
constexpr int fewest_blocks(int64_t items, int per_block, int budget) {
  if (items <= 0 || budget <= 1) return 1;
  const int64_t takers = static_cast<int64_t>(per_block) * budget;
  const int64_t rounds = (items + takers - 1) / takers;  // items the busiest taker gets
  const int64_t per_round = static_cast<int64_t>(per_block) * rounds;
  return static_cast<int>(std::min<int64_t>(budget, (items + per_round - 1) / per_round));
}

// Dispatch: the send's tokens a block each, the receive's R * M message
// slots a warp each.
constexpr int dispatch_blocks(int num_tokens, int num_ranks, int num_max_tokens, int warps_per_block, int budget) {
  return std::max(fewest_blocks(num_tokens, 1, budget),
                  fewest_blocks(static_cast<int64_t>(num_ranks) * num_max_tokens, warps_per_block, budget));
}

// Combine: the send's (token, source, chunk) items, at most M * R * C, and
// the receive's (token, chunk) items, a warp each.
constexpr int combine_blocks(int num_tokens, int num_ranks, int num_max_tokens, int chunks, int warps_per_block,
                             int budget) {
  const int64_t send = static_cast<int64_t>(num_max_tokens) * num_ranks * chunks;
  const int64_t receive = static_cast<int64_t>(num_tokens) * chunks;
  return std::max(fewest_blocks(send, warps_per_block, budget), fewest_blocks(receive, warps_per_block, budget));
}

}  // namespace turnout::kernels::low_latency
