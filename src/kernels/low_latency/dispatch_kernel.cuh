// Low-latency dispatch, one kernel (dispatch_kernel) whose launch runs the
// send phase, the receive phase or both. The send writes each token, once per
// rank that holds one of its experts, into the token's message slot in that
// rank's region, and adds the token to that rank's count of each of its
// experts there and sets its bit in that expert's token bits; then each block
// adds to every rank's arrival counter. The receive waits for every source's
// arrivals and places the messages into the rows of each local expert. A
// send never waits; a rank alone on its GPU runs both phases in one launch
// (one launch less), where a block's receive waits for the sends of the
// rank's own blocks too.
//
// Send: a block's tokens are t = block + j * blocks. Its warps form teams,
// one token per team at a time; with fewer tokens than warps a team has
// several warps, so a few tokens still keep every warp loading. A team reads
// the row once, casts it in registers (FP8), and stores it to every
// destination; its lead warp also writes the headers and counts, and (FP8)
// the row's scales, which the team's warps gather in shared memory. Where the
// row has fewer units than the team has warps, the lead is a warp with no
// unit, so no warp both casts and builds headers.
//
// Receive: every block scans the counts of all (expert, source) pairs into
// row offsets; rows are in (expert, source, token) order. Where the call's
// token bits fit, the block copies them to shared memory in the same round.
// The message slots are spread over every warp of the grid, one slot a warp:
// a message's row for expert l is the pair's first row plus the bits of l
// below its token, so the warp reads the row once and stores it to each of
// its experts' rows.
//
// A template on the transport (transport.cuh): src/kernels/low_latency/
// dispatch.cu instantiates it on NVLink, the NVSHMEM library on NVSHMEM. A
// destination out of load/store reach (far) gets the token's header and
// payload staged once in this rank's region, then put by the team's first
// warp; the receive reads only local memory, so it is the same for both.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/device/bounded_wait.cuh"
#include "kernels/device/dependent_launch.cuh"
#include "kernels/device/error_record.cuh"
#include "kernels/device/fp8_cast.cuh"
#include "kernels/device/memory_order.cuh"
#include "kernels/device/rank_mask.cuh"
#include "kernels/device/vector_copy.cuh"
#include "kernels/low_latency/call_counter.cuh"
#include "kernels/low_latency/grid.hpp"
#include "kernels/low_latency/launch.hpp"
#include "kernels/low_latency/peer_set.cuh"
#include "kernels/low_latency/stamps.cuh"
#include "kernels/low_latency/transport.cuh"
#include "turnout/error.hpp"

