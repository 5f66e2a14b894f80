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
  int rows_for_rank = -1;    // >= 0: recv_x and recv_x_scales of that rank alone (the others' stay empty)
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
// Internode normal mode (several NVL domains), all ranks at once
//
// R ranks in N = R / D NVL domains of D ranks each: rank r is local index r % D of
// domain r / D. A token crosses the network at most once per destination domain, to
// the rank of its source's local index there (its forwarder), which hands it over
// NVLink to the token's destination ranks of that domain. In the source's own domain
// the source is its own forwarder.
//
// The rows a rank receives, their order (source rank, then source token), top-k,
// per-expert counts and rank_prefix_matrix are what intranode dispatch delivers for
// the same routing: DeepEP's internode dispatch places each row at the source rank's
// prefix plus the source channel's start plus its place in the channel, which is that
// same order. So internode_dispatch takes them from normal_dispatch; what is its own
// is DeepEP's ten-entry handle and the forwarders' view that combine runs backwards.
//
// Channels: channel c of a rank with T tokens holds tokens [T c / C, T (c + 1) / C),
// the split turnout's intranode kernels use (DeepEP's is ceil(T / C)-sized pieces:
// its channel entries equal these where the two splits agree).
//
// Shrink mode (docs/INTERNODE.md "Shrink across domains"): `live` is the call's live
// set, bit r & 31 of word r >> 5 set where rank r takes part ((R + 31) / 32 words;
// empty = every rank, which gives bit for bit the results of a call without it). The
// reference does the reduction, as the GPU call does with the user's full routing:
// a masked rank sends nothing (its input is ignored, unchecked) and receives nothing
// (its column of is_token_in_rank is cleared and, with top-k, the slots of its
// experts become -1). So the rows, per-expert counts and sums are normal_dispatch's
// and normal_combine's of that reduced routing. A masked column n of domain e is
// forwarded there by the next live local index of e, cyclically
// (src/kernels/internode/forwarders.hpp, shared with the kernels); a forwarder serves
// P columns (its own and those it substitutes for), its "parts", in column order.
// Only the forwarders' view ([3], [4], [9] and the forward_* arrays) depends on who
// forwards; rows and sums do not.

struct InternodeParams {
  int num_nvl_ranks = 0;       // D, a divisor of R, at most 32 (a mask bit per local rank)
  int num_channels = 0;        // C of the channel entries; 0 leaves them empty
  std::vector<uint32_t> live;  // the call's live set; empty = every rank
};

// The live set of num_ranks ranks without `masked` (bit r & 31 of word r >> 5).
std::vector<uint32_t> internode_live_set(int num_ranks, const std::vector<int>& masked = {});

// The forwarder plan of a live set (forwarders.hpp, for the Python tests).
struct InternodeForwarders {
  std::vector<int32_t> forwarder;  // [N, D]: local index of the rank of domain e forwarding column n, -1 if none
  std::vector<int32_t> part;       // [N, D]: the part column n uses in that forwarder's rings, -1 if none
  std::vector<int32_t> num_parts;  // [R]: columns rank r forwards (0 when masked)
};
InternodeForwarders internode_forwarders(std::span<const uint32_t> live, int num_ranks, int num_nvl_ranks);

// One rank's result. "Domain" is DeepEP's "RDMA rank". Entries marked [i] are DeepEP's
// handle[i], with DeepEP's meaning wherever the channel split agrees.
struct InternodeDispatchResult {
  NormalDispatchResult normal;  // the user-visible outputs: normal_dispatch's
  int num_nvl_ranks = 0;        // D
  int num_channels = 0;         // C

