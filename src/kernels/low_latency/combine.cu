// Low-latency combine. The send kernel of an expert rank returns the rows its
// experts computed to the ranks their tokens came from, into fixed slots (one
// per (token, top-k slot), or with dispatch weights one pre-reduced row per
// (token, expert rank)); the receive kernel of a source rank waits for every
// expert rank's flag and sums each token's rows in a fixed order, in fp32.
//
// Work is items of kChunk channels of one token (and, to send, one source),
// one warp each, strided over every warp of the grid: a decode batch has few
// tokens, so splitting rows is what keeps all SMs busy. In a chunk a lane
// owns the 16-byte wire words lane + 32 u, u < kSteps (8 bf16 or 16 e4m3
// channels each). Nothing waits for another block; sends never wait.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/device/bounded_wait.cuh"
#include "kernels/device/error_record.cuh"
#include "kernels/device/memory_order.cuh"
#include "kernels/device/vector_copy.cuh"
#include "kernels/low_latency/call_counter.cuh"
#include "kernels/low_latency/launch.hpp"
#include "kernels/low_latency/logfmt.cuh"
#include "kernels/low_latency/region.hpp"
#include "kernels/low_latency/transport.cuh"
#include "turnout/error.hpp"

namespace turnout::kernels::low_latency {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// 14 items per token at hidden 7168; a multiple of the 128-channel scale group.
constexpr int kChunk = 512;
static_assert(kChunk % kGroup == 0);
// Rows whose words a lane loads before using any: a top-8 token's rows in one
// round trip (16 words in flight for bf16), within the 128 registers a
// 512-thread block leaves a thread.
constexpr int kBatch = 8;

struct CombineParams {
  LowLatencyCombineArgs args;
  Region region;
  Group group;
  Plan plan;
};

// The wire words of one lane in one chunk.
template <bool kLogfmt>
struct Wire {
  static constexpr int kChannels = kLogfmt ? 16 : 8;  // per wire word
  static constexpr int kSteps = kChunk / (32 * kChannels);
  static constexpr int kBf16Words = kChannels / 8;  // of x or out per wire word
};

__device__ __forceinline__ int global_warp() {
  return static_cast<int>((blockIdx.x * kThreads + threadIdx.x) / 32);
}

__device__ __forceinline__ int num_global_warps() {
  return static_cast<int>(gridDim.x * kWarps);
}

__device__ __forceinline__ int num_chunks(int hidden) {
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

// Writes wire word `step` of a logfmt row: 16 values as e4m3, and the scale of
// their 128 channels from the first of the 8 lanes that share it. Every lane
// of the warp calls it (the amax is reduced across lanes); `in_row` is false
// past the row's end, which only ever holds whole groups of 8 lanes.
__device__ __forceinline__ void put_logfmt_word(char* row, int step, const float* v, bool in_row, int hidden) {
  float amax = 0.0f;
  if (in_row)
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(~0u, amax, o));
  if (!in_row) return;
  const LogfmtScale s = logfmt_scale(amax);
  device::store_16(row + static_cast<int64_t>(step) * 16, to_e4m3x16(v, s.inv));
  if (step % 8 == 0) reinterpret_cast<float*>(row + combine_logfmt_scales_offset(hidden))[step / 8] = s.scale;
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
__device__ __forceinline__ const T* plan_array(const CombineParams& p, int64_t offset) {
  return reinterpret_cast<const T*>(static_cast<const char*>(p.args.plan) + offset);
}

__device__ __forceinline__ int64_t combine_signal_offset(int parity, int rank) {
  return static_cast<int64_t>(offsetof(FixedArea, combine)) +
         (static_cast<int64_t>(parity) * kMaxRanks + rank) * static_cast<int64_t>(sizeof(CombineSignal));
}

// What a send warp knows of one (source, token, chunk) item. Lane j holds
// entry j of the token's plan: its row of x, and where it goes at the source.
struct SendItem {
  int source;
  int token;
  int chunk;
  uint32_t entries;  // bit j: entry j is sent
  int x_row;
  int64_t slot;  // default mode only
  float weight;  // pre-reduced only
};

// Takes the lowest entry of `rest` (warp-uniform), or reports none left.
__device__ __forceinline__ bool next_entry(uint32_t& rest, int& j) {
  if (rest == 0) return false;
  j = __ffs(rest) - 1;
  rest &= rest - 1;
  return true;
}

// Default mode: each entry's row as it is, bf16 or logfmt, to its own slot.
template <bool kLogfmt>
__device__ void send_copies(const CombineParams& p, const NvlinkTransport& transport, int parity,
                            const SendItem& item) {
  using W = Wire<kLogfmt>;
  const int H = p.args.hidden, lane = threadIdx.x % 32;
  const int num_steps = H / W::kChannels;
  const int first_step = item.chunk * (kChunk / W::kChannels);
  const auto* x = static_cast<const char*>(p.args.x);
  for (uint32_t rest = item.entries; rest != 0;) {
    int entry[kBatch];  // -1: none
    int4 in[kBatch][W::kSteps][W::kBf16Words];
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      int j = 0;
      const bool has = next_entry(rest, j);
      entry[r] = has ? j : -1;
      const int x_row = __shfl_sync(~0u, item.x_row, j);
      const char* src = has ? x + static_cast<int64_t>(x_row) * H * 2 : x;
#pragma unroll
      for (int u = 0; u < W::kSteps; ++u) {
        const int step = first_step + lane + 32 * u;
#pragma unroll
        for (int w = 0; w < W::kBf16Words; ++w)
          in[r][u][w] = has && step < num_steps
                            ? device::load_input_16(src + (static_cast<int64_t>(step) * W::kBf16Words + w) * 16)
                            : int4{};
      }
    }
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      if (entry[r] < 0) break;
      char* dst = transport.remote(item.source, p.region.combine_slot(parity, __shfl_sync(~0u, item.slot, entry[r])));
#pragma unroll
      for (int u = 0; u < W::kSteps; ++u) {
        const int step = first_step + lane + 32 * u;
        if constexpr (kLogfmt) {
          float v[16];
          bf16x8_to_float(in[r][u][0], v);
          bf16x8_to_float(in[r][u][1], v + 8);
          put_logfmt_word(dst, step, v, step < num_steps, H);
        } else if (step < num_steps) {
          device::store_16(dst + static_cast<int64_t>(step) * 16, in[r][u][0]);
        }
      }
    }
  }
}