namespace turnout::kernels::low_latency {
namespace {
namespace dispatch_body {

// Many warps, so that a few tokens still spread over a block. Send and
// receive take the same block, so that one kernel can run both.
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kHeaderWords = sizeof(MessageHeader) / 16;
// Send: a warp takes a row in units of 64 words (512 channels, four scale
// groups), two words a lane, and loads this many units before it stores.
constexpr int kUnitWords = 64;
constexpr int kUnitsPerPass = 4;
// Receive: 16-byte words a lane has in flight while copying a row (within
// the 128 registers a 512-thread block leaves a thread).
constexpr int kCopyWords = 8;

static_assert(sizeof(MessageHeader) % 16 == 0);
static_assert(offsetof(FixedArea, counts) % 16 == 0 && kMaxLocalExperts % 4 == 0, "counts are zeroed in 16-byte words");
static_assert(offsetof(FixedArea, token_bits) % 16 == 0 && kTokenBitsWords % 4 == 0,
              "token bits are zeroed in 16-byte words");
// The count scan: (expert, source) pairs a thread.
constexpr int kPairsPerThread = (kLowLatencyMaxExperts + kThreads - 1) / kThreads;
// Shared memory the send's headers use and, after them, the receive's copy of
// the call's token bits where they fit: one 16-byte word a thread.
constexpr int kScratchBytes = kWarps * kLowLatencyMaxTopk * static_cast<int>(sizeof(MessageHeader));
constexpr int kSharedBitsWords = 4 * kThreads;
static_assert(kSharedBitsWords * 4 <= kScratchBytes);
static_assert(kLowLatencyMaxHidden / kScaleGroup <= 4 * 32, "a row's scales are at most one 16-byte word a lane");
// A row's scales in 16-byte words (four groups a word): a team's two rows of
// them fit in one warp's header space.
constexpr int kMaxScaleWords = kLowLatencyMaxHidden / kScaleGroup / 4;
static_assert(2 * kMaxScaleWords * 16 <= kLowLatencyMaxTopk * static_cast<int>(sizeof(MessageHeader)));
// A token's destinations are lane masks over its top-k slots (lanes below
// kLowLatencyMaxTopk); the bit above stands for this rank's staging area.
constexpr int kStageTarget = 31;
static_assert(kLowLatencyMaxTopk < kStageTarget);

struct LowLatencyDispatchParams {
  LowLatencyDispatchArgs args;
  Region region;
  Group group;
  Plan plan;
};

// Where source `source`'s signal of parity `parity` lies in a region.
__host__ __device__ constexpr int64_t signal_offset(int parity, int source) {
  return static_cast<int64_t>(offsetof(FixedArea, dispatch)) +
         (static_cast<int64_t>(parity) * kMaxGroupRanks + source) * static_cast<int64_t>(sizeof(DispatchSignal));
}

// Where source `source`'s counts of set `set` lie in a region (L experts a rank).
__host__ __device__ constexpr int64_t counts_offset(int set, int source, int experts_per_rank) {
  return static_cast<int64_t>(offsetof(FixedArea, counts)) +
         (static_cast<int64_t>(set) * kLowLatencyMaxExperts + static_cast<int64_t>(source) * experts_per_rank) *
             static_cast<int64_t>(sizeof(int32_t));
}

// Where source `source`'s token bits of set `set` lie in a region (L experts a
// rank, `words` words a pair).
__host__ __device__ constexpr int64_t token_bits_offset(int set, int source, int experts_per_rank, int words) {
  return static_cast<int64_t>(offsetof(FixedArea, token_bits)) +
         (static_cast<int64_t>(set) * kTokenBitsWords + static_cast<int64_t>(source) * experts_per_rank * words) *
             static_cast<int64_t>(sizeof(uint32_t));
}

// The index of the n-th set bit of m (n from 0; m has more than n).
__device__ __forceinline__ int nth_set_bit(unsigned m, int n) {
  for (; n > 0; --n) m &= m - 1;
  return __ffs(static_cast<int>(m)) - 1;
}

// ---------------------------------------------------------------------------
// Send

// One token per team at a time: as many teams as the block has tokens (a
// power of two, at most one a warp).
struct Teams {
  int count;  // divides kWarps
  int warps;  // per team
};

__device__ __forceinline__ Teams token_teams(int num_tokens) {
  const int blocks = static_cast<int>(gridDim.x);
  const int per_block = (num_tokens + blocks - 1) / blocks;
  int count = 1;
  while (count < per_block && count < kWarps) count *= 2;
  return {count, kWarps / count};
}

// A row of `hidden` channels in units of kUnitWords bf16 words.
__host__ __device__ constexpr int row_units(int hidden) {
  return (hidden / 8 + kUnitWords - 1) / kUnitWords;
}

// The member of each team that writes the headers, counts and scales: the
// last, which loads no unit, where the row has fewer units than a team has
// warps; else the first.
__device__ __forceinline__ int team_lead(const Teams& teams, int units) {
  return units < teams.warps ? teams.warps - 1 : 0;
}

// What one warp loads of a bf16 row before it stores: units first, first +
// stride, ..., words unit * 64 + lane (lo) and + 32 (hi) of each; zeros past
// the row.
struct RowPass {
  int4 lo[kUnitsPerPass];
  int4 hi[kUnitsPerPass];
};

__device__ __forceinline__ RowPass load_pass(const int4* row, int n16, int first, int stride, int lane) {
  RowPass pass;
#pragma unroll
  for (int u = 0; u < kUnitsPerPass; ++u) {
    const int w = (first + u * stride) * kUnitWords + lane;
    pass.lo[u] = w < n16 ? device::load_input_16(row + w) : make_int4(0, 0, 0, 0);
    pass.hi[u] = w + 32 < n16 ? device::load_input_16(row + w + 32) : make_int4(0, 0, 0, 0);
  }
  return pass;
}

// Where a payload goes for bit k of a target mask: the slot of the rank that
// top-k slot k names (`rank`, lane k's), or this rank's staging area
// (kStageTarget). Warp-wide.
template <class Transport>
__device__ __forceinline__ char* payload_target(const Transport& tr, int k, int rank, int64_t payload, char* stage) {
  const int d = __shfl_sync(~0u, rank, k & 31);
  if constexpr (Transport::kReachesFar) {
    if (k == kStageTarget) return stage;
  }
  return tr.direct(d) + payload;
}

template <class Transport>
__device__ __forceinline__ void put_bf16_pass(const Transport& tr, unsigned targets, int rank, int64_t payload,
                                              char* stage, const RowPass& pass, int n16, int first, int stride,
                                              int lane) {
  for (unsigned m = targets; m; m &= m - 1) {
    char* base = payload_target(tr, __ffs(m) - 1, rank, payload, stage);
#pragma unroll
    for (int u = 0; u < kUnitsPerPass; ++u) {
      const int w = (first + u * stride) * kUnitWords + lane;
      if (w < n16) device::store_16(base + 16 * static_cast<int64_t>(w), pass.lo[u]);
      if (w + 32 < n16) device::store_16(base + 16 * static_cast<int64_t>(w + 32), pass.hi[u]);
    }
  }
}

// A unit's four scale groups are lo lanes 0-15, lo 16-31, hi 0-15, hi 16-31.
// Its e4m3 bytes (512) go out as one 16-byte word a lane: a lane swaps half
// its bytes with its neighbour, so even lanes hold lo words lane, lane + 1 and
// odd lanes hi words lane - 1, lane. Lane 0 writes the unit's four scales
// (zeros past the row's groups) to the team's row of scales, `scale_row`.
template <class Transport>
__device__ __forceinline__ void put_fp8_pass(const Transport& tr, unsigned targets, int rank, int64_t payload,
                                             char* stage, const RowPass& pass, int4* scale_row, int hidden,
                                             bool round_scale, int first, int stride, int lane) {
  const int n16 = hidden / 8, num_groups = hidden / kScaleGroup;
  const bool odd = lane & 1;
  int4 bytes[kUnitsPerPass];
#pragma unroll
  for (int u = 0; u < kUnitsPerPass; ++u) {
    const device::Fp8Scale lo =
        device::fp8_scale(device::group_max<16>(device::abs_max_bf16x8(pass.lo[u])), round_scale);
    const device::Fp8Scale hi =
        device::fp8_scale(device::group_max<16>(device::abs_max_bf16x8(pass.hi[u])), round_scale);
    const uint2 q_lo = device::bf16x8_to_e4m3(pass.lo[u], lo.inv);
    const uint2 q_hi = device::bf16x8_to_e4m3(pass.hi[u], hi.inv);
    const uint2 give = odd ? q_lo : q_hi;
    const uint2 got = make_uint2(__shfl_xor_sync(~0u, give.x, 1), __shfl_xor_sync(~0u, give.y, 1));
    const uint2 first_half = odd ? got : q_lo, second_half = odd ? q_hi : got;
    bytes[u] = make_int4(static_cast<int>(first_half.x), static_cast<int>(first_half.y),
                         static_cast<int>(second_half.x), static_cast<int>(second_half.y));
    const float s1 = __shfl_sync(~0u, lo.scale, 16), s3 = __shfl_sync(~0u, hi.scale, 16);
    const int unit = first + u * stride, g = unit * 4;
    if (lane == 0 && unit * kUnitWords < n16)
      scale_row[unit] = make_int4(__float_as_int(lo.scale), __float_as_int(g + 1 < num_groups ? s1 : 0.0f),
                                  __float_as_int(g + 2 < num_groups ? hi.scale : 0.0f),
                                  __float_as_int(g + 3 < num_groups ? s3 : 0.0f));
  }
  for (unsigned m = targets; m; m &= m - 1) {
    char* base = payload_target(tr, __ffs(m) - 1, rank, payload, stage);
#pragma unroll
    for (int u = 0; u < kUnitsPerPass; ++u) {
      const int unit = first + u * stride;
      // A group is 16 words, so both words of a lane's pair are in the row or neither.
      if (unit * kUnitWords + (odd ? 32 : 0) + lane < n16)
        device::store_16(base + 16 * (static_cast<int64_t>(unit) * 32 + (odd ? 16 : 0) + lane / 2), bytes[u]);
    }
  }
}

// The warps of a team meet (a named barrier; a warp alone syncs itself).
__device__ __forceinline__ void team_sync(int team, int team_warps) {
  if (team_warps == 1)
    __syncwarp();
  else
    asm volatile("bar.sync %0, %1;" ::"r"(1 + team), "r"(32 * team_warps) : "memory");
}

// Once every warp of the team has written its units' scales: the team's
// lead stores the row's scales (`units` 16-byte words) to every target in one
// store each, rather than a 16-byte store per unit from each warp.
template <class Transport>
__device__ __forceinline__ void put_fp8_scales(const Transport& tr, unsigned targets, int rank, int64_t payload,
                                               char* stage, const int4* scale_row, int hidden, int units, int team,
                                               bool lead, int team_warps, int lane) {
  team_sync(team, team_warps);
  if (!lead) return;
  const int4 v = lane < units ? scale_row[lane] : make_int4(0, 0, 0, 0);
  for (unsigned m = targets; m; m &= m - 1) {
    char* base = payload_target(tr, __ffs(m) - 1, rank, payload, stage);
    if (lane < units) device::store_16(base + hidden + 16 * static_cast<int64_t>(lane), v);
  }
}

// Out of line: the rare path stays out of the token loop. Every destination
// learns that this call of this rank had a bad input, before the block arrives.
template <class Transport>
__device__ __noinline__ void report_invalid_expert(const LowLatencyDispatchParams& p, const Transport& tr, uint32_t seq,
                                                   int parity, int token, int slot, int64_t expert, PeerSet live) {
  device::record_error(p.group.wait.errors, DeviceErrorCode::kInvalidExpert, p.group.wait.rank, slot, 0, token, expert);
  for (int d = 0; d < p.group.num_ranks; ++d)
    if (live.has(d)) tr.set_word(d, signal_offset(parity, p.group.rank) + offsetof(DispatchSignal, bad_call), seq);
}

// The lead warp of a team: each destination's header, built in this warp's
// shared memory (lane k fills the entry of top-k slot k when k is the first
// slot naming its expert; header i is the i-th destination of `dests`) and
// put as 16-byte words (a far destination's into its staged header, at
// `staged` + i headers); and, for each distinct expert, one more token in its
// destination's count and the token's bit in its token bits (`bit_words` a pair).
// `dests`: the first slot of each destination rank that is sent to; `far`:
// those out of load/store reach.
template <class Transport>
__device__ __forceinline__ void put_headers(const Transport& tr, MessageHeader* headers, int64_t counts, int64_t bits,
                                            int bit_words, uint32_t seq, int token, int64_t slot, int64_t staged,
                                            int expert, float weight, int num_topk, int experts_per_rank,
                                            const TokenRanks& ranks, unsigned dests, unsigned far, int lane) {
  const unsigned below = (1u << lane) - 1;
  const bool named = expert >= 0;
  const unsigned same = __match_any_sync(~0u, named ? expert : -1 - lane);
  const bool first = named && (same & below) == 0;
  // A repeated expert weighs the sum of its slots' weights, k ascending.
  float sum = weight;
  if (__any_sync(~0u, named && same != 1u << lane)) {
    for (int k = 0; k < num_topk; ++k) {
      const float w = __shfl_sync(~0u, weight, k);
      if (first && k > lane && (same >> k & 1)) sum += w;
    }
  }
  // The first slot naming this lane's rank stands for it in `dests`.
  const unsigned same_rank = __match_any_sync(~0u, named ? ranks.rank : -1 - lane);
  const int leader = __ffs(static_cast<int>(same_rank)) - 1;
  const bool sent = first && (dests >> leader & 1);
  const unsigned peers = __match_any_sync(~0u, sent ? ranks.rank : -1 - lane);
  if (sent) {
    MessageHeader& h = headers[__popc(dests & ((1u << leader) - 1))];
    const int j = __popc(peers & below);
    const int local_expert = expert - ranks.rank * experts_per_rank;
    h.local_expert[j] = static_cast<int16_t>(local_expert);
    h.slots[j] = static_cast<uint16_t>(same);  // lanes past the top-k name nothing, so only slots < K
    h.weight[j] = sum;
    if (j == 0) {
      h.seq = seq;
      h.token = token;
      h.num_entries = __popc(peers);
      h.pad = 0;
    }
    tr.add(ranks.rank, counts + 4 * static_cast<int64_t>(local_expert), 1);
    tr.set_bits(ranks.rank, bits + 4 * (static_cast<int64_t>(local_expert) * bit_words + token / 32),
                1u << (token % 32));
  }
  __syncwarp();
  const int words = __popc(dests) * kHeaderWords;
  for (int base = 0; base < words; base += 32) {
    const int i = base + lane, index = i < words ? i / kHeaderWords : 0, w = i % kHeaderWords;
    const int k = nth_set_bit(dests, index);
    const int d = __shfl_sync(~0u, ranks.rank, k);
    if (i >= words) continue;
    const int4 word = reinterpret_cast<const int4*>(&headers[index])[w];
    if (far >> k & 1)
      device::store_16(tr.local() + staged + static_cast<int64_t>(sizeof(MessageHeader)) * index + 16 * w, word);
    else
      tr.put_16(d, slot + 16 * w, word);
  }
  __syncwarp();  // the next token's entries overwrite these
}

// Warp `member` of a team of `team_warps` (its lead among them) sends token t
// to the ranks of `live` that hold one of its experts.
template <class Transport>
__device__ __forceinline__ void send_token(const LowLatencyDispatchParams& p, const Transport& tr,
                                           MessageHeader* headers, int4* scale_row, uint32_t seq, int parity, int set,
                                           int t, int team, int member, int team_warps, bool lead, int lane,
                                           PeerSet live) {
  const LowLatencyDispatchArgs& a = p.args;
  const int K = a.num_topk, E = a.num_experts, H = a.hidden;
  const int n16 = H / 8, units = row_units(H);
  const int4* row = reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + static_cast<int64_t>(t) * H * 2);
  int64_t id = -1;
  float weight = 0.0f;
  if (lane < K) {
    id = __ldg(a.topk_idx + static_cast<int64_t>(t) * K + lane);
    if (lead && a.topk_weights != nullptr) weight = __ldg(a.topk_weights + static_cast<int64_t>(t) * K + lane);
  }
  // The first pass's loads go out with the top-k ones rather than after them.
  RowPass pass = load_pass(row, n16, member, team_warps, lane);
  const unsigned bad = __ballot_sync(~0u, id < -1 || id >= E);
  stamp(3, true);
  if (bad != 0) {
    if (lead && lane == __ffs(bad) - 1) report_invalid_expert(p, tr, seq, parity, t, lane, id, live);
    return;
  }
  const int expert = static_cast<int>(id);
  const int L = E / p.group.num_ranks;
  const TokenRanks ranks = token_ranks(expert, L, lane);
  const unsigned dests = __ballot_sync(~0u, ranks.rank >= 0 && live.has(ranks.rank)) & ranks.firsts;
  if (dests == 0) return;
  unsigned far = 0;
  if constexpr (Transport::kReachesFar) far = __ballot_sync(~0u, ranks.rank >= 0 && tr.is_far(ranks.rank)) & dests;
  const int64_t slot = p.region.dispatch_slot(parity, p.group.rank, t);
  const int64_t staged = p.region.header_stage_slot(parity, t, 0);
  if (lead)
    put_headers(tr, headers, counts_offset(set, p.group.rank, L),
                token_bits_offset(set, p.group.rank, L, token_words(a.num_max_tokens)), token_words(a.num_max_tokens),
                seq, t, slot, staged, expert, weight, K, L, ranks, dests, far, lane);
  constexpr int64_t kHeaderBytes = sizeof(MessageHeader);
  const int64_t payload = slot + kPayloadOffset;
  char* stage = tr.local() + p.region.dispatch_stage_slot(parity, t) + kPayloadOffset;
  const unsigned targets = (dests & ~far) | (far != 0 ? 1u << kStageTarget : 0u);
  for (int first = member; first < units; first += kUnitsPerPass * team_warps) {
    if (first != member) pass = load_pass(row, n16, first, team_warps, lane);
    if (a.use_fp8)
      put_fp8_pass(tr, targets, ranks.rank, payload, stage, pass, scale_row, H, a.round_scale, first, team_warps, lane);
    else
      put_bf16_pass(tr, targets, ranks.rank, payload, stage, pass, n16, first, team_warps, lane);
  }
  if (a.use_fp8)
    put_fp8_scales(tr, targets, ranks.rank, payload, stage, scale_row, H, units, team, lead, team_warps, lane);
  stamp(4, true);
  if constexpr (Transport::kReachesFar) {
    if (far == 0) return;
    // The team's stores to the stage come before its lead's puts. With FP8
    // the team met in put_fp8_scales already: only the lead's scales remain.
    if (a.use_fp8)
      __syncwarp();
    else
      team_sync(team, team_warps);
    if (!lead) return;
    const int64_t payload_bytes = a.use_fp8 ? H + 16 * static_cast<int64_t>(units) : 2 * static_cast<int64_t>(H);
    for (unsigned m = far; m; m &= m - 1) {
      const int k = __ffs(m) - 1;
      const int d = __shfl_sync(~0u, ranks.rank, k);
      tr.put_warp(d, slot, tr.local() + staged + kHeaderBytes * __popc(dests & ((1u << k) - 1)), kHeaderBytes);
      tr.put_warp(d, payload, stage, payload_bytes);
    }
  }
}

// Call n's send, on every thread of the grid: the block's tokens, then
// (block 0) this rank's token count and whether it gave weights, then the
// block's arrival at every rank (in shrink mode: every unmasked rank).
template <class Transport>
__device__ __forceinline__ void send_call(const LowLatencyDispatchParams& p, const Transport& tr, uint64_t n,
                                          char* scratch) {
  auto* headers = reinterpret_cast<MessageHeader(*)[kLowLatencyMaxTopk]>(scratch);
  __shared__ uint32_t live_bits[kRankWords];
  const uint32_t seq = call_tag(n);
  const int parity = static_cast<int>(n & 1), set = static_cast<int>(n % kCountSets);
  const PeerSet live = block_live_set(p.group.wait, p.group.num_ranks, p.group.rank, live_bits);
  stamp(2);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Teams teams = token_teams(p.args.num_tokens);
  const int team = warp / teams.warps, member = warp % teams.warps;
  const int lead = team_lead(teams, row_units(p.args.hidden));
  // The team's rows of scales, two in turn: in the header space of a warp
  // other than the lead, unless the lead is the team's only warp (then its
  // headers are out before its scales are written).
  const int scale_warp = warp - member + (lead == 0 ? teams.warps - 1 : 0);
  auto* scale_rows = reinterpret_cast<int4(*)[kMaxScaleWords]>(headers[scale_warp]);
  for (int j = team;; j += teams.count) {
    const int t = static_cast<int>(blockIdx.x) + j * static_cast<int>(gridDim.x);
    if (t >= p.args.num_tokens) break;
    send_token(p, tr, headers[warp], scale_rows[(j / teams.count) & 1], seq, parity, set, t, team, member, teams.warps,
               member == lead, lane, live);
  }
  const int64_t signal = signal_offset(parity, p.group.rank);
  for (int d = static_cast<int>(threadIdx.x); blockIdx.x == 0 && d < p.group.num_ranks; d += kThreads) {
    if (!live.has(d)) continue;
    tr.set_word(d, signal + offsetof(DispatchSignal, num_tokens), static_cast<uint32_t>(p.args.num_tokens));
    tr.set_word(d, signal + offsetof(DispatchSignal, has_weights),
                p.args.topk_weights != nullptr || p.args.num_tokens == 0);
  }
  stamp(5);
  arrive_at_peers(tr, p.group.num_ranks, signal + offsetof(DispatchSignal, arrivals), live);
  stamp(6);
}

// ---------------------------------------------------------------------------
// Receive

__device__ __forceinline__ void write_plan_header(const LowLatencyDispatchParams& p, int32_t failed,
                                                  int32_t has_weights) {
  const LowLatencyDispatchArgs& a = p.args;
  auto* h = reinterpret_cast<PlanHeader*>(static_cast<char*>(a.plan) + p.plan.header);
  h->num_tokens = a.num_tokens;
  h->num_topk = a.num_topk;
  h->has_weights = has_weights;
  h->num_max_tokens = a.num_max_tokens;
  h->hidden = a.hidden;
  h->num_experts = a.num_experts;
  h->num_ranks = p.group.num_ranks;
  h->failed = failed;
}

// Source s: waits for its arrivals of call n, notes its token count and its
// bad-input and weights bits.
__device__ __forceinline__ bool wait_for_source(const LowLatencyDispatchParams& p, FixedArea* fixed, uint64_t n, int s,
                                                bool live, int32_t* source_tokens, uint32_t* failed_sources,
                                                uint32_t* weightless_sources) {
  const DispatchSignal& signal = fixed->dispatch[n & 1][s];
  const uint64_t start = device::global_timer_ns();
  const uint32_t target = arrivals_after(n), seq = call_tag(n);
  bool failed = false;
  const bool counts =
      peer_counts(p.group.wait, s, WaitSite::kLowLatencyDispatch, &fixed->local.dispatch_verdict[s], seq, live, failed,
                  [&] { return static_cast<int32_t>(device::load_acquire_sys(&signal.arrivals) - target) >= 0; });
  if (failed) return false;
  if (!counts) {
    source_tokens[s] = 0;
    return true;
  }
  if (blockIdx.x == 0 && p.args.wait_recv_cost_stats != nullptr)
    p.args.wait_recv_cost_stats[s] += static_cast<int64_t>(device::global_timer_ns() - start);
  source_tokens[s] = min(max(__ldcg(&signal.num_tokens), 0), p.args.num_max_tokens);
  if (__ldcg(&signal.bad_call) == seq) set_rank_bit(failed_sources, s);
  if (__ldcg(&signal.has_weights) == 0) set_rank_bit(weightless_sources, s);
  return true;
}

// Thread x waits for the arrivals of sources x, x + kThreads, ..., then notes
// each one's token count and whether it had a bad input (bit s of the shared
// bitsets). Returns false on a timeout (recorded). In shrink mode a source
// that is masked, or does not come in time, sends nothing.
__device__ __forceinline__ bool wait_for_sources(const LowLatencyDispatchParams& p, FixedArea* fixed, uint64_t n,
                                                 PeerSet live, int32_t* source_tokens, uint32_t* failed_sources,
                                                 uint32_t* weightless_sources) {
  bool ok = true;
  for (int s = static_cast<int>(threadIdx.x); s < p.group.num_ranks; s += kThreads)
    ok &= wait_for_source(p, fixed, n, s, live.has(s), source_tokens, failed_sources, weightless_sources);
  return ok;
}

// The call's token bits, copied to shared memory (`to`, null where they do
// not fit) while the counts load: thread x copies 16-byte word x.
struct BitsCopy {
  const int4* from;
  int4* to;
  int words;  // 4-byte words
};

// Exclusive prefix sums of the counts in (expert, source) order: the rows of
// pair i = l * R + s are [first_row[i], first_row[i + 1]) of the flat
// numbering, first_row[E] their total; sources with no tokens (masked ones)
// count none. Every thread of the block calls it; thread x takes pairs
// kPairsPerThread * x on.
__device__ __forceinline__ void scan_counts(const FixedArea* fixed, int set, int num_ranks, int num_pairs,
                                            int max_count, const int32_t* source_tokens, int32_t* first_row,
                                            int32_t* warp_sums, const BitsCopy& bits) {
  const int experts_per_rank = num_pairs / num_ranks;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int i0 = kPairsPerThread * static_cast<int>(threadIdx.x);
  // Issued before the counts' loads: the two rounds overlap.
  const bool copies = bits.to != nullptr && 4 * static_cast<int>(threadIdx.x) < bits.words;
  const int4 bit_word = copies ? __ldcg(bits.from + threadIdx.x) : make_int4(0, 0, 0, 0);
  int32_t c[kPairsPerThread];
  int32_t sum = 0;
#pragma unroll
  for (int u = 0; u < kPairsPerThread; ++u) {
    const int i = i0 + u;
    const int s = i % num_ranks;
    c[u] = i < num_pairs && source_tokens[s] > 0
               ? min(max(__ldcg(&fixed->counts[set][s * experts_per_rank + i / num_ranks]), 0), max_count)
               : 0;
    sum += c[u];
  }
  if (copies) bits.to[threadIdx.x] = bit_word;
  const int32_t mine = sum;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int32_t v = __shfl_up_sync(~0u, sum, d);
    if (lane >= d) sum += v;
  }
  if (lane == 31) warp_sums[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    int32_t total = lane < kWarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t v = __shfl_up_sync(~0u, total, d);
      if (lane >= d) total += v;
    }
    if (lane < kWarps) warp_sums[lane] = total;
  }
  __syncthreads();
  int32_t before = (warp > 0 ? warp_sums[warp - 1] : 0) + sum - mine;
#pragma unroll
  for (int u = 0; u < kPairsPerThread; ++u) {
    if (i0 + u < num_pairs) first_row[i0 + u] = before;
    before += c[u];
  }
  if (threadIdx.x == 0) first_row[num_pairs] = warp_sums[kWarps - 1];
  __syncthreads();
}