  // [0] [T, R]: the input, masked ranks' columns cleared (empty on a masked rank);
  // combine's rows. A GPU handle may hold the caller's tensor and clear them as it reads.
  std::vector<uint8_t> is_token_in_rank;
  // [1] [N, C]: this rank's tokens of channels 0..c that reach any rank of domain d.
  std::vector<int32_t> rdma_channel_prefix_matrix;
  // [2] [R, C]: this rank's tokens of channels 0..c that go to rank j.
  std::vector<int32_t> gbl_channel_prefix_matrix;
  // [3] [N x P, C]: row s P + p is the row "my domain" of [1] of the source (s, m), m the
  // column of my part p: tokens it sends to my domain through channels 0..c. Every
  // rank live: P = 1 and m = my local index, DeepEP's [N, C].
  std::vector<int32_t> recv_rdma_channel_prefix_matrix;
  // [4] [N x P]: inclusive prefix over (source domain s, part p) of the tokens this rank
  // forwards from the source (s, m) of part p: those that reach any rank of my domain.
  // The last entry is num_forward. Independent of channels. DeepEP's [N] with every
  // rank live.
  std::vector<int32_t> recv_rdma_rank_prefix_sum;
  // [5] [R, C]: the row where the tokens of source rank j's channel c start here.
  std::vector<int32_t> recv_gbl_channel_prefix_matrix;
  // [6] [R]: inclusive prefix over source ranks j of the tokens j sends here, so the
  // rows of source j are [6][j - 1] .. [6][j]: column r of rank_prefix_matrix, the
  // entry DeepEP users read as handle[-4]. Independent of channels.
  std::vector<int32_t> recv_gbl_rank_prefix_sum;
  // [7] DeepEP: per row (source domain, bits of this domain's local ranks the token
  // reached). Here: the source rank and index are normal.recv_src_rank /
  // recv_src_idx, and the bits this array [num_recv]. Independent of channels.
  std::vector<uint32_t> recv_nvl_mask;
  // [8] [T, N]: token t's place in its channel's stream to domain d (0 for the first
  // token of the channel that reaches d), -1 where t does not reach d.
  std::vector<int32_t> send_rdma_head;
  // [9] [num_forward, D]: forwarded token i's place in its channel's stream to local
  // rank j of this domain, -1 where it does not go to j. The stream is in forward order
  // (below); DeepEP's holds the order its forwarder happened to drain its source
  // domains in, so only the -1 entries compare.
  std::vector<int32_t> send_nvl_head;

  // This rank as a forwarder: the tokens of the sources (s, m), m a column it serves,
  // every domain s, this one included, that reach any rank of this domain. Order:
  // source domain, part, source token, which is source rank, then source token (so
  // channel by channel within a source). Every rank live: m is its own local index.
  int num_parts = 0;  // P: columns it serves (1 with every rank live, 0 when masked)
  int num_forward = 0;
  std::vector<int32_t> forward_src_domain;  // [num_forward]
  std::vector<int32_t> forward_src_rank;    // [num_forward] the source: domain x D + column
  std::vector<int32_t> forward_src_idx;     // [num_forward] token index on the source
  std::vector<uint32_t> forward_nvl_mask;   // [num_forward] bit j: goes to local rank j

  std::vector<uint32_t> live;  // the call's live set, as given or every rank
};

// ranks[r] is rank r's input, as for normal_dispatch; internode.live masks ranks.
std::vector<InternodeDispatchResult> internode_dispatch(std::span<const NormalDispatchInput> ranks,
                                                        const NormalDispatchParams& params,
                                                        const InternodeParams& internode);

