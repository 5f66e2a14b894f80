// Intranode combine, dispatch in reverse: the send block of a channel returns
// this rank's expert-output rows to the other source ranks (rows of one source
// are sorted by source token, so a channel's rows are a contiguous range); the
// receive block sums, for each of its tokens, the rows of every rank the token
// went to, in rank order, in fp32. With few channels the rows this rank
// returns to itself skip the ring: the receive block reads them from the
// input. A coordinator warp hands ring slots back once every token that used
// them is done. Shrink mode: only the ranks of the counts step's `live` word
// take part, and a rank that dies mid-call has its rows dropped from the sums
// of the tokens it had not yet delivered.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "kernels/device/bounded_wait.cuh"
#include "kernels/device/vector_copy.cuh"
#include "kernels/intranode/first_block.cuh"
#include "kernels/intranode/launch.hpp"
#include "kernels/intranode/notify_block.cuh"
#include "kernels/intranode/rank_masks.cuh"
#include "kernels/intranode/ring_sender.cuh"
#include "kernels/intranode/warp_group.cuh"
#include "kernels/intranode/warp_stamps.cuh"
#include "turnout/error.hpp"

namespace turnout::kernels {
namespace {

// Fewer threads than dispatch: each reducing lane keeps two to eight words of
// each of kRows rows in flight, which needs the registers.
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kWorkers = kWarps - 1;

__device__ __forceinline__ char* bytes(void* p) {
  return static_cast<char*>(p);
}

// First row in [lo, hi) whose source index is >= token (rows are sorted).
__device__ int lower_bound_rows(const int32_t* src_idx, int lo, int hi, int token) {
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (src_idx[mid] < token)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// The ranks taking part in this call, as its step before left them.
__device__ __forceinline__ uint32_t call_ranks(const CombineParams& p) {
  return static_cast<uint32_t>(
      device::load_volatile(reinterpret_cast<const int32_t*>(bytes(p.peers.buffers[p.peers.rank]) + p.region.live)));
}

__device__ void send_rows(const CombineParams& p, int channel) {
  const CombineArgs& a = p.args;
  const int R = p.peers.num_ranks, me = p.peers.rank;
  const int lane = threadIdx.x % 32;
  const auto [group_warps, dst, g] = p.own_rows_direct ? remote_warp_group(kWarps, R, me) : warp_group(kWarps, R);
  if (dst >= R || !(call_ranks(p) >> dst & 1)) return;
  const IntranodeRegion& region = p.region;
  const int C = region.num_channels;
  const int lo = dst > 0 ? a.rank_prefix_matrix[(dst - 1) * R + me] : 0;
  const int hi = a.rank_prefix_matrix[dst * R + me];
  const int src_tokens = a.source_num_tokens[dst];
  const int r0 = lower_bound_rows(a.recv_src_idx, lo, hi, channel_begin(src_tokens, channel, C));
  const int r1 = lower_bound_rows(a.recv_src_idx, lo, hi, channel_begin(src_tokens, channel + 1, C));
  char* peer = bytes(p.peers.buffers[dst]);
  RingSender out(peer + region.ring(channel, me), reinterpret_cast<int32_t*>(peer + region.tail(channel, me)),
                 reinterpret_cast<const int32_t*>(bytes(p.peers.buffers[me]) + region.head(channel, dst)),
                 region.slot_bytes, region.ring_slots, a.num_max_send_tokens, group_warps, g, 1 + dst,
                 p.ctx.first_nvl_rank + dst, WaitSite::kCombineData);
  const CombineSlot& s = p.slot;
  const int n16 = s.row_bytes / 16;
  const int total = r1 - r0;
  WarpStamps::begin();
  for (int n = 0; n < total; ++n) {
    WarpStamps::mark(kOther);
    out.reserve(n, p.ctx, lane);
    WarpStamps::mark(kWait);
    if (out.mine(n)) {
      const int64_t row = r0 + n;
      char* slot = out.slot(n);
      device::warp_copy_16<false>(slot, static_cast<const char*>(a.x) + row * s.row_bytes, n16, lane);
      WarpStamps::mark(kRow);
      if (lane < a.num_topk) reinterpret_cast<float*>(slot + s.weights)[lane] = a.topk_weights[row * a.num_topk + lane];
      WarpStamps::mark(kSmall);
      WarpStamps::row();
    }
    out.commit(n, lane);
    WarpStamps::mark(kHandOff);
  }
  out.finish(total, lane);
  WarpStamps::mark(kHandOff);
  WarpStamps::print("combine", "send", me, channel, dst);
}

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& v) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    acc[2 * i] += f.x;
    acc[2 * i + 1] += f.y;
  }
}

