// Where low-latency mode keeps things in each rank's low-latency region (the
// num_rdma_bytes part of its peer allocation), and the plan a dispatch leaves
// for its combine. Shared by the host launchers and the kernels: every rank
// computes the same offsets from the same call.
//
// Calls are told apart by sequence numbers, not by zeroing: each of the four
// kernels (dispatch send / receive, combine send / receive) counts its own
// calls in LocalState, and a call with number n uses the areas of parity
// n & 1 and publishes n as its flag. So a graph replay, which cannot take a
// new number from the host, still gets one.
#pragma once

#include <cuda_runtime_api.h>  // __host__ __device__ for the C++ compiler too

#include <cstdint>

#include "runtime/align.hpp"
#include "turnout/low_latency.hpp"
#include "turnout/topology.hpp"

namespace turnout::kernels::low_latency {

inline constexpr int kMaxTopk = kLowLatencyMaxTopk;
inline constexpr int kMaxRanks = kMaxNvlRanks;
inline constexpr int kMaxLocalExperts = kLowLatencyMaxExperts;  // one rank may hold them all
inline constexpr int kGroup = kLowLatencyScaleGroup;

// One kernel's call counter, and the blocks of its current call that have
// finished: the last one to finish stores seq + 1 and zeroes `done`.
struct CallCounter {
  uint32_t seq;
  uint32_t done;
};

// This rank's own; peers never touch it.
struct LocalState {
  CallCounter dispatch_send;
  CallCounter dispatch_recv;
  CallCounter combine_send;
  CallCounter combine_recv;
  // Dispatch send: nonzero once a token of this call had a bad expert id
  // (zero between calls).
  int32_t dispatch_input_error;
  int32_t pad[3];  // the signals after LocalState stay 16-byte aligned: their counts move in 16-byte words
  // Dispatch send: tokens of this call per global expert (zero between calls).
  int32_t expert_count[kLowLatencyMaxExperts];
};

// Written by source rank s into slot [parity][s] of each destination, flag last
// (release): what the destination needs before it places any row.
struct DispatchSignal {
  uint32_t flag;       // the call's sequence number
  int32_t num_tokens;  // T of rank s
  int32_t error;       // nonzero: rank s had a bad input; no destination places anything
  int32_t pad;
  int32_t count[kMaxLocalExperts];  // tokens s sends to each of the destination's experts
};

// Written by expert rank d into slot [parity][d] of each source rank once all
// of d's rows for it are there.
struct CombineSignal {
  uint32_t flag;
  int32_t error;  // nonzero: d's plan came from a failed dispatch; no source writes its output
  int32_t pad[2];
};

struct FixedArea {
  LocalState local;
  DispatchSignal dispatch[2][kMaxRanks];
  CombineSignal combine[2][kMaxRanks];
};

inline constexpr int64_t kFixedBytes = align_up(sizeof(FixedArea), 4096);

// The head of a dispatch message: one per (token, destination rank), in slot
// [parity][source][token] of the destination. Valid for a call only if `seq`
// is its sequence number and `token` the slot's token (a slot a call does
// not use keeps an older message).
struct MessageHeader {
  uint32_t seq;
  int32_t token;
  int32_t num_entries;  // distinct experts of the token on the destination, in top-k order
  int32_t pad;
  int16_t local_expert[kMaxTopk];
  uint8_t topk_slot[kMaxTopk];  // the first k naming that expert: combine's row for it
  float weight[kMaxTopk];       // with dispatch weights: the sum over k naming that expert
};
static_assert(sizeof(MessageHeader) == 128);

// The payload follows the header: the bf16 row (2 * hidden bytes), or the e4m3
// row (hidden bytes) then hidden / 128 float scales. Its slot is sized for bf16.
__host__ __device__ constexpr int64_t message_bytes(int hidden) {
  return sizeof(MessageHeader) + align_up(int64_t(hidden) * 2, 16);
}

// A combine row on the wire: bf16, or (use_logfmt) e4m3 then hidden / 128
// float scales. Default combine uses slot t * K + k (k: the topk_slot of the
// header); pre-reduced combine slot t * R + d (d: the expert rank).
__host__ __device__ constexpr int64_t combine_row_bytes(int hidden) {
  return align_up(int64_t(hidden) * 2, 16);
}
__host__ __device__ constexpr int64_t combine_logfmt_scales_offset(int hidden) {
  return align_up(hidden, 16);
}

struct Region {
  int num_max_tokens = 0;  // M
  int hidden = 0;
  int num_ranks = 0;
  int num_topk = 0;
  int64_t message = 0;      // bytes of one dispatch slot
  int64_t combine_row = 0;  // bytes of one combine slot
  int64_t combine_slots = 0;
  int64_t dispatch_data[2] = {};  // [R][M] message slots, [s][t] written by rank s
  int64_t combine_data[2] = {};   // [combine_slots] rows
  int64_t total = 0;

