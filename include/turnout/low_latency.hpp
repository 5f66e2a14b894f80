// Low-latency mode: dispatch and combine of a few tokens (decoding), a send
// and a receive phase each (one launch, or one per phase), no host sync,
// CUDA-graph safe. On raw device pointers; the Python Buffer is a thin layer
// over these structs.
//
// A token crosses to each rank that holds one of its experts once; the
// receiving rank places it in the rows of each of its experts. In combine an
// expert rank sums its experts' weighted rows of a token and sends that one
// vector back; the weights are the dispatch's where every rank gave them
// there, else each rank's combine weights, which every rank publishes to
// every other at the start of its combine.
//
// Every rank calls with the same M (num_max_tokens), hidden, num_experts and
// num_topk, and makes the same calls in the same order. A dispatch send never
// waits; a combine send waits (bounded by the timeout) only for the weights of
// the ranks whose tokens it sums; receives wait for the sends of every rank.
// The low-latency part of a buffer keeps two of each op's receive areas, used
// in turn: a receive must run before the same op's send two calls later on
// any rank.
#pragma once

#include <cstddef>
#include <cstdint>

namespace turnout {

inline constexpr int kLowLatencyMaxTopk = 16;
inline constexpr int kLowLatencyMaxTokens = 1024;
inline constexpr int kLowLatencyMaxExperts = 1024;
inline constexpr int kLowLatencyMaxHidden = 16384;
// FP8 scales cover this many channels of a row.
inline constexpr int kLowLatencyScaleGroup = 128;

// Bytes of low-latency buffer (BufferOptions::num_rdma_bytes) that calls of
// this shape need; get_low_latency_rdma_size_hint is this at top-k 16.
size_t low_latency_required_bytes(int num_max_tokens, int hidden, int num_ranks, int num_topk);
// Bytes of the plan a dispatch writes and its combine reads (caller-owned,
// 16-byte aligned, no zeroing needed).
size_t low_latency_plan_bytes(int num_max_tokens, int num_ranks, int num_experts);

// Where calls of this shape keep, in each rank's low-latency region, the
// message slots a dispatch writes (slot [source][token] of parity p at
// dispatch_slots[p] + (source * M + token) * message_bytes) and the combine
// weights the sources publish (8 bytes each, [source][token][top-k slot] of
// parity p at weights[p] + ((source * M + token) * kLowLatencyMaxTopk + k) * 8).
// Areas move with the shape; tests use this to put an earlier shape's words
// where a later call reads.
struct LowLatencyRegionOffsets {
  int64_t message_bytes = 0;
  int64_t dispatch_slots[2] = {};
  int64_t weights[2] = {};
};
LowLatencyRegionOffsets low_latency_region_offsets(int num_max_tokens, int hidden, int num_ranks);

// Which part of an op to launch: both (one after the other on the stream),
// or the send now and the receive later (a receive hook).
enum class LowLatencyPhase { kSendAndReceive, kSend, kReceive };

// Outputs are [L, M*R, ...] per local expert (L = num_experts / R), rows past
// recv_count[l] unwritten. A receive launched by itself gets the same args as
// its send.
struct LowLatencyDispatchArgs {
  const void* x = nullptr;            // [T, hidden] bf16, rows 16-byte aligned
  int num_tokens = 0;                 // T <= num_max_tokens
  int hidden = 0;                     // multiple of 8; of 128 with use_fp8
  const int64_t* topk_idx = nullptr;  // [T, K] global expert ids, -1 = none
  int num_topk = 0;                   // K in 1..kLowLatencyMaxTopk
  // Optional [T, K]: combine sums with these, and reads none of its own, if
  // every rank with tokens gives them (else every combine publishes its own).
  const float* topk_weights = nullptr;
  int num_max_tokens = 0;  // M
  int num_experts = 0;     // E, a multiple of R
  bool use_fp8 = false;
  bool round_scale = false;  // FP8 scales rounded up to powers of two
  bool use_ue8m0 = false;    // needs round_scale: packed exponent bytes instead of float scales

  void* recv_x = nullptr;  // [L, M*R, hidden] bf16, or e4m3 bytes with use_fp8
  // [L, M*R, hidden / 128] float, column-major in the last two dims: element
  // (l, row, g) at l * M*R * G + g * M*R + row. With use_fp8 and not use_ue8m0.
  float* recv_scales = nullptr;
  // [L, M*R, ceil(G / 4)] int32, column-major like recv_scales: byte i of
  // (l, row, j) is the biased exponent of group 4j + i (0 past G). With use_ue8m0.
  int32_t* recv_packed_scales = nullptr;
  int32_t* recv_count = nullptr;                          // [L]
  int32_t* src_info = nullptr;                            // [L, M*R] source token of each row
  int64_t* layout_range = nullptr;                        // [L, R] (begin << 32) | count of each source rank's rows
  void* plan = nullptr;                                   // low_latency_plan_bytes, for combine
  int32_t* cumulative_local_expert_recv_stats = nullptr;  // optional [L], += recv_count
  int64_t* wait_recv_cost_stats = nullptr;                // optional [R], += ns waited per source rank
};

struct LowLatencyCombineArgs {
  const void* x = nullptr;              // [L, M*R, hidden] bf16, rows as dispatch placed them
  const int64_t* topk_idx = nullptr;    // [T, K] this rank's dispatch's
  const float* topk_weights = nullptr;  // [T, K]; unread when the dispatch had weights
  int num_tokens = 0;
  int num_topk = 0;
  int hidden = 0;
  int num_max_tokens = 0;
  int num_experts = 0;
  const void* plan = nullptr;  // the dispatch's
  // LogFMT-10 (hidden a multiple of 128): a group of 128 channels whose
  // largest magnitude amax is below 1 crosses as 10 bits a value (a sign and
  // a 9-bit code: zero, or the nearest of 511 levels evenly spaced in log2
  // from the smallest nonzero magnitude amin, at least amax / 2^32, to amax)
  // plus bf16 (amax, amin); other groups cross as bf16. 164 bytes per cast
  // group, 260 per bf16 group: never more than DeepEP's LogFMT. Per value
  // |error| <= |v| ((2^s - 1) / 2 + 2^-18), s = log2(amax / amin) / 510
  // (under 2.3% of |v|); below amax / 2^32 at most min(|v|, amax / 2^33);
  // bf16 groups, zeros and groups of one magnitude exact.
  bool use_logfmt = false;
  void* out = nullptr;                      // [T, hidden] bf16
  int64_t* wait_recv_cost_stats = nullptr;  // optional [R]
};

}  // namespace turnout
