// Internode normal mode: dispatch and combine over several NVL domains, on raw
// device pointers (docs/INTERNODE.md). A token crosses the network once per
// other domain it reaches, to the rank of its source's local index there (its
// forwarder), which hands it on over NVLink; combine reduces inside each
// domain first and sends one partial sum per token back.
//
// As intranode, a dispatch is two steps: `internode_dispatch_counts` exchanges
// the counts (and, unless num_worst_tokens > 0, the host waits for them), then
// `internode_dispatch` moves the tokens into outputs the caller allocated in
// between. Combine is one step. All device pointers belong to the caller.
#pragma once

#include <cstdint>
#include <vector>

#include "turnout/config.hpp"

namespace turnout {

// An internode call on num_sms SMs runs num_sms / 2 block pairs of this many
// channels each (C below): as many as fit 32 warps a block, up to 4.
int internode_channels_per_block(int num_domains, int num_nvl_ranks);

// DeepEP's ten handle entries, index for index (docs/INTERNODE.md "The
// handle"). R ranks in N domains of D, C = channels of the dispatch, T this
// rank's tokens. A fresh dispatch's counts step writes [1]-[6], its data step
// [7]-[9]; a cached dispatch and combine read them.
struct InternodeHandle {
  const bool* is_token_in_rank = nullptr;              // [0] [T, R]
  int32_t* rdma_channel_prefix_matrix = nullptr;       // [1] [N, C]
  int32_t* gbl_channel_prefix_matrix = nullptr;        // [2] [R, C]
  int32_t* recv_rdma_channel_prefix_matrix = nullptr;  // [3] [N, C]
  int32_t* recv_rdma_rank_prefix_sum = nullptr;        // [4] [N]: [N - 1] = num_forward
  int32_t* recv_gbl_channel_prefix_matrix = nullptr;   // [5] [R, C]
  int32_t* recv_gbl_rank_prefix_sum = nullptr;         // [6] [R]: [R - 1] = num_recv
  int32_t* recv_src_meta = nullptr;                    // [7] [num_recv, 2]: (source token, local-rank bits)
  int32_t* send_rdma_head = nullptr;                   // [8] [T, N]
  int32_t* send_nvl_head = nullptr;                    // [9] [num_forward, D]
  // [10] (ours, shrink mode only; null without): the call's live set, a bit
  // per rank (bit r & 31 of word r >> 5), R / 32 words rounded up. A fresh
  // dispatch's counts step writes it from the mask buffer; a cached dispatch
  // and a combine read it, so that they use the dispatch's forwarders. With
  // it, [3] is [N x P, C] and [4] [N x P], a row per (source domain, part),
  // P the columns this rank forwards (1 with every rank live). A fresh
  // dispatch writes N x P rows, so give it room for N x D; with
  // num_worst_tokens it writes all N x D: the rows past N x P are parts with
  // no tokens ([3] zeros, [4] its last sum), P never reaching the host.
  uint32_t* live = nullptr;
  int num_tokens = 0;    // T
  int num_channels = 0;  // C
  int num_recv = 0;      // rows of [7] (num_recv, or num_worst_tokens)
  int num_forward = 0;   // rows of [9] (num_forward, or D x num_worst_tokens)
};

struct InternodeDispatchCountsArgs {
  int num_tokens = 0;                              // T
  const int32_t* num_tokens_per_expert = nullptr;  // [E]; null for a cached dispatch or no top-k
  int num_experts = 0;                             // E, with num_tokens_per_expert or top-k
  // Checked before anything moves: an id outside [-1, E) on any rank makes
  // every rank skip the call and raise.
  const int64_t* topk_idx = nullptr;  // [T, K], may be null
  int num_topk = 0;
  int expert_alignment = 1;
  int num_worst_tokens = 0;  // > 0: no host wait
  // Handle given (cached dispatch): entries [1]-[6] are read, not written;
  // the step only meets the peers and resets the rings.
  bool cached = false;
  Config config;
  InternodeHandle handle;  // [0] read; [1]-[6] written (or read when cached)
};

// What the host learns from the counts step (empty with num_worst_tokens or
// a cached dispatch).
struct InternodeDispatchCounts {
  int num_recv_tokens = -1;
  int num_forward_tokens = -1;                  // tokens this rank forwards into its domain
  int num_parts = 1;                            // P: the columns this rank forwards (shrink mode)
  std::vector<int> num_recv_tokens_per_expert;  // [L], aligned
};

// Row tensors (x, recv_x; combine's x, biases and combined_x) start at
// 16-byte aligned addresses.
struct InternodeDispatchArgs {
  const void* x = nullptr;  // [T, row_bytes]: bf16 or fp8 rows, moved as bytes
  int num_tokens = 0;
  int row_bytes = 0;  // multiple of 16
  const void* x_scales = nullptr;
  int num_scales = 0;
  int64_t scale_stride_token = 0;  // in elements
  int64_t scale_stride_group = 0;
  const int64_t* topk_idx = nullptr;  // [T, K] global ids; null: no top-k
  const float* topk_weights = nullptr;
  int num_topk = 0;
  int num_experts = 0;  // E, that of the counts step's num_tokens_per_expert (0 when cached)
  int num_worst_tokens = 0;
  bool cached = false;
  Config config;
  InternodeHandle handle;  // [0]-[6] read; [7]-[9] written unless cached
  void* recv_x = nullptr;  // [handle.num_recv, row_bytes]
  void* recv_x_scales = nullptr;
  int64_t* recv_topk_idx = nullptr;  // local ids, -1 elsewhere and on padding rows
  float* recv_topk_weights = nullptr;
};

struct InternodeCombineArgs {
  const void* x = nullptr;  // [handle.num_recv, hidden] bf16 in dispatch's receive order
  int hidden = 0;           // multiple of 8
  const float* topk_weights = nullptr;
  int num_topk = 0;
  const void* bias0 = nullptr;  // [T, hidden] bf16; null: none
  const void* bias1 = nullptr;
  Config config;  // its channels must be the dispatch's
  InternodeHandle handle;
  void* combined_x = nullptr;  // [T, hidden] bf16
  float* combined_topk_weights = nullptr;
};

}  // namespace turnout