  __host__ __device__ int64_t dispatch_slot(int parity, int source, int token) const {
    return dispatch_data[parity] + (int64_t(source) * num_max_tokens + token) * message;
  }
  __host__ __device__ int64_t combine_slot(int parity, int64_t slot) const {
    return combine_data[parity] + slot * combine_row;
  }
};

__host__ __device__ inline Region make_region(int num_max_tokens, int hidden, int num_ranks, int num_topk) {
  Region r;
  r.num_max_tokens = num_max_tokens;
  r.hidden = hidden;
  r.num_ranks = num_ranks;
  r.num_topk = num_topk;
  r.message = message_bytes(hidden);
  r.combine_row = combine_row_bytes(hidden);
  r.combine_slots = int64_t(num_max_tokens) * (num_topk > num_ranks ? num_topk : num_ranks);
  int64_t at = kFixedBytes;
  for (int p = 0; p < 2; ++p) {
    r.dispatch_data[p] = at;
    at = align_up(at + int64_t(num_ranks) * num_max_tokens * r.message, 128);
  }
  for (int p = 0; p < 2; ++p) {
    r.combine_data[p] = at;
    at = align_up(at + r.combine_slots * r.combine_row, 128);
  }
  r.total = at;
  return r;
}

// What a dispatch's receive leaves for its combine (caller memory). Rows are
// numbered l * M*R + row.
struct PlanHeader {
  int32_t num_tokens;  // T of this rank's dispatch
  int32_t num_topk;
  int32_t has_weights;  // the dispatch had weights: combine is pre-reduced
  int32_t num_max_tokens;
  int32_t hidden;
  int32_t num_experts;
  int32_t num_ranks;
  int32_t failed;  // the dispatch had a bad input somewhere: its combine moves nothing
};

// row_info: (source rank << 14) | (source token << 4) | topk slot.
__host__ __device__ constexpr int32_t pack_row_info(int source, int token, int topk_slot) {
  return (source << 14) | (token << 4) | topk_slot;
}
__host__ __device__ constexpr int row_info_source(int32_t v) {
  return v >> 14;
}
__host__ __device__ constexpr int row_info_token(int32_t v) {
  return (v >> 4) & 1023;
}
__host__ __device__ constexpr int row_info_topk_slot(int32_t v) {
  return v & 15;
}

struct Plan {
  int num_max_tokens = 0;
  int num_ranks = 0;
  int num_local_experts = 0;
  int64_t header = 0;         // PlanHeader
  int64_t recv_count = 0;     // int32 [L]
  int64_t source_tokens = 0;  // int32 [R]: T of each source rank
  int64_t row_info = 0;       // int32 [L][M*R]
  int64_t token_entries = 0;  // int32 [R][M]: rows received for (s, t); 0 = none
  int64_t token_rows = 0;     // int32 [R][M][kMaxTopk]: their row numbers, in top-k order
  int64_t token_weights = 0;  // float [R][M][kMaxTopk]: their weights (with dispatch weights)
  int64_t total = 0;
};

__host__ __device__ inline Plan make_plan(int num_max_tokens, int num_ranks, int num_experts) {
  Plan p;
  p.num_max_tokens = num_max_tokens;
  p.num_ranks = num_ranks;
  p.num_local_experts = num_experts / num_ranks;
  const int64_t M = num_max_tokens, R = num_ranks, L = p.num_local_experts;
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t start = at;
    at = align_up(at + bytes, 128);
    return start;
  };
  p.header = take(sizeof(PlanHeader));
  p.recv_count = take(L * 4);
  p.source_tokens = take(R * 4);
  p.row_info = take(L * M * R * 4);
  p.token_entries = take(R * M * 4);
  p.token_rows = take(R * M * kMaxTopk * 4);
  p.token_weights = take(R * M * kMaxTopk * 4);
  p.total = at;
  return p;
}

}  // namespace turnout::kernels::low_latency
