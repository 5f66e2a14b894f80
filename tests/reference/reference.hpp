// Host reference ("oracle") of every op, for all ranks at once: plain loops that
// GPU tests compare the kernels against. No CUDA, no threads.
//
// Conventions: arrays are flat std::vector, row-major, shapes given in comments.
// bf16 values are uint16_t bit patterns, fp8 e4m3 values uint8_t, expert ids int64_t
// (-1 = empty top-k slot). R ranks, E experts, L = E / R local experts per rank;
// expert e lives on rank e / L. Bad input throws std::invalid_argument naming the
// argument.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace turnout::reference {

// ---------------------------------------------------------------------------
// Number formats

// Round to nearest even, like __float2bfloat16_rn; NaN stays NaN (quiet, sign kept).
uint16_t float_to_bf16(float x);
float bf16_to_float(uint16_t bits);
// One rounding straight from double, so fp64 sums round like the GPU's final store.
uint16_t double_to_bf16(double x);

// e4m3fn with round to nearest even and saturation to +-448 (inf too); any NaN -> 0x7F.
uint8_t float_to_e4m3(float x);
float e4m3_to_float(uint8_t bits);

// ---------------------------------------------------------------------------
// FP8 per-128-channel cast of one token row

struct Fp8Row {
  std::vector<uint8_t> q;               // [H] e4m3
  std::vector<float> scales;            // [H / 128]; x ~= q * scale per group
  std::vector<uint32_t> packed_scales;  // [H / 512] only with use_ue8m0: byte j (bits 8j..8j+7)
                                        // of word i = biased exponent of group 4i+j's scale
};

// x: [H] bf16, H % 128 == 0. amax is floored at 1e-4 so an all-zero group gets a finite
// scale. round_scale: scale = smallest power of two >= amax / 448. use_ue8m0 needs
// round_scale and H % 512 == 0 (no padding of a partial word).
Fp8Row cast_row_to_fp8(std::span<const uint16_t> x, bool round_scale, bool use_ue8m0);

// ---------------------------------------------------------------------------
// LogFMT-10, low-latency combine's use_logfmt format, of one bf16 row (H % 128 == 0)

// Bytes the format puts on the wire for the row: per 128-channel group 160 if its
// largest magnitude is below 1 (cast), else 256 (bf16), plus 4 bytes of meta.
int64_t logfmt_row_bytes_ours(std::span<const uint16_t> x);
// DeepEP's LogFMT bytes for the same row: casting is decided per chunk of 1024 channels
// (512 where H % 1024 != 0): a chunk casts iff each of its groups has amax < 1 and
// amin < amax, amin the smallest magnitude zeros included; same bytes per group.
int64_t logfmt_row_bytes_deepep(std::span<const uint16_t> x);
// Per value, the most |decoded - x| the format's bound allows ([H]): 0 in bf16 groups,
// for zeros and in groups of one magnitude; otherwise, with amin the smallest nonzero
// magnitude, a' = max(amin, amax / 2^32), s = log2(amax / a') / 510:
// |x| ((2^s - 1) / 2 + 2^-18) where |x| >= a', min(|x|, a' / 2) below, each + 2^-150.
std::vector<double> logfmt_error_bound(std::span<const uint16_t> x);

// ---------------------------------------------------------------------------
// get_dispatch_layout, for one rank

struct DispatchLayout {
  std::vector<int32_t> num_tokens_per_rank;       // [R]
  std::vector<int32_t> num_tokens_per_rdma_rank;  // [R / num_nvl_ranks], always filled
  std::vector<int32_t> num_tokens_per_expert;     // [E], a duplicate id in a row counts once
  std::vector<uint8_t> is_token_in_rank;          // [T, R], 0 or 1
};

// topk_idx: [num_tokens, num_topk] global expert ids in [-1, E).
DispatchLayout get_dispatch_layout(std::span<const int64_t> topk_idx, int num_tokens, int num_topk, int num_ranks,
                                   int num_experts, int num_nvl_ranks);

// Throws unless every id is in [-1, num_experts) and E is a positive multiple of R;
// `arg` names the tensor in the message.
void check_expert_ids(std::span<const int64_t> topk_idx, int num_experts, int num_ranks, const char* arg);

// ---------------------------------------------------------------------------
// Normal (intranode / internode) dispatch and combine, all ranks at once

// What one rank passes to dispatch.
struct NormalDispatchInput {
  int num_tokens = 0;                     // T
  std::vector<uint8_t> x;                 // [T, row_bytes], moved as opaque bytes (bf16 or fp8)
  std::vector<float> x_scales;            // [T, num_scales] row-major, when num_scales > 0
  std::vector<int64_t> topk_idx;          // [T, K] global ids, when num_topk > 0
  std::vector<float> topk_weights;        // [T, K], when num_topk > 0
  std::vector<uint8_t> is_token_in_rank;  // [T, R], 0 or 1
};

struct NormalDispatchParams {
  int64_t row_bytes = 0;     // bytes of one x row (2H for bf16, H for fp8)
  int num_scales = 0;        // floats per row of x_scales; 0 = no scales
  int num_topk = 0;          // K; 0 = no top-k (then no top-k outputs, no per-expert counts)
  int num_experts = 0;       // E; needed only with top-k
  int expert_alignment = 1;  // per-expert counts are rounded up to a multiple of this
};

