// Intranode normal mode: dispatch and combine inside one NVL domain, on raw
// device pointers. The Python Buffer is a thin layer over these structs.
//
// A dispatch is two steps. `dispatch_counts` exchanges the per-rank counts
// (and, unless num_worst_tokens > 0, waits for them on the host: the receive
// sizes), then `dispatch` moves the tokens. The caller allocates the outputs
// in between; no kernel ever waits for the host.
// Combine is one step. All device pointers belong to the caller.
#pragma once

#include <cstdint>
#include <vector>

#include "turnout/config.hpp"

namespace turnout {

// What the counts step reads (this rank as a source).
struct DispatchCountsArgs {
  int num_tokens = 0;                              // T
  const bool* is_token_in_rank = nullptr;          // [T, R]
  const int32_t* num_tokens_per_expert = nullptr;  // [E]; null for a cached dispatch or no top-k
  int num_experts = 0;                             // E, with num_tokens_per_expert or top-k
  // Checked here, before anything moves: an id outside [-1, E) on any rank
  // makes every rank skip the call and raise.
  const int64_t* topk_idx = nullptr;  // [T, K], may be null
  int num_topk = 0;
  int expert_alignment = 1;      // per-expert receive counts round up to this
  int num_worst_tokens = 0;      // > 0: no host wait, outputs have this many rows
  int num_sms = kDefaultNumSms;  // the config of the dispatch that follows
  int num_max_send_tokens = kDefaultSendTokens;
  int num_max_recv_tokens = kDefaultRecvTokens;
  // Filled on the device for the handle: rank_prefix_matrix[i][j] = tokens
  // ranks 0..i send rank j.
  int32_t* rank_prefix_matrix = nullptr;
};

// What the host learns from the counts step (empty when num_worst_tokens > 0).
struct DispatchCounts {
  int num_recv_tokens = -1;
  std::vector<int> num_recv_tokens_per_expert;  // [L], aligned
  // This rank's rows from itself: [own_rows_begin, own_rows_begin +
  // num_own_rows) of the receive order; combine takes them (CombineArgs).
  int own_rows_begin = -1;
  int num_own_rows = 0;
};

// The outputs of a dispatch, num_recv_rows rows each; the top-k ones only
// with top-k, the scales only with scales.
struct DispatchOutputs {
  void* recv_x = nullptr;
  void* recv_x_scales = nullptr;     // [rows, num_scales], row-major
  int64_t* recv_topk_idx = nullptr;  // local ids, -1 elsewhere and on padding rows
  float* recv_topk_weights = nullptr;
  int32_t* recv_src_idx = nullptr;  // source token index of each row (-1 on padding); null: not written
  // [R] token count of every source rank, for the handle (combine's channels
  // need it; -1 after a failed dispatch); null: not written.
  int32_t* source_num_tokens = nullptr;
};

// Row tensors (x, recv_x; combine's x, biases and combined_x) start at
// 16-byte aligned addresses: rows move as 16-byte words.
struct DispatchArgs {
  const void* x = nullptr;  // [T, row_bytes]: bf16 or fp8 rows, moved as bytes
  int num_tokens = 0;
  int row_bytes = 0;               // multiple of 16
  const void* x_scales = nullptr;  // 4-byte elements, any 2-D strides; null: none
  int num_scales = 0;              // per token
  int64_t scale_stride_token = 0;  // in elements
  int64_t scale_stride_group = 0;
  const int64_t* topk_idx = nullptr;    // [T, K] global ids; null: no top-k
  const float* topk_weights = nullptr;  // [T, K]
  int num_topk = 0;
  int num_experts = 0;
  const bool* is_token_in_rank = nullptr;       // [T, R]
  const int32_t* rank_prefix_matrix = nullptr;  // from the counts step (or a handle)
  int num_recv_rows = 0;                        // rows of the outputs (num_recv, or num_worst_tokens)
  int num_worst_tokens = 0;
  int num_sms = kDefaultNumSms;  // the same as the counts step's
  int num_max_send_tokens = kDefaultSendTokens;
  int num_max_recv_tokens = kDefaultRecvTokens;
  // A dispatch that failed on the device (a bad input on any rank) writes
  // only: -1 in every source count (so combine refuses the handle) and, with
  // num_worst_tokens, every row as padding.
  DispatchOutputs out;
};

struct CombineArgs {
  const void* x = nullptr;              // [rows, hidden] bf16 in dispatch's receive order
  int num_rows = 0;                     // rows of x (num_recv, or num_worst_tokens)
  int hidden = 0;                       // multiple of 8
  const float* topk_weights = nullptr;  // [rows, K]; null: none
  int num_topk = 0;
  const void* bias0 = nullptr;  // [T, hidden] bf16; null: none
  const void* bias1 = nullptr;
  // The handle of the dispatch that made the receive order. Checked on the
  // device before anything moves: rank_prefix_matrix's rows for this rank
  // must fit in num_rows, and a failed dispatch's handle is refused; either
  // makes every rank skip the call and raise.
  const int32_t* rank_prefix_matrix = nullptr;
  const int32_t* source_num_tokens = nullptr;
  const int32_t* recv_src_idx = nullptr;
  const bool* is_token_in_rank = nullptr;  // [T, R] of this rank's dispatch
  int num_tokens = 0;                      // T
  int num_sms = kDefaultNumSms;
  int num_max_send_tokens = kDefaultSendTokens;
  int num_max_recv_tokens = kDefaultRecvTokens;
  void* combined_x = nullptr;              // [T, hidden] bf16
  float* combined_topk_weights = nullptr;  // [T, K] with topk_weights
  // Where this rank's rows from itself lie in x, as the dispatch's counts
  // said (DispatchCounts): combine reads them from x, so the copy into its
  // stage skips them. A range the handle does not confirm sends every rank
  // to the rings for the call, results unchanged. -1: not known.
  int own_rows_begin = -1;
  int num_own_rows = 0;
};

}  // namespace turnout