// The outputs of one number per expert or pair, and the plan's header and
// source token counts: spread over the threads of the grid.
__device__ __forceinline__ void write_counts(const LowLatencyDispatchParams& p, const int32_t* first_row,
                                             const int32_t* source_tokens, int32_t has_weights) {
  const LowLatencyDispatchArgs& a = p.args;
  const int R = p.group.num_ranks, E = a.num_experts;
  const int threads = static_cast<int>(gridDim.x) * kThreads;
  const int id = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  char* plan = static_cast<char*>(a.plan);
  auto* plan_recv_count = reinterpret_cast<int32_t*>(plan + p.plan.recv_count);
  for (int i = id; i < E; i += threads) {
    const int l = i / R;
    const int32_t begin = first_row[i] - first_row[l * R], count = first_row[i + 1] - first_row[i];
    a.layout_range[i] = static_cast<int64_t>(begin) << 32 | count;
    if (i % R == 0) {
      const int32_t n = first_row[(l + 1) * R] - first_row[l * R];
      a.recv_count[l] = n;
      plan_recv_count[l] = n;
      if (a.cumulative_local_expert_recv_stats != nullptr) a.cumulative_local_expert_recv_stats[l] += n;
    }
  }
  for (int i = id; i < R; i += threads) reinterpret_cast<int32_t*>(plan + p.plan.source_tokens)[i] = source_tokens[i];
  if (id == 0) write_plan_header(p, 0, has_weights);
}

