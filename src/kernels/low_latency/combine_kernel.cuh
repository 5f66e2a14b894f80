// Low-latency combine, one kernel (combine_kernel) whose launch runs the send
// phase, the receive phase or both. An expert rank sums, for each token it
// received, its experts' rows weighted in fp32 and sends that one vector back
// to the token's rank (0.45x the rows of one per (token, expert) at EP4, top-8);
// the token's rank sums the vectors of its expert ranks in a fixed order.
//
// The weights come from the dispatch when every rank gave them there;
// otherwise each rank publishes its combine weights first, per (token, top-k
// slot) an 8-byte word holding the weight and the call's number, and an
// expert rank reads a token's words until they carry this call's number. A
// rank alone on its GPU publishes from every block (block b the tokens
// b, b + grid, ...); ranks sharing a GPU may not have every block resident,
// so the first block of the call to start publishes them all, before it waits
// for anything.
//
// Work is items of kChunk channels of one token (and, to send, one source),
// one warp each, strided over every warp of the grid: a decode batch has few
// tokens, so splitting rows is what keeps all SMs busy.
//
// A template on the transport (transport.cuh), like dispatch_kernel.cuh. A row
// for a far source rank is staged in this rank's region chunk by chunk; the
// warp that stages its last chunk puts the whole row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "kernels/device/bounded_wait.cuh"
#include "kernels/device/dependent_launch.cuh"
#include "kernels/device/error_record.cuh"
#include "kernels/device/memory_order.cuh"
#include "kernels/device/rank_mask.cuh"
#include "kernels/device/vector_copy.cuh"
#include "kernels/low_latency/call_counter.cuh"
#include "kernels/low_latency/grid.hpp"
#include "kernels/low_latency/launch.hpp"
#include "kernels/low_latency/logfmt.cuh"
#include "kernels/low_latency/peer_set.cuh"
#include "kernels/low_latency/region.hpp"
#include "kernels/low_latency/stamps.cuh"
#include "kernels/low_latency/transport.cuh"
#include "turnout/error.hpp"