// Pre-reduced mode: sum_j weight_j * x[row_j] in fp32, j ascending (fused
// multiply-adds), rounded to bf16 once; logfmt casts that bf16 row, so both
// formats carry the same values up to the cast.
template <bool kLogfmt>
__device__ void send_sum(const CombineParams& p, const NvlinkTransport& transport, int parity, const SendItem& item) {
  using W = Wire<kLogfmt>;
  const int H = p.args.hidden, lane = threadIdx.x % 32;
  const int num_steps = H / W::kChannels;
  const int first_step = item.chunk * (kChunk / W::kChannels);
  const auto* x = static_cast<const char*>(p.args.x);
  float acc[W::kSteps][W::kChannels] = {};
  for (uint32_t rest = item.entries; rest != 0;) {
    float weight[kBatch];
    bool has[kBatch];
    int4 in[kBatch][W::kSteps][W::kBf16Words];
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      int j = 0;
      has[r] = next_entry(rest, j);
      const int x_row = __shfl_sync(~0u, item.x_row, j);
      weight[r] = __shfl_sync(~0u, item.weight, j);
      const char* src = has[r] ? x + static_cast<int64_t>(x_row) * H * 2 : x;
#pragma unroll
      for (int u = 0; u < W::kSteps; ++u) {
        const int step = first_step + lane + 32 * u;
#pragma unroll
        for (int w = 0; w < W::kBf16Words; ++w)
          in[r][u][w] = has[r] && step < num_steps
                            ? device::load_input_16(src + (static_cast<int64_t>(step) * W::kBf16Words + w) * 16)
                            : int4{};
      }
    }
#pragma unroll
    for (int r = 0; r < kBatch; ++r) {
      if (!has[r]) break;
#pragma unroll
      for (int u = 0; u < W::kSteps; ++u)
#pragma unroll
        for (int w = 0; w < W::kBf16Words; ++w) {
          float v[8];
          bf16x8_to_float(in[r][u][w], v);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[u][8 * w + i] = fmaf(weight[r], v[i], acc[u][8 * w + i]);
        }
    }
  }
  const int64_t slot = static_cast<int64_t>(item.token) * p.group.num_ranks + p.group.rank;
  char* dst = transport.remote(item.source, p.region.combine_slot(parity, slot));
#pragma unroll
  for (int u = 0; u < W::kSteps; ++u) {
    const int step = first_step + lane + 32 * u;
    if constexpr (kLogfmt) {
      float v[16];
      bf16x8_to_float(float_to_bf16x8(acc[u]), v);
      bf16x8_to_float(float_to_bf16x8(acc[u] + 8), v + 8);
      put_logfmt_word(dst, step, v, step < num_steps, H);
    } else if (step < num_steps) {
      device::store_16(dst + static_cast<int64_t>(step) * 16, float_to_bf16x8(acc[u]));
    }
  }
}