// Two-level combine: the forwarder of each (token, domain) sums the rows of the token's
// destination ranks in that domain (local rank order), the source sums those partial
// sums (domain order) and adds the biases. fp64, as normal_combine, which it equals
// without rounding. round_remote_partials: each partial sum of a domain other than the
// source's is rounded to bf16 first, as it crosses the network in bf16 (turnout's
// protocol; DeepEP rounds the source domain's partial too). Then the GPU's result is
// within its fp32 accumulation of double_to_bf16 of this one, unless a partial lies
// on a bf16 rounding boundary.
//
// live: the ranks that take part in the combine, within the dispatch's live set (empty =
// the dispatch's). A rank that took part in the dispatch but not here (it stopped in
// between) has its rows and weights left out of every sum, and no result of its own.
// Ranks outside it may pass anything. Such a rank was also a forwarder: `lost` says
// whether the partial sums of the columns it forwarded still reach their sources
// (kSummed: the sums do not depend on which rank forwards) or are left out too
// (kDropped: those (token, domain) pairs add nothing, as turnout's GPU combine does in
// shrink mode, docs/INTERNODE.md "A rank that stops calling between a dispatch and
// its combine"). A source's own domain never goes through another rank, so only the
// other domains' partials can be dropped.
enum class LostPartials { kSummed, kDropped };
std::vector<NormalCombineResult> internode_combine(std::span<const NormalCombineInput> ranks,
                                                   std::span<const InternodeDispatchResult> dispatch, int hidden,
                                                   int num_topk, bool round_remote_partials, int only_rank = -1,
                                                   std::span<const uint32_t> live = {},
                                                   LostPartials lost = LostPartials::kSummed);

// Network traffic of one dispatch and one combine, per rank: only what crosses between
// domains (the NVLink hops are free here). Signals (channel counts, tails, heads, the
// notify step's counts) are left out: the bytes and puts of token data only.
struct WireCount {
  int64_t bytes = 0;
  int64_t messages = 0;  // puts: per channel and destination, ceil(tokens / chunk_tokens)
};

struct InternodeWireParams {
  int64_t row_bytes = 0;  // dispatch's x row: 2H (bf16) or H (fp8)
  int num_scales = 0;     // fp8 scales per row (H / 128), 0 for bf16
  int num_topk = 0;       // top-k of dispatch, and columns of combine's topk_weights
  int hidden = 0;         // H: combine's rows are bf16 [H]
  int num_nvl_ranks = 0;  // D
  int num_channels = 1;   // C: a put carries tokens of one channel
  int chunk_tokens = 1;   // most tokens one put carries (num_max_rdma_chunked_send_tokens)
  // The call's live set (empty = every rank): masked ranks send and receive nothing, and
  // a substitute forwarder carries its columns' combine traffic, a stream per source
  // (DeepEP's counts follow the same forwarders; DeepEP has no shrink across domains).
  std::vector<uint32_t> live;
};

// Bytes one token takes on the wire. turnout: dispatch = row, scales, top-k ids (int32),
// weights, each 16-byte aligned, and 16 bytes (source token, domain mask); combine =
// bf16 row and the weights, each 16-byte aligned. DeepEP: dispatch = row + 8 (source
// meta) + 4 per scale + 8 per top-k slot, combine = 2H + 8 + 4 per top-k slot, each
// rounded up to 16.
int64_t turnout_dispatch_token_bytes(int64_t row_bytes, int num_scales, int num_topk);
int64_t turnout_combine_token_bytes(int hidden, int num_topk);
int64_t deepep_dispatch_token_bytes(int64_t row_bytes, int num_scales, int num_topk);
int64_t deepep_combine_token_bytes(int hidden, int num_topk);

struct InternodeWire {
  int64_t token_domain_pairs = 0;  // (token, other domain it reaches) of this rank's tokens
  int64_t token_rank_pairs = 0;    // (token, rank of another domain it reaches)
  // turnout and DeepEP: one copy per (token, other domain) to the forwarder, and in
  // combine one partial sum back per (forwarded token of another domain); channels
  // split as turnout's and DeepEP's kernels split them. Per rank: a protocol without
  // forwarding, one copy per (token, destination rank of another domain) and one row
  // back per such received row, channels split as turnout's.
  WireCount dispatch_turnout, dispatch_deepep, dispatch_per_rank;
  WireCount combine_turnout, combine_deepep, combine_per_rank;
};

// Reads num_tokens and is_token_in_rank of each rank's input (the rest may be empty).
std::vector<InternodeWire> internode_wire(std::span<const NormalDispatchInput> ranks,
                                          const InternodeWireParams& params);

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