namespace turnout::kernels::low_latency {
namespace {
namespace combine_body {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// 14 items per token at hidden 7168; four 128-channel groups.
constexpr int kChunk = 512;
constexpr int kChunkWords = kChunk / 8;
static_assert(kChunk % kScaleGroup == 0 && kChunkWords == 64 && kChunk == kLogfmtChunk);
// Rows whose words a lane loads before using any: a top-8 token's rows in one
// round trip, within the 128 registers a 512-thread block leaves a thread.
constexpr int kBatch = 8;
// LogFMT stages each warp's chunk in shared memory before it crosses.
constexpr int kStageBytes = 1024;

// A combine slot holds a LogFMT row (it may be longer: slots are whole lines).
static_assert(combine_row_bytes(7168) >= logfmt_row_bytes(7168) && combine_row_bytes(1408) >= logfmt_row_bytes(1408) &&
              combine_meta_offset(1408) == logfmt_meta_offset(1408));

struct LowLatencyCombineParams {
  LowLatencyCombineArgs args;
  Region region;
  Group group;
  Plan plan;
};

// The two 16-byte words (8 bf16 channels each) of a chunk that a lane owns.
// LogFMT needs a lane's 16 channels adjacent (8 lanes make a 128-channel
// group); bf16 takes words 32 apart, so that each store instruction of the
// warp writes 512 contiguous bytes.
template <bool kLogfmt>
__device__ __forceinline__ int lane_word(int chunk, int lane, int u) {
  return kLogfmt ? chunk * kChunkWords + 2 * lane + u : chunk * kChunkWords + lane + 32 * u;
}

__device__ __forceinline__ int global_warp() {
  return static_cast<int>((blockIdx.x * kThreads + threadIdx.x) / 32);
}

__device__ __forceinline__ int num_global_warps() {
  return static_cast<int>(gridDim.x * kWarps);
}

__host__ __device__ constexpr int num_chunks(int hidden) {
  return (hidden + kChunk - 1) / kChunk;
}

__device__ __forceinline__ void bf16x8_to_float(const int4& w, float* v) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

// Round to nearest even.
__device__ __forceinline__ int4 float_to_bf16x8(const float* v) {
  int4 w;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  return w;
}

// Why this rank's plan must not be combined: 2 its dispatch failed, 1 it was
// made for another shape, 0 it fits.
__device__ __forceinline__ int plan_misfit(const PlanHeader& h, const LowLatencyCombineArgs& a, int num_ranks) {
  if (h.failed != 0) return 2;
  if (h.num_max_tokens != a.num_max_tokens || h.hidden != a.hidden || h.num_experts != a.num_experts ||
      h.num_ranks != num_ranks || h.num_topk != a.num_topk || h.num_tokens != a.num_tokens)
    return 1;
  return 0;
}

template <typename T>
__device__ __forceinline__ const T* plan_array(const LowLatencyCombineParams& p, int64_t offset) {
  return reinterpret_cast<const T*>(static_cast<const char*>(p.args.plan) + offset);
}

__host__ __device__ constexpr int64_t combine_signal_offset(int parity, int rank) {
  return static_cast<int64_t>(offsetof(FixedArea, combine)) +
         (static_cast<int64_t>(parity) * kMaxGroupRanks + rank) * static_cast<int64_t>(sizeof(CombineSignal));
}

__device__ __forceinline__ const CombineSignal& combine_signal(const char* local, int parity, int rank) {
  return *reinterpret_cast<const CombineSignal*>(local + combine_signal_offset(parity, rank));
}

// ---------------------------------------------------------------------------
// Send

// This rank's combine weights of tokens first, first + stride, ... to the
// ranks of `live` that read them: per (token, slot k) the weight, 0 where
// topk_idx names no expert (that slot's row is dropped), tagged with the
// call's number. Groups of up to kPublishToAllRanks send them to every rank;
// larger ones only to the ranks holding one of the token's experts (the only
// ranks that read a token's weights, its topk_idx being the dispatch's).
template <class Transport>
__device__ void publish_weights(const LowLatencyCombineParams& p, const Transport& tr, uint32_t seq, int parity,
                                int first, int stride, PeerSet live) {
  const LowLatencyCombineArgs& a = p.args;
  const int K = a.num_topk, T = a.num_tokens;
  const int tokens = first < T ? (T - first + stride - 1) / stride : 0;
  for (int i = threadIdx.x; i < tokens * K; i += blockDim.x) {
    const int t = first + i / K * stride, k = i % K;
    const int64_t expert = __ldg(a.topk_idx + static_cast<int64_t>(t) * K + k);
    const float w =
        expert >= 0 && expert < a.num_experts ? __ldg(a.topk_weights + static_cast<int64_t>(t) * K + k) : 0.0f;
    const uint64_t word = static_cast<uint64_t>(__float_as_uint(w)) | static_cast<uint64_t>(word_tag(seq)) << 32;
    const int64_t at = p.region.weights_slot(parity, p.group.rank, t) + static_cast<int64_t>(sizeof(TaggedWeight)) * k;
    if (p.group.num_ranks <= kPublishToAllRanks) {
      for (int d = 0; d < p.group.num_ranks; ++d)
        if (live.has(d)) tr.put_tagged(d, at, word);
      continue;
    }
    const int L = a.num_experts / p.group.num_ranks;
    const int64_t* ids = a.topk_idx + static_cast<int64_t>(t) * K;
    for (int j = 0; j < K; ++j) {
      const int64_t e = __ldg(ids + j);
      if (e < 0 || e >= a.num_experts) continue;
      const int d = static_cast<int>(e) / L;
      bool repeat = false;
      for (int q = 0; q < j && !repeat; ++q) {
        const int64_t f = __ldg(ids + q);
        repeat = f >= 0 && f < a.num_experts && static_cast<int>(f) / L == d;
      }
      if (!repeat && live.has(d)) tr.put_tagged(d, at, word);
    }
  }
}

// Lane j < n: the weight of entry j of token t of source s in this call, the
// sum of the source's weights over the entry's top-k slots (k ascending).
// Waits (bounded) for the source's words of this call; gives 0 where they
// never came or the source's call had an unusable plan (then no rank writes
// the output anyway).
__device__ float published_weight(const LowLatencyCombineParams& p, const char* local, uint32_t seq, int parity, int s,
                                  int t, uint16_t slots, int lane) {
  const int K = p.args.num_topk;
  uint64_t word = 0;
  if (lane < K) {
    const auto* at = reinterpret_cast<const uint64_t*>(local + p.region.weights_slot(parity, s, t)) + lane;
    const uint32_t* bad_call = &combine_signal(local, parity, s).bad_call;
    device::bounded_wait(p.group.wait, p.group.wait.first_nvl_rank + s, WaitSite::kLowLatencyCombine, [&] {
      word = device::load_relaxed_sys(at);
      return tag_of_word(static_cast<uint32_t>(word >> 32)) == seq ||
             *static_cast<const volatile uint32_t*>(bad_call) == seq;
    });
    if (tag_of_word(static_cast<uint32_t>(word >> 32)) != seq) word = 0;
  }
  const float w = __uint_as_float(static_cast<uint32_t>(word));
  float sum = 0.0f;
  for (int k = 0; k < K; ++k) {
    const float wk = __shfl_sync(~0u, w, k);
    if (slots >> k & 1) sum += wk;
  }
  return sum;
}

// What a send warp knows of one (source, token, chunk) item. Lane j holds
// entry j of the token's plan: its row of x, and its weight or top-k slots.
struct SendItem {
  int source;
  int token;
  int chunk;
  uint32_t entries;  // bit j: entry j is summed
  int x_row;
  float weight;    // the dispatch's, where it gave weights
  uint16_t slots;  // otherwise the slots whose published weights make it
};

// Takes the lowest entry of `rest` (warp-uniform), or reports none left.
__device__ __forceinline__ bool next_entry(uint32_t& rest, int& j) {
  if (rest == 0) return false;
  j = __ffs(rest) - 1;
  rest &= rest - 1;
  return true;
}

// A far source's row, once this warp has staged one chunk of it: the warp
// that stages the last chunk puts the row. Each warp's stores are fenced
// before it counts its chunk. The count carries the call's number, so a count
// of an earlier call (or of another call shape's areas) starts again at 1:
// nothing needs zeroing, and a call that timed out leaves nothing behind.
template <bool kLogfmt, class Transport>
__device__ __forceinline__ void put_staged_row(const LowLatencyCombineParams& p, const Transport& tr, uint32_t seq,
                                               int parity, const SendItem& item, const char* staged) {
  const int lane = threadIdx.x % 32;
  auto* chunks =
      reinterpret_cast<unsigned long long*>(tr.local() + p.region.combine_chunks_slot(parity, item.source, item.token));
  __syncwarp();
  bool last = false;
  if (lane == 0) {
    __threadfence();
    const uint32_t tag = word_tag(seq);
    unsigned long long seen = *static_cast<volatile unsigned long long*>(chunks), expected = 0;
    uint32_t count = 0;
    do {
      expected = seen;
      count = static_cast<uint32_t>(expected >> 32) == tag ? static_cast<uint32_t>(expected) + 1 : 1;
      seen = atomicCAS(chunks, expected, static_cast<unsigned long long>(tag) << 32 | count);
    } while (seen != expected);
    last = count == static_cast<uint32_t>(num_chunks(p.args.hidden));
    if (last) __threadfence();
  }
  if (!__shfl_sync(~0u, last, 0)) return;
  __syncwarp();  // the other lanes read the row after lane 0's fence
  const int64_t bytes = kLogfmt ? logfmt_row_bytes(p.args.hidden) : combine_meta_offset(p.args.hidden);
  tr.put_warp(item.source, p.region.combine_slot(parity, item.token, p.group.rank), staged, bytes);
}

// sum_j weight_j * x[row_j] in fp32, j ascending (fused multiply-adds),
// rounded to bf16 once, to the source's slot (token, this rank). The first
// batch's rows are loaded before the weights are awaited.
template <bool kLogfmt, class Transport>
__device__ void send_sum(const LowLatencyCombineParams& p, const Transport& tr, uint32_t seq, int parity,
                         const SendItem& item, bool dispatch_weights, char* stage) {
  const int H = p.args.hidden, n16 = H / 8, lane = threadIdx.x % 32;
  const auto* x = static_cast<const char*>(p.args.x);
  float entry_weight = item.weight;
  bool weighed = dispatch_weights;
  float acc[16] = {};
  for (uint32_t rest = item.entries; rest != 0;) {
    float weight[kBatch];
    bool has[kBatch];
    int4 in[kBatch][2];
    int entry[kBatch];
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      int j = 0;
      has[r] = next_entry(rest, j);
      entry[r] = j;
      const int x_row = __shfl_sync(~0u, item.x_row, j);
      const char* src = has[r] ? x + static_cast<int64_t>(x_row) * H * 2 : x;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int w = lane_word<kLogfmt>(item.chunk, lane, u);
        in[r][u] = has[r] && w < n16 ? device::load_input_16(src + static_cast<int64_t>(w) * 16) : int4{};
      }
    }
    if (!weighed) {
      entry_weight = published_weight(p, tr.local(), seq, parity, item.source, item.token, item.slots, lane);
      weighed = true;
    }
#pragma unroll
    for (int r = 0; r < kBatch; ++r) weight[r] = __shfl_sync(~0u, entry_weight, entry[r]);
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      if (!has[r]) break;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        float v[8];
        bf16x8_to_float(in[r][u], v);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[8 * u + i] = fmaf(weight[r], v[i], acc[8 * u + i]);
      }
    }
  }
  const bool far = tr.is_far(item.source);
  char* dst = far ? tr.local() + p.region.combine_stage_slot(parity, item.source, item.token)
                  : tr.remote(item.source, p.region.combine_slot(parity, item.token, p.group.rank));
  if constexpr (kLogfmt) {
    // The bf16 row is what is cast: both formats carry the same values up to the cast.
    float v[16];
    bf16x8_to_float(float_to_bf16x8(acc), v);
    bf16x8_to_float(float_to_bf16x8(acc + 8), v + 8);
    put_logfmt_chunk(dst, H, item.chunk, v, lane_word<true>(item.chunk, lane, 0) < n16, stage);
  } else {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int w = lane_word<false>(item.chunk, lane, u);
      if (w < n16) device::store_16(dst + static_cast<int64_t>(w) * 16, float_to_bf16x8(acc + 8 * u));
    }
  }
  if constexpr (Transport::kReachesFar) {
    if (far) put_staged_row<kLogfmt>(p, tr, seq, parity, item, dst);
  }
}