// A slot holds a message of this call for token t.
__device__ __forceinline__ bool is_message(const int4& head, uint32_t seq, int t) {
  return static_cast<uint32_t>(head.x) == seq && head.y == t && head.z >= 1 && head.z <= kLowLatencyMaxTopk;
}

// The row of `row_bytes` at `out` of recv_x gets words [base, base + 32
// kCopyWords) of `v` (lane's words base + 32 u).
__device__ __forceinline__ void store_row_words(char* recv_x, int64_t out, int64_t row_bytes, const int4* v, int base,
                                                int n16) {
  auto* d = reinterpret_cast<int4*>(recv_x + out * row_bytes);
#pragma unroll
  for (int u = 0; u < kCopyWords; ++u)
    if (base + 32 * u < n16) device::store_16(d + base + 32 * u, v[u]);
}

__device__ __forceinline__ void load_row_words(int4* v, const char* payload, int base, int n16) {
  const auto* src = reinterpret_cast<const int4*>(payload);
#pragma unroll
  for (int u = 0; u < kCopyWords; ++u)
    if (base + 32 * u < n16) v[u] = device::load_shared_16(src + base + 32 * u);
}

// Slot (s, t), by one warp: the header, the scales and the row's first words
// load in one round (whatever the slot holds); if it is a message of this
// call, lane j < n finds entry j's row (its local expert l's first row for s,
// plus the tokens of s before t that name l: the bits below t, from
// `shared_bits` where the call's bits are there) and writes the plan's entry,
// and the warp copies the row and scales to each entry's row.
__device__ __forceinline__ void place_message(const LowLatencyDispatchParams& p, const char* local, uint32_t seq,
                                              int parity, int set, const int32_t* first_row,
                                              const uint32_t* shared_bits, int s, int t, int lane) {
  const LowLatencyDispatchArgs& a = p.args;
  const int H = a.hidden, M = a.num_max_tokens, R = p.group.num_ranks, L = a.num_experts / R;
  const int64_t rows_per_expert = static_cast<int64_t>(M) * R;
  const int64_t row_bytes = a.use_fp8 ? H : 2 * static_cast<int64_t>(H);
  const int n16 = static_cast<int>(row_bytes / 16);
  const int num_groups = H / kScaleGroup, scale_words = (num_groups + 3) / 4;
  const char* slot = local + p.region.dispatch_slot(parity, s, t);
  const char* payload = slot + kPayloadOffset;
  const int4 head = device::load_shared_16(slot);
  int name = -1;
  uint16_t slots = 0;
  float weight = 0.0f;
  if (lane < kLowLatencyMaxTopk) {
    name = __ldcg(reinterpret_cast<const short*>(slot + offsetof(MessageHeader, local_expert)) + lane);
    slots = __ldcg(reinterpret_cast<const unsigned short*>(slot + offsetof(MessageHeader, slots)) + lane);
    weight = __ldcg(reinterpret_cast<const float*>(slot + offsetof(MessageHeader, weight)) + lane);
  }
  int4 scales = make_int4(0, 0, 0, 0);
  if (a.use_fp8 && lane < scale_words) scales = device::load_shared_16(payload + H + 16 * lane);
  int4 v[kCopyWords];
  load_row_words(v, payload, lane, n16);
  const int64_t entry = static_cast<int64_t>(s) * M + t;
  char* plan = static_cast<char*>(a.plan);
  if (!is_message(head, seq, t)) {
    if (lane == 0) reinterpret_cast<int32_t*>(plan + p.plan.token_entries)[entry] = 0;
    return;
  }
  const int n = head.z;
  // A name out of range (a peer's corrupt header) places nothing, as the scan did.
  const bool mine = lane < n && name >= 0 && name < L;
  int64_t row = 0;
  if (mine) {
    const int words = token_words(M);
    const int64_t pair_word = (static_cast<int64_t>(s) * L + name) * words;
    int before = 0;
    if (shared_bits != nullptr) {
      const uint32_t* bits = shared_bits + pair_word;
      before = __popc(bits[t / 32] & ((1u << (t % 32)) - 1));
      for (int w = 0; w < t / 32; ++w) before += __popc(bits[w]);
    } else {
      const auto* bits = reinterpret_cast<const uint32_t*>(local + token_bits_offset(set, 0, L, words)) + pair_word;
      before = __popc(__ldcg(bits + t / 32) & ((1u << (t % 32)) - 1));
#pragma unroll 4
      for (int w = 0; w < t / 32; ++w) before += __popc(__ldcg(bits + w));
    }
    const int pair = name * R + s;
    row = first_row[pair] - first_row[name * R] + before;
    const int64_t out = name * rows_per_expert + row;
    a.src_info[out] = t;
    reinterpret_cast<int32_t*>(plan + p.plan.token_rows)[entry * kLowLatencyMaxTopk + lane] = static_cast<int32_t>(out);
    reinterpret_cast<uint16_t*>(plan + p.plan.token_slots)[entry * kLowLatencyMaxTopk + lane] = slots;
    reinterpret_cast<float*>(plan + p.plan.token_weights)[entry * kLowLatencyMaxTopk + lane] = weight;
  }
  if (lane == 0) reinterpret_cast<int32_t*>(plan + p.plan.token_entries)[entry] = n;
  const unsigned placed = __ballot_sync(~0u, mine);
  if (a.use_fp8) {
    const float f[4] = {__int_as_float(scales.x), __int_as_float(scales.y), __int_as_float(scales.z),
                        __int_as_float(scales.w)};
    for (unsigned m = placed; m; m &= m - 1) {
      const int j = __ffs(static_cast<int>(m)) - 1;
      const int l = __shfl_sync(~0u, name, j);
      const int64_t r = __shfl_sync(~0u, row, j);
      if (lane >= scale_words) continue;
      if (a.use_ue8m0) {
        uint32_t packed = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (4 * lane + i < num_groups) packed |= device::ue8m0_exponent(f[i]) << (8 * i);
        a.recv_packed_scales[(l * static_cast<int64_t>(scale_words) + lane) * rows_per_expert + r] =
            static_cast<int32_t>(packed);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int g = 4 * lane + i;
          if (g < num_groups) a.recv_scales[(l * static_cast<int64_t>(num_groups) + g) * rows_per_expert + r] = f[i];
        }
      }
    }
  }
  char* recv_x = static_cast<char*>(a.recv_x);
  for (int first = 0; first < n16; first += 32 * kCopyWords) {
    if (first != 0) load_row_words(v, payload, first + lane, n16);
    for (unsigned m = placed; m; m &= m - 1) {
      const int j = __ffs(static_cast<int>(m)) - 1;
      const int64_t out = __shfl_sync(~0u, name, j) * rows_per_expert + __shfl_sync(~0u, row, j);
      store_row_words(recv_x, out, row_bytes, v, first + lane, n16);
    }
  }
}

