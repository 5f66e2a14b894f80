// Low-latency dispatch, one kernel (dispatch_kernel) whose launch runs the
// send phase, the receive phase or both. The send writes each token, once per
// rank that holds one of its experts, into the token's message slot in that
// rank's region, and adds the token to that rank's count of each of its
// experts there; then each block adds to every rank's arrival counter. The
// receive waits for every source's arrivals and places the messages into the
// rows of each local expert. A send never waits; a rank alone on its GPU runs
// both phases in one launch (one launch less), where a block's receive waits
// for the sends of the rank's own blocks too.
//
// Send: a block's tokens are t = block + j * blocks. Its warps form teams,
// one token per team at a time; with fewer tokens than warps a team has
// several warps, so a few tokens still keep every warp loading. A team reads
// the row once, casts it in registers (FP8), and stores it to every
// destination; its first warp also writes the headers and counts.
//
// Receive: every block scans the counts of all (expert, source) pairs into
// row offsets. The received rows, numbered flat in (expert, source, token)
// order, are split evenly over every warp of the grid; a warp finds its rows
// by scanning the source's message headers, 32 slots a step.
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
#include "kernels/device/error_record.cuh"
#include "kernels/device/fp8_cast.cuh"
#include "kernels/device/memory_order.cuh"
#include "kernels/device/rank_mask.cuh"
#include "kernels/device/vector_copy.cuh"
#include "kernels/low_latency/call_counter.cuh"
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
// Receive: 32-slot steps of a header scan whose loads go out together.
constexpr int kScanSteps = 4;