// Items (token, source, chunk), chunk fastest, so warps running together
// write to every source rank of `live`. Tokens past a source's count, and
// tokens with no expert here, are skipped at the cost of a few loads.
template <bool kLogfmt, class Transport>
__device__ void send_rows(const LowLatencyCombineParams& p, const Transport& tr, uint32_t seq, int parity,
                          bool dispatch_weights, PeerSet live, char* stage) {
  const LowLatencyCombineArgs& a = p.args;
  const int R = p.group.num_ranks, M = a.num_max_tokens, K = a.num_topk;
  const int num_x_rows = p.plan.num_local_experts * M * R;
  const int lane = threadIdx.x % 32;
  const int32_t* token_entries = plan_array<int32_t>(p, p.plan.token_entries);
  const int32_t* token_rows = plan_array<int32_t>(p, p.plan.token_rows);
  const uint16_t* token_slots = plan_array<uint16_t>(p, p.plan.token_slots);
  const float* token_weights = plan_array<float>(p, p.plan.token_weights);
  // Lane s < R: the tokens source s sent (at most M, whatever the plan says).
  const int32_t* source_tokens = plan_array<int32_t>(p, p.plan.source_tokens);
  // The tokens source s sent (at most M, whatever the plan says); none for a masked source.
  auto tokens_of = [&](int s) { return live.has(s) ? max(0, min(source_tokens[s], M)) : 0; };
  int most = 0;
  for (int s = lane; s < R; s += 32) most = max(most, tokens_of(s));
  const int max_tokens = __reduce_max_sync(~0u, most);
  const int C = num_chunks(a.hidden);
  const int num_items = max_tokens * R * C;
  for (int i = global_warp(); i < num_items; i += num_global_warps()) {
    SendItem item;
    item.chunk = i % C;
    item.source = i / C % R;
    item.token = i / (C * R);
    if (item.token >= tokens_of(item.source)) continue;
    const int64_t entry = static_cast<int64_t>(item.source) * M + item.token;
    // Loaded together: entries past the count are stale, and masked below.
    const int n = min(token_entries[entry], K);
    item.x_row = lane < K ? token_rows[entry * kLowLatencyMaxTopk + lane] : -1;
    item.weight = dispatch_weights && lane < K ? token_weights[entry * kLowLatencyMaxTopk + lane] : 0.0f;
    item.slots = !dispatch_weights && lane < K ? token_slots[entry * kLowLatencyMaxTopk + lane] : 0;
    if (n <= 0) continue;
    // Bounds on what the plan says, so that a plan whose header fits but whose
    // body does not (reused memory) never reads outside x.
    item.entries = __ballot_sync(~0u, lane < n && item.x_row >= 0 && item.x_row < num_x_rows);
    if (item.entries == 0) continue;
    send_sum<kLogfmt>(p, tr, seq, parity, item, dispatch_weights, stage);
  }
}