// Items (token, source, chunk), chunk fastest, so warps running together
// write to every source rank. Tokens past a source's count, and tokens with
// no expert here, are skipped at the cost of a few loads.
template <bool kLogfmt>
__device__ void send_rows(const CombineParams& p, const NvlinkTransport& transport, int parity, bool reduced) {
  const LowLatencyCombineArgs& a = p.args;
  const int R = p.group.num_ranks, M = a.num_max_tokens, K = a.num_topk;
  const int num_x_rows = p.plan.num_local_experts * M * R;
  const int lane = threadIdx.x % 32;
  const int32_t* row_info = plan_array<int32_t>(p, p.plan.row_info);
  const int32_t* token_entries = plan_array<int32_t>(p, p.plan.token_entries);
  const int32_t* token_rows = plan_array<int32_t>(p, p.plan.token_rows);
  const float* token_weights = plan_array<float>(p, p.plan.token_weights);
  // Lane s < R: the tokens source s sent (at most M, whatever the plan says).
  const int lane_tokens = lane < R ? max(0, min(plan_array<int32_t>(p, p.plan.source_tokens)[lane], M)) : 0;
  const int max_tokens = __reduce_max_sync(~0u, lane_tokens);
  const int C = num_chunks(a.hidden);
  const int num_items = max_tokens * R * C;
  for (int i = global_warp(); i < num_items; i += num_global_warps()) {
    SendItem item;
    item.chunk = i % C;
    item.source = i / C % R;
    item.token = i / (C * R);
    if (item.token >= __shfl_sync(~0u, lane_tokens, item.source)) continue;
    const int64_t entry = static_cast<int64_t>(item.source) * M + item.token;
    // Loaded together: entries past the count are stale, and masked below.
    const int n = min(token_entries[entry], K);
    item.x_row = lane < K ? token_rows[entry * kMaxTopk + lane] : -1;
    item.weight = reduced && lane < K ? token_weights[entry * kMaxTopk + lane] : 0.0f;
    if (n <= 0) continue;
    // Bounds on what the plan says, so that a plan whose header fits but whose
    // body does not (reused memory) never writes outside the source's slots.
    bool sent = lane < n && item.x_row >= 0 && item.x_row < num_x_rows;
    item.slot = 0;
    if (sent && !reduced) {
      const int k = row_info_topk_slot(row_info[item.x_row]);
      sent = k < K;
      item.slot = static_cast<int64_t>(item.token) * K + k;
    }
    item.entries = __ballot_sync(~0u, sent);
    if (item.entries == 0) continue;
    if (reduced)
      send_sum<kLogfmt>(p, transport, parity, item);
    else
      send_copies<kLogfmt>(p, transport, parity, item);
  }
}

// One call's send, on every thread of the grid.
template <bool kLogfmt>
__device__ __forceinline__ void send_call(const CombineParams& p) {
  const Group& g = p.group;
  const NvlinkTransport transport{g.regions, g.rank};
  auto* fixed = reinterpret_cast<FixedArea*>(transport.local());
  const uint32_t seq = call_number(&fixed->local.combine_send);
  const int parity = static_cast<int>(seq & 1);
  const PlanHeader header = *plan_array<PlanHeader>(p, p.plan.header);
  const int misfit = plan_misfit(header, p.args, g.num_ranks);
  if (misfit != 0) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      device::record_error(g.wait.errors, DeviceErrorCode::kBadHandle, g.wait.rank, g.wait.rank,
                           static_cast<int>(OpKind::kLowLatencyCombine), misfit, 0);
  } else {
    send_rows<kLogfmt>(p, transport, parity, header.has_weights != 0);
  }
  // Every block's rows are fenced before the closing step (finish_call), and
  // each source's error word before its flag.
  finish_call(&fixed->local.combine_send, seq, [&] {
    const int source = static_cast<int>(threadIdx.x);
    if (source >= g.num_ranks) return;
    const int64_t signal = combine_signal_offset(parity, g.rank);
    *reinterpret_cast<volatile int32_t*>(transport.remote(source, signal + offsetof(CombineSignal, error))) =
        misfit != 0;
    NvlinkTransport::fence();
    transport.signal(source, signal + offsetof(CombineSignal, flag), seq);
  });
}