// Token t's output: the sum of its rows (null: the token did not go to that
// rank) and the biases, in fp32, as bf16.
template <int kRows>
__device__ __forceinline__ void sum_rows(const CombineArgs& a, const char* const (&rows)[kRows], int64_t out_row,
                                         int n16, int lane) {
  // Words of each row a lane has in flight: eight at 2 ranks (32 bytes of
  // spills, still 4-5% faster than four at 8-20 SMs on 2x H200), four
  // where the rows fit in registers with them (up to 4 ranks: 128
  // registers, no spills), two at 8 ranks (four spill 632 bytes there).
  constexpr int kUnroll = kRows <= 2 ? 8 : kRows <= 4 ? 4 : 2;
  for (int v0 = lane; v0 < n16; v0 += 32 * kUnroll) {
    // Every word of every row is in flight before the first add.
    int4 words[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        if (rows[r] && v0 + 32 * u < n16) words[u][r] = device::load_shared_16(rows[r] + (v0 + 32 * u) * 16);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + 32 * u;
      if (v >= n16) break;
      float acc[8] = {};
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        if (rows[r]) add_bf16x8(acc, words[u][r]);
      if (a.bias0) add_bf16x8(acc, device::load_input_16(static_cast<const char*>(a.bias0) + out_row + v * 16));
      if (a.bias1) add_bf16x8(acc, device::load_input_16(static_cast<const char*>(a.bias1) + out_row + v * 16));
      int4 out;
      auto* h = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
      for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
      device::store_16(static_cast<char*>(a.combined_x) + out_row + v * 16, out);
    }
  }
}