// One call's send, on every thread of the grid: the weights (unless the
// dispatch had them), the rows, then the block's arrival at every rank. A
// rank whose plan is unusable says so to every rank before anything else
// (their sends may be waiting for its weights), and sends no row.
template <bool kLogfmt, class Transport>
__device__ __forceinline__ void send_call(const LowLatencyCombineParams& p, const Transport& tr, uint64_t n, bool fused,
                                          char* stage) {
  __shared__ bool publisher;
  const Group& g = p.group;
  auto* fixed = reinterpret_cast<FixedArea*>(tr.local());
  const uint32_t seq = call_tag(n);
  const int parity = static_cast<int>(n & 1);
  const int64_t signal = combine_signal_offset(parity, g.rank);
  __shared__ uint32_t live_bits[kRankWords];
  const PeerSet live = block_live_set(g.wait, g.num_ranks, g.rank, live_bits);
  const PlanHeader header = *plan_array<PlanHeader>(p, p.plan.header);
  const int misfit = plan_misfit(header, p.args, g.num_ranks);
  const bool dispatch_weights = header.has_weights != 0;
  stamp(2, false, misfit);
  if (misfit != 0) {
    for (int d = static_cast<int>(threadIdx.x); blockIdx.x == 0 && d < g.num_ranks; d += kThreads)
      if (live.has(d)) tr.set_word(d, signal + offsetof(CombineSignal, bad_call), seq);
    if (blockIdx.x == 0 && threadIdx.x == 0)
      device::record_error(g.wait.errors, DeviceErrorCode::kBadHandle, g.wait.rank, g.wait.rank,
                           static_cast<int>(OpKind::kLowLatencyCombine), misfit, 0);
  } else {
    if (!dispatch_weights) {
      if (fused) {
        publish_weights(p, tr, seq, parity, blockIdx.x, gridDim.x, live);
      } else {
        if (threadIdx.x == 0) publisher = atomicAdd(&fixed->local.weights_claim, 1u) == 0;
        __syncthreads();
        if (publisher) publish_weights(p, tr, seq, parity, 0, 1, live);
      }
      stamp(3);
    }
    send_rows<kLogfmt>(p, tr, seq, parity, dispatch_weights, live, stage + threadIdx.x / 32 * kStageBytes);
    stamp(4);
  }
  arrive_at_peers(tr, g.num_ranks, signal + offsetof(CombineSignal, arrivals), live);
  stamp(5);
}