// Out row t, chunk c = sum over the token's rows, in a fixed order, of
// weight * row in fp32 (fused multiply-adds), rounded to bf16 once. Default:
// rows k = 0..K-1 of named experts, row of k the slot t * K + (first k' naming
// the same expert), weight topk_weights[t, k]. Pre-reduced: the rows t * R + d
// of the ranks d holding one of the token's experts, d ascending, weight 1
// (exact: fmaf(1, v, acc) is v + acc). A logfmt row value is float(q) * scale.
template <bool kLogfmt>
__device__ void reduce_tokens(const CombineParams& p, const char* self, int parity, bool reduced) {
  using W = Wire<kLogfmt>;
  const LowLatencyCombineArgs& a = p.args;
  const int R = p.group.num_ranks, K = a.num_topk, H = a.hidden, E = a.num_experts;
  const int L = p.plan.num_local_experts;
  const int lane = threadIdx.x % 32;
  const int num_steps = H / W::kChannels;
  const int64_t scales = combine_logfmt_scales_offset(H);
  const int C = num_chunks(H);
  const int num_items = a.num_tokens * C;
  for (int i = global_warp(); i < num_items; i += num_global_warps()) {
    const int t = i / C, first_step = i % C * (kChunk / W::kChannels);
    // Lane k looks at top-k slot k; ids outside [0, E) name no row (dispatch
    // rejects them, so they only come from a topk_idx it never saw).
    const int64_t expert = lane < K ? __ldg(a.topk_idx + static_cast<int64_t>(t) * K + lane) : -1;
    const bool named = expert >= 0 && expert < E;
    uint32_t rows;
    int64_t slot;
    float weight;
    if (reduced) {
      rows = __reduce_or_sync(~0u, named ? 1u << (static_cast<int>(expert) / L) : 0u);
      slot = static_cast<int64_t>(t) * R + lane;
      weight = 1.0f;
    } else {
      // Lanes not naming an expert match nobody.
      const uint32_t same = __match_any_sync(~0u, named ? static_cast<long long>(expert) : -1LL - lane);
      rows = __ballot_sync(~0u, named);
      slot = static_cast<int64_t>(t) * K + (__ffs(same) - 1);
      weight = lane < K ? __ldg(a.topk_weights + static_cast<int64_t>(t) * K + lane) : 0.0f;
    }
    float acc[W::kSteps][W::kChannels] = {};
    for (uint32_t rest = rows; rest != 0;) {
      bool has[kBatch];
      float w[kBatch];
      int4 in[kBatch][W::kSteps];
      float scale[kBatch][W::kSteps];
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        int j = 0;
        has[r] = next_entry(rest, j);
        const char* row = self + p.region.combine_slot(parity, __shfl_sync(~0u, slot, j));
        w[r] = __shfl_sync(~0u, weight, j);
#pragma unroll
        for (int u = 0; u < W::kSteps; ++u) {
          const int step = first_step + lane + 32 * u;
          const bool load = has[r] && step < num_steps;
          in[r][u] = load ? device::load_shared_16(row + static_cast<int64_t>(step) * 16) : int4{};
          if constexpr (kLogfmt)
            scale[r][u] = load ? __ldcg(reinterpret_cast<const float*>(row + scales) + step / 8) : 0.0f;
        }
      }
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        if (!has[r]) break;
#pragma unroll
        for (int u = 0; u < W::kSteps; ++u) {
          float v[W::kChannels];
          if constexpr (kLogfmt) {
            e4m3x16_to_float(in[r][u], v);
#pragma unroll
            for (int c = 0; c < W::kChannels; ++c) v[c] *= scale[r][u];
          } else {
            bf16x8_to_float(in[r][u], v);
          }
#pragma unroll
          for (int c = 0; c < W::kChannels; ++c) acc[u][c] = fmaf(w[r], v[c], acc[u][c]);
        }
      }
    }
    char* out = static_cast<char*>(a.out) + static_cast<int64_t>(t) * H * 2;
#pragma unroll
    for (int u = 0; u < W::kSteps; ++u) {
      const int step = first_step + lane + 32 * u;
      if (step >= num_steps) continue;
#pragma unroll
      for (int w = 0; w < W::kBf16Words; ++w)
        device::store_16(out + (static_cast<int64_t>(step) * W::kBf16Words + w) * 16, float_to_bf16x8(acc[u] + 8 * w));
    }
  }
}