// Worker warp w reduces the channel's tokens t0 + w, t0 + w + kWorkers, ...;
// s_next[w] is the first of its tokens it has not finished. kRows >= ranks:
// a compile-time bound on a token's rows, so that they stay in registers.
template <int kRows>
__device__ void reduce_tokens(const CombineParams& p, int channel, volatile int* s_next) {
  const CombineArgs& a = p.args;
  const int R = p.peers.num_ranks, me = p.peers.rank;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const IntranodeRegion& region = p.region;
  const int C = region.num_channels, Q = region.ring_slots;
  const int t0 = channel_begin(a.num_tokens, channel, C), t1 = channel_begin(a.num_tokens, channel + 1, C);
  char* self = bytes(p.peers.buffers[me]);
  const CombineSlot& s = p.slot;
  const int n16 = s.row_bytes / 16;
  // The rank whose rows come from the input (none: all from rings), and the
  // first of them for the channel's tokens.
  const int direct = p.own_rows_direct ? me : -1;
  const int own_lo = me > 0 ? a.rank_prefix_matrix[(me - 1) * R + me] : 0;
  const int own_first =
      direct < 0 ? 0 : lower_bound_rows(a.recv_src_idx, own_lo, a.rank_prefix_matrix[me * R + me], t0);
  // Lane j < R watches ring (channel, j).
  const int32_t* my_tail = lane < R ? reinterpret_cast<const int32_t*>(self + region.tail(channel, lane)) : nullptr;
  int known_tail = 0;
  int seen[kRows] = {};  // tokens of earlier windows that went to each rank
  const uint32_t taking_part = call_ranks(p);
  bool ok = true;
  WarpStamps::begin();
  for (int base = t0; base < t1 && ok; base += 32) {
    const int t_lane = base + lane;
    uint32_t masks[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j)
      masks[j] = j < R && (taking_part >> j & 1)
                     ? __ballot_sync(~0u, t_lane < t1 && a.is_token_in_rank[static_cast<int64_t>(t_lane) * R + j])
                     : 0;
    const int first = ((warp - (base - t0)) % kWorkers + kWorkers) % kWorkers;
    for (int i = first; i < 32 && base + i < t1; i += kWorkers) {
      const int t = base + i;
      WarpStamps::mark(kOther);
      const uint32_t below = (1u << i) - 1;
      // Lane j waits until rank j's row for this token has landed.
      int my_slot = -1;
#pragma unroll
      for (int j = 0; j < kRows; ++j)
        if (j == lane && ((masks[j] >> i) & 1)) my_slot = seen[j] + __popc(masks[j] & below);
      bool lane_ok = true;
      if (my_slot >= 0 && lane != direct && known_tail <= my_slot)
        lane_ok = device::bounded_wait(p.ctx, p.ctx.first_nvl_rank + lane, WaitSite::kCombineData, [&] {
          known_tail = device::load_acquire_sys(my_tail);
          return known_tail > my_slot;
        });
      // Shrink mode: the rank died (now masked): its row is left out.
      if (!lane_ok && p.ctx.mask != nullptr) {
        my_slot = -1;
        lane_ok = true;
      }
      ok = __all_sync(~0u, lane_ok);
      WarpStamps::mark(kWait);
      if (!ok) break;
      // The ranks' rows in rank order (a fixed order: the sum is deterministic).
      // Indexed by rank (constant indices keep them in registers); null: the
      // token did not go there.
      const char* rows[kRows];
      int64_t own_row = -1;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int slot = __shfl_sync(~0u, my_slot, j);
        if (j == direct && slot >= 0) own_row = own_first + slot;
        rows[j] = j >= R || slot < 0 ? nullptr
                  : j == direct ? static_cast<const char*>(a.x) + own_row * s.row_bytes
                                : self + region.ring(channel, j) + static_cast<int64_t>(slot % Q) * region.slot_bytes;
      }
      sum_rows<kRows>(a, rows, static_cast<int64_t>(t) * s.row_bytes, n16, lane);
      WarpStamps::mark(kRow);
      if (a.combined_topk_weights && lane < a.num_topk) {
        float w = 0.0f;
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          if (rows[r])
            w += r == direct ? a.topk_weights[own_row * a.num_topk + lane]
                             : __int_as_float(
                                   device::load_volatile(reinterpret_cast<const int32_t*>(rows[r] + s.weights) + lane));
        a.combined_topk_weights[static_cast<int64_t>(t) * a.num_topk + lane] = w;
      }
      __syncwarp();
      WarpStamps::mark(kSmall);
      if (lane == 0) s_next[warp] = t + kWorkers;
      WarpStamps::mark(kHandOff);
      WarpStamps::row();
    }
#pragma unroll
    for (int j = 0; j < kRows; ++j) seen[j] += __popc(masks[j]);
  }
  if (lane == 0) s_next[warp] = t1;
  WarpStamps::print("combine", "reduce", me, channel, -1);
}

// Hands ring slots back: head of ring (channel, j) = tokens before the first
// unfinished one that came from rank j.
__device__ void return_slots(const CombineParams& p, int channel, volatile int* s_next) {
  const CombineArgs& a = p.args;
  const int R = p.peers.num_ranks, me = p.peers.rank;
  const int lane = threadIdx.x % 32;
  const IntranodeRegion& region = p.region;
  const int C = region.num_channels;
  const int t0 = channel_begin(a.num_tokens, channel, C), t1 = channel_begin(a.num_tokens, channel + 1, C);
  const bool returns = lane < R && !(p.own_rows_direct && lane == me) && (call_ranks(p) >> lane & 1);
  int32_t* head =
      returns ? reinterpret_cast<int32_t*>(bytes(p.peers.buffers[lane]) + region.head(channel, me)) : nullptr;
  int cursor = t0, done = 0, published = 0;
  for (;;) {
    int next = lane < kWorkers ? s_next[lane] : t1;
    for (int o = 16; o > 0; o >>= 1) next = min(next, __shfl_xor_sync(~0u, next, o));
    while (cursor < next) {
      const int t = cursor + lane;
      const bool in_range = t < next;
      uint32_t mine = 0;
      for (int j = 0; j < R; ++j) {
        const uint32_t m = __ballot_sync(~0u, in_range && a.is_token_in_rank[static_cast<int64_t>(t) * R + j]);
        if (j == lane) mine = m;
      }
      done += __popc(mine);
      cursor = min(cursor + 32, next);
    }
    if (returns && done != published) {
      // Relaxed: a worker moves s_next only after its loads of those slots fed its stores.
      device::store_relaxed_sys(head, done);
      published = done;
    }
    if (next >= t1 || device::wait_abandoned(p.ctx.errors)) break;
    __nanosleep(64);
  }
}