// ---------------------------------------------------------------------------
// Receive

// Takes the lowest rank among the slots of `rest` (lane k holds slot k's
// rank; warp-uniform), dropping every slot of that rank, or reports none left.
__device__ __forceinline__ bool next_rank(uint32_t& rest, int rank, int& d) {
  if (rest == 0) return false;
  const int lane = threadIdx.x % 32;
  d = __reduce_min_sync(~0u, (rest >> lane & 1) ? rank : INT_MAX);
  rest &= ~__ballot_sync(~0u, rank == d);
  return true;
}

// Lane k < K of a warp: token t's top-k slot k (-1 past the top-k).
__device__ __forceinline__ int64_t topk_slot(const LowLatencyCombineArgs& a, int t, int lane) {
  return lane < a.num_topk ? __ldg(a.topk_idx + static_cast<int64_t>(t) * a.num_topk + lane) : -1;
}

// Out row t, chunk c = the sum of the rows (t, d) of the ranks d of `counted`
// holding one of the token's experts, d ascending, in fp32, rounded to bf16
// once. `first_slot`: topk_slot of the warp's first item, loaded before the
// wait for the peers.
template <bool kLogfmt>
__device__ void reduce_tokens(const LowLatencyCombineParams& p, const char* self, int parity, PeerSet counted,
                              int64_t first_slot) {
  const LowLatencyCombineArgs& a = p.args;
  const int H = a.hidden, E = a.num_experts, n16 = H / 8;
  const int L = p.plan.num_local_experts;
  const int lane = threadIdx.x % 32;
  // LogFMT decodes in registers: fewer rows in flight.
  constexpr int kRows = kLogfmt ? 2 : kBatch;
  const int C = num_chunks(H);
  const int num_items = a.num_tokens * C;
  for (int i = global_warp(); i < num_items; i += num_global_warps()) {
    const int t = i / C, c = i % C;
    // Lane k looks at top-k slot k; ids outside [0, E) name no row (dispatch
    // rejects them, so they only come from a topk_idx it never saw).
    const int64_t expert = i == global_warp() ? first_slot : topk_slot(a, t, lane);
    const bool named = expert >= 0 && expert < E;
    const int rank = named ? static_cast<int>(expert) / L : -1;
    const uint32_t slots = __ballot_sync(~0u, named && counted.has(rank));
    float acc[16] = {};
    for (uint32_t rest = slots; rest != 0;) {
      bool has[kRows];
      const char* row[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        int d = 0;
        has[r] = next_rank(rest, rank, d);
        row[r] = self + p.region.combine_slot(parity, t, d);
      }
      if constexpr (kLogfmt) {
        LogfmtLaneWords words[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          words[r] = load_logfmt_lane(row[r], H, c, has[r] && lane_word<true>(c, lane, 0) < n16);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (!has[r]) break;
          float v[16];
          decode_logfmt_lane(words[r], v);
#pragma unroll
          for (int k = 0; k < 16; ++k) acc[k] += v[k];
        }
      } else {
        int4 in[kRows][2];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const int w = lane_word<false>(c, lane, u);
            in[r][u] = has[r] && w < n16 ? device::load_shared_16(row[r] + static_cast<int64_t>(w) * 16) : int4{};
          }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (!has[r]) break;
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            float v[8];
            bf16x8_to_float(in[r][u], v);
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[8 * u + k] += v[k];
          }
        }
      }
    }
    char* out = static_cast<char*>(a.out) + static_cast<int64_t>(t) * H * 2;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int w = lane_word<kLogfmt>(c, lane, u);
      if (w < n16) device::store_16(out + static_cast<int64_t>(w) * 16, float_to_bf16x8(acc + 8 * u));
    }
  }
}