// Every (source, token < M) slot, a warp each in turn (spread over the blocks
// first): its plan entries and rows; a slot past its source's tokens has none.
__device__ __forceinline__ void place_messages(const LowLatencyDispatchParams& p, const char* local, uint32_t seq,
                                               int parity, int set, const int32_t* first_row,
                                               const uint32_t* shared_bits, const int32_t* source_tokens) {
  const int R = p.group.num_ranks, M = p.args.num_max_tokens, lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t g = static_cast<int64_t>(threadIdx.x / 32) * gridDim.x + blockIdx.x;
  auto* entries = reinterpret_cast<int32_t*>(static_cast<char*>(p.args.plan) + p.plan.token_entries);
  for (int64_t i = g; i < static_cast<int64_t>(R) * M; i += warps) {
    const int s = static_cast<int>(i / M), t = static_cast<int>(i % M);
    if (t < source_tokens[s])
      place_message(p, local, seq, parity, set, first_row, shared_bits, s, t, lane);
    else if (lane == 0)
      entries[i] = 0;
  }
}

// Call n's receive, on every thread of the grid. Block 0 zeroes the counts
// two calls on will add to, the grid their token bits. The receive's call
// number advances at the end, and the send's (call send_n) where this launch
// ran the send too (`sent`).
template <class Transport>
__device__ __forceinline__ void recv_call(const LowLatencyDispatchParams& p, const Transport& tr, uint64_t n,
                                          uint64_t send_n, bool sent, char* scratch) {
  __shared__ int32_t first_row[kLowLatencyMaxExperts + 1];
  __shared__ int32_t warp_sums[kWarps];
  __shared__ int32_t source_tokens[kMaxGroupRanks];
  __shared__ uint32_t failed_sources[kRankWords], weightless_sources[kRankWords], live_bits[kRankWords];
  auto* fixed = reinterpret_cast<FixedArea*>(tr.local());
  const char* local = tr.local();
  const uint32_t seq = call_tag(n);
  const int parity = static_cast<int>(n & 1);
  const int R = p.group.num_ranks;
  // Every expert's count, not this call's E only: the call two on may have more experts than this one.
  constexpr int kCountWords = kLowLatencyMaxExperts / 4;
  if (blockIdx.x == 0) {
    auto* next = reinterpret_cast<int4*>(fixed->counts[(n + 2) % kCountSets]);
    for (int i = threadIdx.x; i < kCountWords; i += blockDim.x) next[i] = make_int4(0, 0, 0, 0);
  }
  {
    auto* next = reinterpret_cast<int4*>(fixed->token_bits[(n + 2) % kCountSets]);
    for (int i = blockIdx.x * kThreads + threadIdx.x; i < kTokenBitsWords / 4; i += gridDim.x * kThreads)
      next[i] = make_int4(0, 0, 0, 0);
  }
  const PeerSet live = block_live_set(p.group.wait, R, p.group.rank, live_bits, failed_sources, weightless_sources);
  const bool all_came =
      __syncthreads_and(wait_for_sources(p, fixed, n, live, source_tokens, failed_sources, weightless_sources));
  const bool failed = first_rank(failed_sources, R, -1) >= 0;
  stamp(7);
  if (all_came && !failed) {
    const int set = static_cast<int>(n % kCountSets);
    const int words = token_words(p.args.num_max_tokens), L = p.args.num_experts / R;
    const int bit_words = p.args.num_experts * words;  // every source's, from source 0's on
    auto* shared_bits = bit_words <= kSharedBitsWords ? reinterpret_cast<uint32_t*>(scratch) : nullptr;
    const BitsCopy bits{reinterpret_cast<const int4*>(local + token_bits_offset(set, 0, L, words)),
                        reinterpret_cast<int4*>(shared_bits), bit_words};
    scan_counts(fixed, set, R, p.args.num_experts, p.args.num_max_tokens, source_tokens, first_row, warp_sums, bits);
    write_counts(p, first_row, source_tokens, first_rank(weightless_sources, R, -1) < 0);
    stamp(8);
    place_messages(p, local, seq, parity, set, first_row, shared_bits, source_tokens);
    stamp(10);
  } else if (blockIdx.x == 0 && threadIdx.x == 0) {
    // A source's bad input: no rank places anything. This rank's own send
    // recorded its own bad input, and a timeout is recorded already.
    const int peer = first_rank(failed_sources, R, p.group.rank);
    if (all_came && peer >= 0)
      device::record_error(p.group.wait.errors, DeviceErrorCode::kPeerInputError, p.group.wait.rank,
                           p.group.wait.first_nvl_rank + peer, static_cast<int>(OpKind::kLowLatencyDispatch), 0, 0);
    write_plan_header(p, 1, 0);
  }
  if (sent)
    advance_both(&fixed->local.dispatch_send, send_n, &fixed->local.dispatch_recv, n,
                 &fixed->dispatch[send_n & 1][p.group.rank].arrivals);
  else
    finish_phase(&fixed->local.dispatch_recv, n, [] {});
}