// What one rank r gets back. Rows are ordered by source rank, then source token index.
struct NormalDispatchResult {
  int num_tokens = 0;  // r's own T as a source: combine's output rows
  int num_recv = 0;
  std::vector<uint8_t> recv_x;                      // [num_recv, row_bytes]
  std::vector<float> recv_x_scales;                 // [num_recv, num_scales]
  std::vector<int64_t> recv_topk_idx;               // [num_recv, K] local ids e - r*L, -1 if not on r
  std::vector<float> recv_topk_weights;             // [num_recv, K], 0 where the id is -1
  std::vector<int32_t> recv_src_rank;               // [num_recv]
  std::vector<int32_t> recv_src_idx;                // [num_recv] token index on the source rank
  std::vector<int32_t> num_recv_tokens_per_expert;  // [L] aligned; empty without top-k
  std::vector<int32_t> rank_prefix_matrix;          // [R, R]: [i][j] = tokens j gets from ranks 0..i
};

// ranks[r] is rank r's input; R = ranks.size().
std::vector<NormalDispatchResult> normal_dispatch(std::span<const NormalDispatchInput> ranks,
                                                  const NormalDispatchParams& params);

// What one rank passes to combine.
struct NormalCombineInput {
  std::vector<uint16_t> x;          // [num_recv, H] bf16 in this rank's dispatch order
  std::vector<float> topk_weights;  // [num_recv, K], when num_topk > 0
  std::vector<uint16_t> bias0;      // [T, H] bf16 on this rank as a source; empty = none
  std::vector<uint16_t> bias1;      // second bias of a tuple; empty = none
};

// fp64 sums (exact for a few bf16 terms); double_to_bf16 gives what the GPU should store,
// up to its fp32 accumulation.
struct NormalCombineResult {
  std::vector<double> combined_x;             // [T, H]: sum over receiving ranks + biases
  std::vector<double> combined_topk_weights;  // [T, K], when num_topk > 0
};

// dispatch: the result of normal_dispatch that produced the receive order of ranks[r].x.
// only_rank >= 0: compute that rank's result alone (the others stay empty), which
// is what one rank of a test needs: 1/R of the sums.
std::vector<NormalCombineResult> normal_combine(std::span<const NormalCombineInput> ranks,
                                                std::span<const NormalDispatchResult> dispatch, int hidden,
                                                int num_topk, int only_rank = -1);

// ---------------------------------------------------------------------------
// Low-latency dispatch and combine, all ranks at once

struct LowLatencyDispatchInput {
  int num_tokens = 0;             // T <= num_max_dispatch_tokens_per_rank
  std::vector<uint16_t> x;        // [T, H] bf16
  std::vector<int64_t> topk_idx;  // [T, K] global ids
};

struct LowLatencyParams {
  int num_max_dispatch_tokens_per_rank = 0;  // M
  int hidden = 0;                            // H
  int num_experts = 0;                       // E
  int num_topk = 0;                          // K
  bool use_fp8 = false;
  bool round_scale = false;  // used only with use_fp8
  bool use_ue8m0 = false;    // used only with use_fp8; always needs round_scale
};

// The rows one local expert received, compact (no padding to M*R). Canonical order:
// source rank ascending, then source token ascending. The GPU may order rows inside one
// source rank's group freely: put its rows in this order with low_latency_canonical_order.
struct LowLatencyExpertRecv {
  std::vector<int32_t> src_rank;        // [n]
  std::vector<int32_t> src_token;       // [n] the GPU's src_info
  std::vector<uint16_t> x;              // [n, H] bf16, without use_fp8
  std::vector<uint8_t> x_fp8;           // [n, H] e4m3, with use_fp8
  std::vector<float> scales;            // [n, H / 128] row-major, with use_fp8 (ue8m0 too)
  std::vector<uint32_t> packed_scales;  // [n, H / 512], with use_ue8m0
};

struct LowLatencyDispatchResult {
  std::vector<int32_t> recv_count;            // [L]
  std::vector<int64_t> layout_range;          // [L, R] (begin << 32) | count, begin = row
                                              // offset of that source rank's group
  std::vector<LowLatencyExpertRecv> experts;  // [L]
};

// A token whose row names expert e twice is received once by e.
std::vector<LowLatencyDispatchResult> low_latency_dispatch(std::span<const LowLatencyDispatchInput> ranks,
                                                           const LowLatencyParams& params);

// For one GPU expert: src_info [>= recv_count] and its layout_range row [R]. Returns perm
// with perm[i] = the GPU row holding canonical row i (groups by source rank ascending,
// tokens ascending inside). Throws if the ranges overlap or leave rows of
// [0, recv_count) uncovered, or a group repeats a token.
std::vector<int32_t> low_latency_canonical_order(std::span<const int32_t> src_info,
                                                 std::span<const int64_t> layout_range, int recv_count);

struct LowLatencyCombineInput {
  std::vector<std::vector<uint16_t>> expert_x;  // [L][n_l, H] bf16, rows in this rank's
                                                // (canonical) dispatch order
  std::vector<int64_t> topk_idx;                // [T, K] this rank's own tokens, as dispatched
  std::vector<float> topk_weights;              // [T, K]
};

// combined_x per rank: [T, H] = sum_k w[t,k] * x[expert topk_idx[t,k]][row of t], in fp64,
// k ascending. Only num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk of
// params are used.
std::vector<std::vector<double>> low_latency_combine(std::span<const LowLatencyCombineInput> ranks,
                                                     std::span<const LowLatencyDispatchResult> dispatch,
                                                     const LowLatencyParams& params);

}  // namespace turnout::reference