// Call n's receive, on every thread of the grid. The receive's call number
// advances at the end, and the send's (call send_n) where this launch ran the
// send too (`sent`).
template <bool kLogfmt, class Transport>
__device__ __forceinline__ void recv_call(const LowLatencyCombineParams& p, const Transport& tr, uint64_t n,
                                          uint64_t send_n, bool sent) {
  const LowLatencyCombineArgs& a = p.args;
  const Group& g = p.group;
  auto* fixed = reinterpret_cast<FixedArea*>(tr.local());
  const uint32_t seq = call_tag(n), target = arrivals_after(n);
  const int parity = static_cast<int>(n & 1);
  // Every block reads every expert rank's rows, so every block waits for all
  // (in shrink mode, for every one that counts).
  __shared__ uint32_t live_bits[kRankWords], counted_bits[kRankWords], failed_bits[kRankWords];
  // Loaded before the wait, as neither depends on the peers: the plan's
  // header (this rank's dispatch wrote it, in a kernel before) and the top-k
  // of this warp's first item.
  const PlanHeader header = *plan_array<PlanHeader>(p, p.plan.header);
  const int first_item = global_warp();
  const int64_t first_slot = first_item < a.num_tokens * num_chunks(a.hidden)
                                 ? topk_slot(a, first_item / num_chunks(a.hidden), static_cast<int>(threadIdx.x % 32))
                                 : -1;
  const PeerSet live = block_live_set(g.wait, g.num_ranks, g.rank, live_bits, counted_bits, failed_bits);
  bool arrived = true;
  for (int d = static_cast<int>(threadIdx.x); d < g.num_ranks; d += kThreads) {
    const uint64_t start = device::global_timer_ns();
    const uint32_t* arrivals = &fixed->combine[parity][d].arrivals;
    bool failed = false;
    const bool counts =
        peer_counts(g.receive_wait, d, WaitSite::kLowLatencyCombine, &fixed->local.combine_verdict[d], seq, live.has(d),
                    failed, [&] { return static_cast<int32_t>(device::load_acquire_sys(arrivals) - target) >= 0; });
    arrived &= !failed;
    if (counts) set_rank_bit(counted_bits, d);
    // The bad-call word of a rank whose arrivals this thread acquired.
    if (counts && !failed && __ldcg(&fixed->combine[parity][d].bad_call) == seq) set_rank_bit(failed_bits, d);
    if (blockIdx.x == 0 && a.wait_recv_cost_stats != nullptr)
      a.wait_recv_cost_stats[d] += static_cast<int64_t>(device::global_timer_ns() - start);
  }
  const bool all_arrived = __syncthreads_and(arrived) != 0;
  stamp(6);
  const int failed_rank = first_rank(failed_bits, g.num_ranks, -1);
  // A misfit plan is this rank's own error: its send recorded it.
  const int misfit = plan_misfit(header, a, g.num_ranks);
  if (all_arrived && failed_rank < 0 && misfit == 0) {
    reduce_tokens<kLogfmt>(p, tr.local(), parity, PeerSet{counted_bits}, first_slot);
    stamp(7);
  } else if (all_arrived && misfit == 0 && blockIdx.x == 0 && threadIdx.x == 0)
    device::record_error(g.wait.errors, DeviceErrorCode::kPeerInputError, g.wait.rank,
                         g.wait.first_nvl_rank + failed_rank, static_cast<int>(OpKind::kLowLatencyCombine), 0, 0);
  if (sent)
    advance_both(&fixed->local.combine_send, send_n, &fixed->local.combine_recv, n,
                 &fixed->combine[send_n & 1][g.rank].arrivals);
  else
    finish_phase(&fixed->local.combine_recv, n, [] {});
}