// Both phases in one launch only where every block of the grid is resident
// at once (a GPU no other rank of the group shares): a block that has sent
// waits for every source, this rank's own blocks among them.
template <class Transport>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch_kernel(const __grid_constant__ LowLatencyDispatchParams p, const int phases) {
  __shared__ void* table[kSharedRegionTable];
  __shared__ __align__(16) char scratch[kScratchBytes];
  const Transport tr = block_transport<Transport>(p.group, table);
  // The inputs and the call numbers may come from the kernel before.
  device::wait_for_prior_grids();
  device::allow_dependents();
  stamp_start();
  LocalState* state = &reinterpret_cast<FixedArea*>(tr.local())->local;
  // Both numbers before any work: the receive's last block stores the send's.
  const uint64_t send_n = phases & kPhaseSend ? call_number(&state->dispatch_send) : 0;
  const uint64_t recv_n = phases & kPhaseReceive ? call_number(&state->dispatch_recv) : 0;
  stamp(1, false, send_n + recv_n);
  if (phases & kPhaseSend) {
    send_call(p, tr, send_n, scratch);
    if (!(phases & kPhaseReceive)) finish_phase(&state->dispatch_send, send_n, [] {});
  }
  if (phases & kPhaseReceive) recv_call(p, tr, recv_n, send_n, (phases & kPhaseSend) != 0, scratch);
  print_stamps("dispatch", p.group.rank, phases & kPhaseSend ? send_n : recv_n, phases);
}

}  // namespace dispatch_body

// One op's launches on `Transport` (see launch_dispatch in launch.hpp).
template <class Transport>
void launch_dispatch_on(const LowLatencyDispatchArgs& args, const Region& region, const Group& group,
                        LowLatencyPhase phase, cudaStream_t stream) {
  using namespace dispatch_body;
  const LowLatencyDispatchParams p{args, region, group,
                                   make_plan(args.num_max_tokens, group.num_ranks, args.num_experts)};
  const int blocks = dispatch_blocks(args.num_tokens, group.num_ranks, args.num_max_tokens, kWarps, group.num_blocks);
  launch_phases(dispatch_kernel<Transport>, blocks, kThreads, group, phase, stream, p);
}

}  // namespace
}  // namespace turnout::kernels::low_latency