// The stages' data step (combine_stage.hpp): block b reduces the b-th of
// gridDim.x ranges of this rank's tokens, loading each token's rows from the
// stages of the ranks it went to (its own rows from the input). Token t's row
// on rank r: r's rows from the ranks before this one, then this rank's tokens
// before t that went to r. No waits: the check before met every rank after
// its stage was whole.
template <int kRows>
__device__ void pull_tokens(const CombineParams& p) {
  const CombineArgs& a = p.args;
  const int R = p.peers.num_ranks, me = p.peers.rank;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t0 = channel_begin(a.num_tokens, blockIdx.x, gridDim.x);
  const int t1 = channel_begin(a.num_tokens, blockIdx.x + 1, gridDim.x);
  // Tokens before t0 that went to each rank.
  __shared__ int s_before[kRows];
  if (threadIdx.x < kRows) s_before[threadIdx.x] = 0;
  __syncthreads();
  int before[kRows] = {};
  for (int t = threadIdx.x; t < t0; t += blockDim.x)
#pragma unroll
    for (int j = 0; j < kRows; ++j)
      if (j < R) before[j] += a.is_token_in_rank[static_cast<int64_t>(t) * R + j];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    for (int o = 16; o > 0; o >>= 1) before[j] += __shfl_xor_sync(~0u, before[j], o);
    if (lane == 0 && before[j] != 0) atomicAdd(&s_before[j], before[j]);
  }
  __syncthreads();
  const int n16 = p.slot.row_bytes / 16;
  const CombineStage& stage = p.stage;
  int seen[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j)
    seen[j] = j < R ? (me > 0 ? a.rank_prefix_matrix[(me - 1) * R + j] : 0) + s_before[j] : 0;
  for (int base = t0; base < t1; base += 32) {
    uint32_t masks[kRows];
    rank_masks(a.is_token_in_rank, R, base, t1, lane, masks);
    for (int i = warp; i < 32 && base + i < t1; i += kWarps) {
      const int t = base + i;
      const uint32_t below = (1u << i) - 1;
      const char* rows[kRows];
      int64_t row_of[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        row_of[j] = (masks[j] >> i & 1) ? seen[j] + __popc(masks[j] & below) : -1;
        rows[j] = row_of[j] < 0 ? nullptr
                  : j == me     ? static_cast<const char*>(a.x) + row_of[j] * p.slot.row_bytes
                                : bytes(p.peers.buffers[j]) + stage.at + stage.rows + row_of[j] * p.slot.row_bytes;
      }
      sum_rows<kRows>(a, rows, static_cast<int64_t>(t) * p.slot.row_bytes, n16, lane);
      if (a.combined_topk_weights && lane < a.num_topk) {
        float w = 0.0f;
#pragma unroll
        for (int j = 0; j < kRows; ++j)
          if (rows[j])
            w += j == me ? a.topk_weights[row_of[j] * a.num_topk + lane]
                         : __ldcg(reinterpret_cast<const float*>(bytes(p.peers.buffers[j]) + stage.at) +
                                  row_of[j] * a.num_topk + lane);
        a.combined_topk_weights[static_cast<int64_t>(t) * a.num_topk + lane] = w;
      }
    }
#pragma unroll
    for (int j = 0; j < kRows; ++j) seen[j] += __popc(masks[j]);
  }
}