// One call's receive, on every thread of the grid.
template <bool kLogfmt>
__device__ __forceinline__ void recv_call(const CombineParams& p) {
  const LowLatencyCombineArgs& a = p.args;
  const Group& g = p.group;
  const NvlinkTransport transport{g.regions, g.rank};
  auto* fixed = reinterpret_cast<FixedArea*>(transport.local());
  const uint32_t seq = call_number(&fixed->local.combine_recv);
  const int parity = static_cast<int>(seq & 1);
  const CombineSignal* signals = fixed->combine[parity];
  // Every block reads every expert rank's rows, so every block waits for all.
  bool arrived = true;
  if (static_cast<int>(threadIdx.x) < g.num_ranks) {
    const int d = static_cast<int>(threadIdx.x);
    const uint64_t start = device::global_timer_ns();
    arrived = device::bounded_wait(g.wait, g.wait.first_nvl_rank + d, WaitSite::kLowLatencyCombine,
                                   [&] { return device::load_acquire_sys(&signals[d].flag) == seq; });
    if (blockIdx.x == 0 && a.wait_recv_cost_stats != nullptr)
      a.wait_recv_cost_stats[d] += static_cast<int64_t>(device::global_timer_ns() - start);
  }
  const bool all_arrived = __syncthreads_and(arrived) != 0;
  // Each lane d < R reads the error word of the flag it acquired.
  __shared__ uint32_t s_failed_ranks;
  if (threadIdx.x < 32) {
    const int d = static_cast<int>(threadIdx.x);
    const uint32_t failed =
        __ballot_sync(~0u, all_arrived && d < g.num_ranks && device::load_volatile(&signals[d].error) != 0);
    if (d == 0) s_failed_ranks = failed;
  }
  __syncthreads();
  const uint32_t failed_ranks = s_failed_ranks;
  const PlanHeader header = *plan_array<PlanHeader>(p, p.plan.header);
  // A misfit plan is this rank's own error: its send recorded it.
  const int misfit = plan_misfit(header, a, g.num_ranks);
  if (all_arrived && failed_ranks == 0 && misfit == 0)
    reduce_tokens<kLogfmt>(p, transport.local(), parity, header.has_weights != 0);
  else if (all_arrived && misfit == 0 && blockIdx.x == 0 && threadIdx.x == 0)
    device::record_error(g.wait.errors, DeviceErrorCode::kPeerInputError, g.wait.rank,
                         g.wait.first_nvl_rank + __ffs(failed_ranks) - 1, static_cast<int>(OpKind::kLowLatencyCombine),
                         0, 0);
  finish_call(&fixed->local.combine_recv, seq, [] {});
}

template <bool kLogfmt>
__global__ void __launch_bounds__(kThreads, 1) low_latency_combine_send_kernel(const CombineParams p) {
  send_call<kLogfmt>(p);
}

template <bool kLogfmt>
__global__ void __launch_bounds__(kThreads, 1) low_latency_combine_recv_kernel(const CombineParams p) {
  recv_call<kLogfmt>(p);
}

// Both in one launch, where every block of the grid is resident at once (a
// GPU no other rank of the group shares): a block that has sent waits for
// every expert rank, this one's own last block among them.
template <bool kLogfmt>
__global__ void __launch_bounds__(kThreads, 1) low_latency_combine_kernel(const CombineParams p) {
  send_call<kLogfmt>(p);
  recv_call<kLogfmt>(p);
}

CombineParams make_params(const LowLatencyCombineArgs& args, const Region& region, const Group& group) {
  return {args, region, group, make_plan(args.num_max_tokens, group.num_ranks, args.num_experts)};
}

template <bool kLogfmt>
void launch(const CombineParams& p, int num_blocks, LowLatencyPhase phase, bool one_kernel, cudaStream_t stream) {
  if (phase == LowLatencyPhase::kSend)
    low_latency_combine_send_kernel<kLogfmt><<<num_blocks, kThreads, 0, stream>>>(p);
  else if (phase == LowLatencyPhase::kReceive)
    low_latency_combine_recv_kernel<kLogfmt><<<num_blocks, kThreads, 0, stream>>>(p);
  else if (one_kernel)
    low_latency_combine_kernel<kLogfmt><<<num_blocks, kThreads, 0, stream>>>(p);
  else {
    low_latency_combine_send_kernel<kLogfmt><<<num_blocks, kThreads, 0, stream>>>(p);
    low_latency_combine_recv_kernel<kLogfmt><<<num_blocks, kThreads, 0, stream>>>(p);
  }
}

}  // namespace

void launch_combine(const LowLatencyCombineArgs& args, const Region& region, const Group& group, LowLatencyPhase phase,
                    cudaStream_t stream) {
  const CombineParams p = make_params(args, region, group);
  if (args.use_logfmt)
    launch<true>(p, group.num_blocks, phase, group.gpu_to_itself, stream);
  else
    launch<false>(p, group.num_blocks, phase, group.gpu_to_itself, stream);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace turnout::kernels::low_latency