// Both phases in one launch only where every block of the grid is resident
// at once (a GPU no other rank of the group shares): a block that has sent
// waits for every expert rank, this rank's own blocks among them.
template <bool kLogfmt, class Transport>
__global__ void __launch_bounds__(kThreads, 1)
    combine_kernel(const __grid_constant__ LowLatencyCombineParams p, const int phases) {
  __shared__ void* table[kSharedRegionTable];
  __shared__ __align__(16) char stage[kLogfmt ? kWarps * kStageBytes : 16];
  const Transport tr = block_transport<Transport>(p.group, table);
  // The inputs and the call numbers may come from the kernel before.
  device::wait_for_prior_grids();
  device::allow_dependents();
  stamp_start();
  LocalState* state = &reinterpret_cast<FixedArea*>(tr.local())->local;
  // Both numbers before any work: the receive's last block stores the send's.
  const uint64_t send_n = phases & kPhaseSend ? call_number(&state->combine_send) : 0;
  const uint64_t recv_n = phases & kPhaseReceive ? call_number(&state->combine_recv) : 0;
  stamp(1, false, send_n + recv_n);
  if (phases & kPhaseSend) {
    const bool fused = (phases & kPhaseReceive) != 0;
    send_call<kLogfmt>(p, tr, send_n, fused, stage);
    if (!fused)
      finish_phase(&state->combine_send, send_n, [&] {
        if (threadIdx.x == 0) state->weights_claim = 0;
      });
  }
  if (phases & kPhaseReceive) recv_call<kLogfmt>(p, tr, recv_n, send_n, (phases & kPhaseSend) != 0);
  print_stamps("combine", p.group.rank, phases & kPhaseSend ? send_n : recv_n, phases);
}

template <bool kLogfmt, class Transport>
void launch(const LowLatencyCombineParams& p, const Group& group, LowLatencyPhase phase, cudaStream_t stream) {
  const LowLatencyCombineArgs& a = p.args;
  const int blocks =
      combine_blocks(a.num_tokens, group.num_ranks, a.num_max_tokens, num_chunks(a.hidden), kWarps, group.num_blocks);
  launch_phases(combine_kernel<kLogfmt, Transport>, blocks, kThreads, group, phase, stream, p);
}

}  // namespace combine_body

// One op's launches on `Transport` (see launch_combine in launch.hpp).
template <class Transport>
void launch_combine_on(const LowLatencyCombineArgs& args, const Region& region, const Group& group,
                       LowLatencyPhase phase, cudaStream_t stream) {
  using namespace combine_body;
  const LowLatencyCombineParams p{args, region, group,
                                  make_plan(args.num_max_tokens, group.num_ranks, args.num_experts)};
  if (args.use_logfmt)
    launch<true, Transport>(p, group, phase, stream);
  else
    launch<false, Transport>(p, group, phase, stream);
}

}  // namespace
}  // namespace turnout::kernels::low_latency