static_assert(sizeof(MessageHeader) % 16 == 0);
static_assert(offsetof(FixedArea, counts) % 16 == 0 && kMaxLocalExperts % 4 == 0, "counts are zeroed in 16-byte words");
// The count scan: (expert, source) pairs a thread.
constexpr int kPairsPerThread = (kLowLatencyMaxExperts + kThreads - 1) / kThreads;
static_assert(kLowLatencyMaxHidden / kScaleGroup <= 4 * 32, "a row's scales are at most one 16-byte word a lane");
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
// odd lanes hi words lane - 1, lane. Lane 0 stores the unit's four scales
// (zeros past the row's groups).
template <class Transport>
__device__ __forceinline__ void put_fp8_pass(const Transport& tr, unsigned targets, int rank, int64_t payload,
                                             char* stage, const RowPass& pass, int hidden, bool round_scale, int first,
                                             int stride, int lane) {
  const int n16 = hidden / 8, num_groups = hidden / kScaleGroup;
  const bool odd = lane & 1;
  int4 bytes[kUnitsPerPass];
  int4 scales[kUnitsPerPass];
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
    const int g = (first + u * stride) * 4;
    scales[u] =
        make_int4(__float_as_int(lo.scale), __float_as_int(g + 1 < num_groups ? s1 : 0.0f),
                  __float_as_int(g + 2 < num_groups ? hi.scale : 0.0f), __float_as_int(g + 3 < num_groups ? s3 : 0.0f));
  }
  for (unsigned m = targets; m; m &= m - 1) {
    char* base = payload_target(tr, __ffs(m) - 1, rank, payload, stage);
#pragma unroll
    for (int u = 0; u < kUnitsPerPass; ++u) {
      const int unit = first + u * stride;
      // A group is 16 words, so both words of a lane's pair are in the row or neither.
      if (unit * kUnitWords + (odd ? 32 : 0) + lane < n16)
        device::store_16(base + 16 * (static_cast<int64_t>(unit) * 32 + (odd ? 16 : 0) + lane / 2), bytes[u]);
      if (lane == 0 && unit * kUnitWords < n16)
        device::store_16(base + hidden + 16 * static_cast<int64_t>(unit), scales[u]);
    }
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

// The first warp of a team: each destination's header, built in this warp's
// shared memory (lane k fills the entry of top-k slot k when k is the first
// slot naming its expert; header i is the i-th destination of `dests`) and
// put as 16-byte words (a far destination's into its staged header, at
// `staged` + i headers); and one more token for each distinct expert in its
// destination's count. `dests`: the first slot of each destination rank that
// is sent to; `far`: those out of load/store reach.
template <class Transport>
__device__ __forceinline__ void put_headers(const Transport& tr, MessageHeader* headers, int64_t counts, uint32_t seq,
                                            int token, int64_t slot, int64_t staged, int expert, float weight,
                                            int num_topk, int experts_per_rank, const TokenRanks& ranks, unsigned dests,
                                            unsigned far, int lane) {
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

// Warp `member` of a team of `team_warps` sends token t to the ranks of
// `live` that hold one of its experts.
template <class Transport>
__device__ __forceinline__ void send_token(const LowLatencyDispatchParams& p, const Transport& tr,
                                           MessageHeader* headers, uint32_t seq, int parity, int set, int t, int team,
                                           int member, int team_warps, int lane, PeerSet live) {
  const LowLatencyDispatchArgs& a = p.args;
  const int K = a.num_topk, E = a.num_experts, H = a.hidden;
  const int n16 = H / 8, units = (n16 + kUnitWords - 1) / kUnitWords;
  const int4* row = reinterpret_cast<const int4*>(static_cast<const char*>(a.x) + static_cast<int64_t>(t) * H * 2);
  int64_t id = -1;
  float weight = 0.0f;
  if (lane < K) {
    id = __ldg(a.topk_idx + static_cast<int64_t>(t) * K + lane);
    if (member == 0 && a.topk_weights != nullptr) weight = __ldg(a.topk_weights + static_cast<int64_t>(t) * K + lane);
  }
  // The first pass's loads go out with the top-k ones rather than after them.
  RowPass pass = load_pass(row, n16, member, team_warps, lane);
  const unsigned bad = __ballot_sync(~0u, id < -1 || id >= E);
  stamp(3, true);
  if (bad != 0) {
    if (member == 0 && lane == __ffs(bad) - 1) report_invalid_expert(p, tr, seq, parity, t, lane, id, live);
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
  if (member == 0)
    put_headers(tr, headers, counts_offset(set, p.group.rank, L), seq, t, slot, staged, expert, weight, K, L, ranks,
                dests, far, lane);
  constexpr int64_t kHeaderBytes = sizeof(MessageHeader);
  const int64_t payload = slot + kHeaderBytes;
  char* stage = tr.local() + p.region.dispatch_stage_slot(parity, t) + kHeaderBytes;
  const unsigned targets = (dests & ~far) | (far != 0 ? 1u << kStageTarget : 0u);
  for (int first = member; first < units; first += kUnitsPerPass * team_warps) {
    if (first != member) pass = load_pass(row, n16, first, team_warps, lane);
    if (a.use_fp8)
      put_fp8_pass(tr, targets, ranks.rank, payload, stage, pass, H, a.round_scale, first, team_warps, lane);
    else
      put_bf16_pass(tr, targets, ranks.rank, payload, stage, pass, n16, first, team_warps, lane);
  }
  stamp(4, true);
  if constexpr (Transport::kReachesFar) {
    if (far == 0) return;
    // The team's stores to the stage come before its first warp's puts.
    if (team_warps == 1)
      __syncwarp();
    else
      asm volatile("bar.sync %0, %1;" ::"r"(1 + team), "r"(32 * team_warps) : "memory");
    if (member != 0) return;
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
__device__ __forceinline__ void send_call(const LowLatencyDispatchParams& p, const Transport& tr, uint64_t n) {
  __shared__ __align__(16) MessageHeader headers[kWarps][kLowLatencyMaxTopk];
  __shared__ uint32_t live_bits[kRankWords];
  const uint32_t seq = call_tag(n);
  const int parity = static_cast<int>(n & 1), set = static_cast<int>(n % kCountSets);
  const PeerSet live = block_live_set(p.group.wait, p.group.num_ranks, p.group.rank, live_bits);
  stamp(2);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Teams teams = token_teams(p.args.num_tokens);
  const int team = warp / teams.warps, member = warp % teams.warps;
  for (int j = team;; j += teams.count) {
    const int t = static_cast<int>(blockIdx.x) + j * static_cast<int>(gridDim.x);
    if (t >= p.args.num_tokens) break;
    send_token(p, tr, headers[warp], seq, parity, set, t, team, member, teams.warps, lane, live);
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

// Exclusive prefix sums of the counts in (expert, source) order: the rows of
// pair i = l * R + s are [first_row[i], first_row[i + 1]) of the flat
// numbering, first_row[E] their total; sources with no tokens (masked ones)
// count none. Every thread of the block calls it; thread x takes pairs
// kPairsPerThread * x on.
__device__ __forceinline__ void scan_counts(const FixedArea* fixed, int set, int num_ranks, int num_pairs,
                                            int max_count, const int32_t* source_tokens, int32_t* first_row,
                                            int32_t* warp_sums) {
  const int experts_per_rank = num_pairs / num_ranks;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int i0 = kPairsPerThread * static_cast<int>(threadIdx.x);
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

// plan token_entries for every (source, token < M), spread over the grid
// from the last warp of place_rows' order back: with fewer rows than warps,
// warps that place no row read these headers.
__device__ __forceinline__ void write_token_entries(const LowLatencyDispatchParams& p, const char* local, uint32_t seq,
                                                    int parity, const int32_t* source_tokens) {
  const int R = p.group.num_ranks, M = p.args.num_max_tokens;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t g = static_cast<int64_t>(threadIdx.x / 32) * gridDim.x + blockIdx.x;
  auto* entries = reinterpret_cast<int32_t*>(static_cast<char*>(p.args.plan) + p.plan.token_entries);
  for (int64_t i = (warps - 1 - g) * 32 + threadIdx.x % 32; i < static_cast<int64_t>(R) * M; i += warps * 32) {
    const int s = static_cast<int>(i / M), t = static_cast<int>(i % M);
    int32_t n = 0;
    if (t < source_tokens[s]) {
      const int4 head = device::load_shared_16(local + p.region.dispatch_slot(parity, s, t));
      if (is_message(head, seq, t)) n = head.z;
    }
    entries[i] = n;
  }
}

// The entry j in [first, first + 8), j < n, whose local expert (the int16s of
// `names`) is l; -1 if none.
__device__ __forceinline__ int entry_naming(const int4& names, int first, int n, int l) {
  const int32_t pairs[4] = {names.x, names.y, names.z, names.w};
  int found = -1;
#pragma unroll
  for (int c = 7; c >= 0; --c) {
    const int name = static_cast<int16_t>(pairs[c / 2] >> (16 * (c % 2)));
    if (first + c < n && name == l) found = first + c;
  }
  return found;
}

// For slots base + 32 u + lane (u < kScanSteps) of source s: byte u of the
// result is 1 + the entry naming local expert l if the slot holds a message of
// this call that names it, else 0. Reads the first header word and the first
// eight local experts (the next eight only when needed).
__device__ __forceinline__ uint32_t find_entries(const Region& region, const char* local, uint32_t seq, int parity,
                                                 int s, int l, int base, int num_tokens, int lane) {
  int4 head[kScanSteps], names[kScanSteps];
#pragma unroll
  for (int u = 0; u < kScanSteps; ++u) {
    const int t = base + 32 * u + lane;
    head[u] = names[u] = make_int4(0, 0, 0, 0);
    if (t < num_tokens) {
      const char* slot = local + region.dispatch_slot(parity, s, t);
      head[u] = device::load_shared_16(slot);
      names[u] = device::load_shared_16(slot + offsetof(MessageHeader, local_expert));
    }
  }
  uint32_t entries = 0;
#pragma unroll
  for (int u = 0; u < kScanSteps; ++u) {
    const int t = base + 32 * u + lane;
    if (t < num_tokens && is_message(head[u], seq, t)) {
      const int n = head[u].z;
      int j = entry_naming(names[u], 0, n, l);
      if (j < 0 && n > 8) {
        const char* more = local + region.dispatch_slot(parity, s, t) + offsetof(MessageHeader, local_expert) + 16;
        j = entry_naming(device::load_shared_16(more), 8, n, l);
      }
      entries |= static_cast<uint32_t>(j + 1) << (8 * u);
    }
  }
  return entries;
}

// A warp copies n16 16-byte words another GPU wrote (read from L2), with
// kCopyWords words a lane in flight: a pass's loads all issue before its
// stores, the last pass masked.
__device__ __forceinline__ void copy_row(void* dst, const void* src, int n16, int lane) {
  auto* d = static_cast<int4*>(dst);
  const auto* s = static_cast<const int4*>(src);
  for (int base = lane; base < n16; base += 32 * kCopyWords) {
    int4 v[kCopyWords];
#pragma unroll
    for (int u = 0; u < kCopyWords; ++u)
      if (base + 32 * u < n16) v[u] = device::load_shared_16(s + base + 32 * u);
#pragma unroll
    for (int u = 0; u < kCopyWords; ++u)
      if (base + 32 * u < n16) device::store_16(d + base + 32 * u, v[u]);
  }
}

// Row `row` of local expert l is token t of source s, entry j of its header.
__device__ __forceinline__ void place_row(const LowLatencyDispatchParams& p, const char* local, int parity, int l,
                                          int s, int t, int j, int row, int lane) {
  const LowLatencyDispatchArgs& a = p.args;
  const int H = a.hidden, M = a.num_max_tokens;
  const int64_t rows_per_expert = static_cast<int64_t>(M) * p.group.num_ranks;
  const int64_t out = l * rows_per_expert + row;
  const char* slot = local + p.region.dispatch_slot(parity, s, t);
  const char* payload = slot + sizeof(MessageHeader);
  const int num_groups = H / kScaleGroup, scale_words = (num_groups + 3) / 4;
  // The small loads first, so they overlap the row's.
  uint16_t slots = 0;
  float weight = 0.0f;
  if (lane == 0) {
    slots = __ldcg(reinterpret_cast<const unsigned short*>(slot + offsetof(MessageHeader, slots)) + j);
    weight = __ldcg(reinterpret_cast<const float*>(slot + offsetof(MessageHeader, weight)) + j);
  }
  int4 scales = make_int4(0, 0, 0, 0);
  if (a.use_fp8 && lane < scale_words) scales = device::load_shared_16(payload + H + 16 * lane);
  const int64_t row_bytes = a.use_fp8 ? H : 2 * static_cast<int64_t>(H);
  copy_row(static_cast<char*>(a.recv_x) + out * row_bytes, payload, static_cast<int>(row_bytes / 16), lane);
  if (lane == 0) {
    char* plan = static_cast<char*>(a.plan);
    a.src_info[out] = t;
    const int64_t entry = (static_cast<int64_t>(s) * M + t) * kLowLatencyMaxTopk + j;
    reinterpret_cast<int32_t*>(plan + p.plan.token_rows)[entry] = static_cast<int32_t>(out);
    reinterpret_cast<uint16_t*>(plan + p.plan.token_slots)[entry] = slots;
    reinterpret_cast<float*>(plan + p.plan.token_weights)[entry] = weight;
  }
  if (a.use_fp8 && lane < scale_words) {
    const float v[4] = {__int_as_float(scales.x), __int_as_float(scales.y), __int_as_float(scales.z),
                        __int_as_float(scales.w)};
    if (a.use_ue8m0) {
      uint32_t packed = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (4 * lane + i < num_groups) packed |= device::ue8m0_exponent(v[i]) << (8 * i);
      a.recv_packed_scales[(l * static_cast<int64_t>(scale_words) + lane) * rows_per_expert + row] =
          static_cast<int32_t>(packed);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int g = 4 * lane + i;
        if (g < num_groups) a.recv_scales[(l * static_cast<int64_t>(num_groups) + g) * rows_per_expert + row] = v[i];
      }
    }
  }
}

// Rows [from, to) of pair i (local expert l, source s): the from-th to the
// (to - 1)-th messages of s naming l, in token order.
__device__ __forceinline__ void place_pair_rows(const LowLatencyDispatchParams& p, const char* local, uint32_t seq,
                                                int parity, const int32_t* first_row, const int32_t* source_tokens,
                                                int i, int from, int to, int lane) {
  const int R = p.group.num_ranks;
  const int l = i / R, s = i % R;
  const int begin = first_row[i] - first_row[l * R];
  const int num_tokens = source_tokens[s];
  int seen = 0;  // messages naming l before the current step
  for (int base = 0; base < num_tokens && seen < to; base += 32 * kScanSteps) {
    const uint32_t entries = find_entries(p.region, local, seq, parity, s, l, base, num_tokens, lane);
    // Not unrolled: one copy of the row code is enough.
#pragma unroll 1
    for (int u = 0; u < kScanSteps && seen < to; ++u) {
      const int entry = static_cast<int>(entries >> (8 * u) & 0xffu) - 1;
      unsigned hits = __ballot_sync(~0u, entry >= 0);
      const int n = __popc(hits);
      for (int q = seen; hits != 0 && q < to; ++q, hits &= hits - 1) {
        if (q < from) continue;
        const int k = __ffs(hits) - 1;
        place_row(p, local, parity, l, s, base + 32 * u + k, __shfl_sync(~0u, entry, k), begin + q, lane);
      }
      seen += n;
    }
  }
}

// The rows of this warp: an even share of the flat numbering, warps taken
// block by block in turn so that a few rows still spread over the SMs.
__device__ __forceinline__ void place_rows(const LowLatencyDispatchParams& p, const char* local, uint32_t seq,
                                           int parity, const int32_t* first_row, const int32_t* source_tokens) {
  const int E = p.args.num_experts, lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t g = static_cast<int64_t>(threadIdx.x / 32) * gridDim.x + blockIdx.x;
  const int64_t total = first_row[E];
  int row = static_cast<int>(g * total / warps);
  const int end = static_cast<int>((g + 1) * total / warps);
  if (row >= end) return;
  // The pair holding `row`: the last i with first_row[i] <= row (first_row[E] > row).
  int lo = 0, hi = E;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (first_row[mid] <= row)
      lo = mid;
    else
      hi = mid;
  }
  for (int i = lo; row < end; ++i) {
    const int stop = min(end, first_row[i + 1]);
    if (row >= stop) continue;
    place_pair_rows(p, local, seq, parity, first_row, source_tokens, i, row - first_row[i], stop - first_row[i], lane);
    row = stop;
  }
}

// Call n's receive, on every thread of the grid. Block 0 zeroes the counts
// two calls on will add to. The receive's call number advances at the end,
// and the send's (call send_n) where this launch ran the send too (`sent`).
template <class Transport>
__device__ __forceinline__ void recv_call(const LowLatencyDispatchParams& p, const Transport& tr, uint64_t n,
                                          uint64_t send_n, bool sent) {
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
  const PeerSet live = block_live_set(p.group.wait, R, p.group.rank, live_bits, failed_sources, weightless_sources);
  const bool all_came =
      __syncthreads_and(wait_for_sources(p, fixed, n, live, source_tokens, failed_sources, weightless_sources));
  const bool failed = first_rank(failed_sources, R, -1) >= 0;
  stamp(7);
  if (all_came && !failed) {
    scan_counts(fixed, static_cast<int>(n % kCountSets), R, p.args.num_experts, p.args.num_max_tokens, source_tokens,
                first_row, warp_sums);
    write_counts(p, first_row, source_tokens, first_rank(weightless_sources, R, -1) < 0);
    stamp(8);
    write_token_entries(p, local, seq, parity, source_tokens);
    stamp(9);
    place_rows(p, local, seq, parity, first_row, source_tokens);
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
  stamp_start();
  const Transport tr = block_transport<Transport>(p.group, table);
  LocalState* state = &reinterpret_cast<FixedArea*>(tr.local())->local;
  // Both numbers before any work: the receive's last block stores the send's.
  const uint64_t send_n = phases & kPhaseSend ? call_number(&state->dispatch_send) : 0;
  const uint64_t recv_n = phases & kPhaseReceive ? call_number(&state->dispatch_recv) : 0;
  stamp(1, false, send_n + recv_n);
  if (phases & kPhaseSend) {
    send_call(p, tr, send_n);
    if (!(phases & kPhaseReceive)) finish_phase(&state->dispatch_send, send_n, [] {});
  }
  if (phases & kPhaseReceive) recv_call(p, tr, recv_n, send_n, (phases & kPhaseSend) != 0);
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
  if (phase != LowLatencyPhase::kSendAndReceive || group.gpu_to_itself) {
    dispatch_kernel<Transport><<<group.num_blocks, kThreads, 0, stream>>>(p, phase_bits(phase));
  } else {
    dispatch_kernel<Transport><<<group.num_blocks, kThreads, 0, stream>>>(p, kPhaseSend);
    dispatch_kernel<Transport><<<group.num_blocks, kThreads, 0, stream>>>(p, kPhaseReceive);
  }
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace
}  // namespace turnout::kernels::low_latency