// The data step, on every block: where every rank staged its rows (kStaged:
// this one did), all blocks pull; else even blocks send a channel's rows back,
// odd ones reduce a channel's tokens. The ranks that did not stage run a
// kernel without the pull, whose registers it would crowd.
template <int kRows, bool kStaged>
__device__ __forceinline__ void combine_blocks(const CombineParams& p) {
  if (device::wait_abandoned(p.ctx.errors)) return;
  // The step before found a handle that does not fit on some rank: every rank skips.
  const char* self = bytes(p.peers.buffers[p.peers.rank]);
  if (device::load_volatile(reinterpret_cast<const int32_t*>(self + p.region.status)) != 0) return;
  if constexpr (kStaged) {
    if (device::load_volatile(reinterpret_cast<const int32_t*>(self + p.region.pull)) != 0) {
      pull_tokens<kRows>(p);
      return;
    }
  }
  const int channel = blockIdx.x / 2;
  if (blockIdx.x % 2 == 0) {
    send_rows(p, channel);
    return;
  }
  __shared__ int s_next[kWorkers];
  const int warp = threadIdx.x / 32;
  const int t0 = channel_begin(p.args.num_tokens, channel, p.region.num_channels);
  if (threadIdx.x < kWorkers) s_next[threadIdx.x] = t0 + threadIdx.x;
  __syncthreads();
  if (warp < kWorkers)
    reduce_tokens<kRows>(p, channel, s_next);
  else
    return_slots(p, channel, s_next);
}

template <int kRows, bool kStaged>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(CombineParams p) {
  combine_blocks<kRows, kStaged>(p);
}

// Both steps in one launch, where the rank has its GPU to itself (every block
// resident at once): one launch less on the host's time.
template <int kRows, bool kStaged>
__global__ void __launch_bounds__(kThreads, 1)
    check_and_combine_kernel(const __grid_constant__ NotifyParams check, const __grid_constant__ CombineParams p) {
  if (blockIdx.x == 0) notify_step::notify_block_out_of_line<kThreads>(check);
  if (wait_for_first_block(p.peers, p.ctx, WaitSite::kBarrier)) combine_blocks<kRows, kStaged>(p);
}

// Calls launch(rows) with the ranks rounded up to 2, 4 or 8 rows (an
// integral_constant): the last covers every group size.
template <typename Launch>
void with_rows(int num_ranks, Launch launch) {
  static_assert(kMaxNvlRanks == 8);
  if (num_ranks <= 2)
    launch(std::integral_constant<int, 2>{});
  else if (num_ranks <= 4)
    launch(std::integral_constant<int, 4>{});
  else
    launch(std::integral_constant<int, 8>{});
}

}  // namespace

KernelLaunch intranode_combine_launch(const CombineParams& p) {
  KernelLaunch k{nullptr, dim3(p.region.num_channels * 2), dim3(kThreads), 0};
  with_rows(p.peers.num_ranks, [&](auto rows) {
    constexpr int kRows = decltype(rows)::value;
    k.func = p.stage.at >= 0 ? reinterpret_cast<const void*>(combine_kernel<kRows, true>)
                             : reinterpret_cast<const void*>(combine_kernel<kRows, false>);
  });
  return k;
}

KernelLaunch intranode_check_and_combine_launch(const CombineParams& p) {
  KernelLaunch k{nullptr, dim3(p.region.num_channels * 2), dim3(kThreads), 0};
  with_rows(p.peers.num_ranks, [&](auto rows) {
    constexpr int kRows = decltype(rows)::value;
    k.func = p.stage.at >= 0 ? reinterpret_cast<const void*>(check_and_combine_kernel<kRows, true>)
                             : reinterpret_cast<const void*>(check_and_combine_kernel<kRows, false>);
  });
  return k;
}

void launch_intranode_combine(const CombineParams& p, cudaStream_t stream) {
  void* args[] = {const_cast<CombineParams*>(&p)};
  launch(intranode_combine_launch(p), args, stream);
}

void launch_intranode_check_and_combine(const NotifyParams& check, const CombineParams& p, cudaStream_t stream) {
  void* args[] = {const_cast<NotifyParams*>(&check), const_cast<CombineParams*>(&p)};
  launch(intranode_check_and_combine_launch(p), args, stream);
}

}  // namespace turnout::kernels
