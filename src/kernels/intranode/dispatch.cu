// Intranode dispatch: each channel is a pair of blocks. The send block streams
// the channel's tokens to every rank that needs them, a warp group per
// destination, into a ring in the destination's buffer; the receive block
// drains the rings written to this rank into the output rows. Flow control is
// a tail (written by the sender after each round of tokens) and a head
// (written back by the receiver), both monotonic within one call. A rank's
// own tokens skip the ring: its receive block copies them from the input.
// Shrink mode: only the ranks of the counts step's `live` word take part; the
// rows a source left unsent when it died become padding (source -1, no expert).
#include <cuda_runtime.h>

#include "kernels/device/bounded_wait.cuh"
#include "kernels/device/vector_copy.cuh"
#include "kernels/intranode/first_block.cuh"
#include "kernels/intranode/input_scale.cuh"
#include "kernels/intranode/launch.hpp"
#include "kernels/intranode/notify_block.cuh"
#include "kernels/intranode/ring_sender.cuh"
#include "kernels/intranode/warp_group.cuh"
#include "kernels/intranode/warp_stamps.cuh"
#include "turnout/error.hpp"

namespace turnout::kernels {
namespace {

constexpr int kThreads = 768;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ char* bytes(void* p) {
  return static_cast<char*>(p);
}

// A token's small parts as one lane holds them: top-k slot `lane` (the expert's
// id on the receiving rank, or -1 and weight 0 for another rank's expert) and
// scale groups lane and lane + 32.
struct TokenParts {
  int32_t expert = -1;
  float weight = 0.0f;
  int32_t scale[2] = {};
};

__device__ __forceinline__ TokenParts load_token_parts(const DispatchArgs& a, int t, int first_expert, int num_experts,
                                                       int lane) {
  TokenParts parts;
  if (lane < a.num_topk) {
    const int64_t k = static_cast<int64_t>(t) * a.num_topk + lane;
    const int64_t e = a.topk_idx[k];
    const float w = a.topk_weights[k];
    const bool mine = e >= first_expert && e < first_expert + num_experts;
    parts.expert = mine ? static_cast<int32_t>(e - first_expert) : -1;
    parts.weight = mine ? w : 0.0f;
  }
#pragma unroll
  for (int m = 0; m < 2; ++m)
    if (lane + 32 * m < a.num_scales) parts.scale[m] = input_scale(a, t, lane + 32 * m);
  return parts;
}

// Output row `row`'s small parts (scale groups past 64 are the caller's).
__device__ __forceinline__ void store_token_parts(const DispatchOutputs& o, const DispatchArgs& a, int64_t row,
                                                  const TokenParts& parts, int32_t src_idx, int lane) {
  auto* out_scales = static_cast<int32_t*>(o.recv_x_scales) + row * a.num_scales;
#pragma unroll
  for (int m = 0; m < 2; ++m)
    if (lane + 32 * m < a.num_scales) out_scales[lane + 32 * m] = parts.scale[m];
  if (lane < a.num_topk) {
    o.recv_topk_idx[row * a.num_topk + lane] = parts.expert;
    o.recv_topk_weights[row * a.num_topk + lane] = parts.weight;
  }
  if (lane == 0 && o.recv_src_idx != nullptr) o.recv_src_idx[row] = src_idx;
}

// The config's send hint counts tokens of BF16 size: an FP8 row is half the
// bytes, so a round holds twice as many (fewer tail updates per byte).
__device__ __forceinline__ int round_hint(const DispatchArgs& a, const IntranodeRegion& region) {
  return a.num_scales > 0 ? min(2 * a.num_max_send_tokens, region.ring_slots) : a.num_max_send_tokens;
}

// Calls visit(t) for each token t in [t0, t1) that goes to rank `dst`, in
// token order. Warp-wide: every lane gets every call.
template <typename Visit>
__device__ __forceinline__ void for_each_token_to(const DispatchArgs& a, int num_ranks, int dst, int t0, int t1,
                                                  int lane, Visit visit) {
  for (int base = t0; base < t1; base += 32) {
    const int t_lane = base + lane;
    uint32_t mask =
        __ballot_sync(~0u, t_lane < t1 && a.is_token_in_rank[static_cast<int64_t>(t_lane) * num_ranks + dst]);
    for (; mask; mask &= mask - 1) visit(base + __ffs(mask) - 1);
  }
}

// The ranks taking part in this call, as its counts step left them.
__device__ __forceinline__ uint32_t call_ranks(const DispatchParams& p) {
  return static_cast<uint32_t>(
      device::load_volatile(reinterpret_cast<const int32_t*>(bytes(p.peers.buffers[p.peers.rank]) + p.region.live)));
}

__device__ void send_tokens(const DispatchParams& p, int channel) {
  const DispatchArgs& a = p.args;
  const int R = p.peers.num_ranks, me = p.peers.rank;
  const int lane = threadIdx.x % 32;
  const auto [group_warps, dst, g] = remote_warp_group(kWarps, R, me);
  if (dst >= R || !(call_ranks(p) >> dst & 1)) return;
  const IntranodeRegion& region = p.region;
  const int C = region.num_channels;
  const int t0 = channel_begin(a.num_tokens, channel, C), t1 = channel_begin(a.num_tokens, channel + 1, C);
  char* peer = bytes(p.peers.buffers[dst]);
  RingSender out(peer + region.ring(channel, me), reinterpret_cast<int32_t*>(peer + region.tail(channel, me)),
                 reinterpret_cast<const int32_t*>(bytes(p.peers.buffers[me]) + region.head(channel, dst)),
                 region.slot_bytes, region.ring_slots, round_hint(a, region), group_warps, g, 1 + dst,
                 p.ctx.first_nvl_rank + dst, WaitSite::kDispatchData);
  const int n16 = a.row_bytes / 16;
  const DispatchSlot& s = p.slot;

  int sent = 0;
  WarpStamps::begin();
  // Every warp of the group walks the same tokens and reaches the same round
  // barriers; warp g copies the tokens whose position is g modulo the group.
  for_each_token_to(a, R, dst, t0, t1, lane, [&](int t) {
    const int n = sent++;
    WarpStamps::mark(kOther);
    out.reserve(n, p.ctx, lane);
    WarpStamps::mark(kWait);
    if (out.mine(n)) {
      char* slot = out.slot(n);
      // The small loads first, so they overlap the row copy instead of
      // adding their round trips after it.
      const TokenParts parts = load_token_parts(a, t, dst * p.experts_per_rank, p.experts_per_rank, lane);
      device::warp_copy_16<false>(slot, static_cast<const char*>(a.x) + static_cast<int64_t>(t) * a.row_bytes, n16,
                                  lane);
      WarpStamps::mark(kRow);
      auto* slot_scales = reinterpret_cast<int32_t*>(slot + s.scales);
#pragma unroll
      for (int m = 0; m < 2; ++m)
        if (lane + 32 * m < a.num_scales) slot_scales[lane + 32 * m] = parts.scale[m];
      for (int i = lane + 64; i < a.num_scales; i += 32) slot_scales[i] = input_scale(a, t, i);
      if (lane < a.num_topk) {
        reinterpret_cast<int32_t*>(slot + s.topk)[lane] = parts.expert;
        reinterpret_cast<float*>(slot + s.weights)[lane] = parts.weight;
      }
      if (lane == 0) *reinterpret_cast<int32_t*>(slot + s.src) = t;
      WarpStamps::mark(kSmall);
      WarpStamps::row();
    }
    out.commit(n, lane);
    WarpStamps::mark(kHandOff);
  });
  out.finish(sent, lane);
  WarpStamps::mark(kHandOff);
  WarpStamps::print("dispatch", "send", me, channel, dst);
}

// This rank's tokens for itself, in the order its ring would have held them:
// straight from the input into output rows row0, row0 + 1, ...
__device__ void copy_own_tokens(const DispatchParams& p, const DispatchOutputs& o, int channel, int64_t row0,
                                int group_warps, int g) {
  const DispatchArgs& a = p.args;
  const int R = p.peers.num_ranks, me = p.peers.rank;
  const int lane = threadIdx.x % 32;
  const int C = p.region.num_channels;
  const int t0 = channel_begin(a.num_tokens, channel, C), t1 = channel_begin(a.num_tokens, channel + 1, C);
  const int n16 = a.row_bytes / 16;
  int n = 0;  // own tokens visited so far
  WarpStamps::begin();
  for_each_token_to(a, R, me, t0, t1, lane, [&](int t) {
    if (n++ % group_warps != g) return;
    WarpStamps::mark(kOther);
    const int64_t row = row0 + n - 1;
    const TokenParts parts = load_token_parts(a, t, me * p.experts_per_rank, p.experts_per_rank, lane);
    device::warp_copy_16<false>(static_cast<char*>(o.recv_x) + row * a.row_bytes,
                                static_cast<const char*>(a.x) + static_cast<int64_t>(t) * a.row_bytes, n16, lane);
    store_token_parts(o, a, row, parts, t, lane);
    auto* out_scales = static_cast<int32_t*>(o.recv_x_scales) + row * a.num_scales;
    for (int i = lane + 64; i < a.num_scales; i += 32) out_scales[i] = input_scale(a, t, i);
    WarpStamps::mark(kRow);
    WarpStamps::row();
  });
  WarpStamps::print("dispatch", "own", me, channel, me);
}

// Rows [begin, end) that no token filled: padding, as past num_worst_tokens,
// with zero data. The warps of a group take every group_warps-th row.
__device__ void pad_rows(const DispatchParams& p, int64_t begin, int64_t end, int group_warps, int g, int lane) {
  const DispatchArgs& a = p.args;
  const DispatchOutputs& o = a.out;
  if (o.recv_x == nullptr) return;
  const int n16 = a.row_bytes / 16;
  for (int64_t row = begin + g; row < end; row += group_warps) {
    auto* out = reinterpret_cast<int4*>(static_cast<char*>(o.recv_x) + row * a.row_bytes);
    for (int i = lane; i < n16; i += 32) out[i] = make_int4(0, 0, 0, 0);
    auto* out_scales = static_cast<int32_t*>(o.recv_x_scales) + row * a.num_scales;
    for (int i = lane; i < a.num_scales; i += 32) out_scales[i] = 0;
    if (lane < a.num_topk) {
      o.recv_topk_idx[row * a.num_topk + lane] = -1;
      o.recv_topk_weights[row * a.num_topk + lane] = 0.0f;
    }
    if (lane == 0 && o.recv_src_idx != nullptr) o.recv_src_idx[row] = -1;
  }
}

__device__ void receive_tokens(const DispatchParams& p, int channel) {
  const DispatchArgs& a = p.args;
  const int R = p.peers.num_ranks, me = p.peers.rank;
  const int lane = threadIdx.x % 32;
  const auto [group_warps, src, g] = warp_group(kWarps, R);
  __shared__ int32_t s_tail[kMaxNvlRanks];
  const DispatchOutputs& o = a.out;
  const IntranodeRegion& region = p.region;
  const int C = region.num_channels, Q = region.ring_slots;
  char* self = bytes(p.peers.buffers[me]);
  // Every source rank's token count, as the counts step received it (none
  // from a rank that takes no part).
  const uint32_t taking_part = call_ranks(p);
  if (blockIdx.x == 1 && o.source_num_tokens != nullptr && threadIdx.x < R)
    o.source_num_tokens[threadIdx.x] =
        taking_part >> threadIdx.x & 1 ? reinterpret_cast<const int32_t*>(self + region.source_info)[threadIdx.x * 4]
                                       : 0;
  if (src >= R || !(taking_part >> src & 1)) return;
  const int32_t* starts = reinterpret_cast<const int32_t*>(self + region.channel_start) + src * (C + 1);
  const int begin = starts[channel], count = starts[channel + 1] - begin;
  const int64_t row0 = (src > 0 ? a.rank_prefix_matrix[(src - 1) * R + me] : 0) + begin;
  if (src == me) {
    if (o.recv_x != nullptr) copy_own_tokens(p, o, channel, row0, group_warps, g);
    return;
  }
  const char* ring = self + region.ring(channel, src);
  const int32_t* tail = reinterpret_cast<const int32_t*>(self + region.tail(channel, src));
  int32_t* head = reinterpret_cast<int32_t*>(bytes(p.peers.buffers[src]) + region.head(channel, me));
  const int n16 = a.row_bytes / 16;
  const DispatchSlot& s = p.slot;

  int consumed = 0;
  WarpStamps::begin();
  while (consumed < count) {
    WarpStamps::mark(kOther);
    if (g == 0 && lane == 0) {
      int32_t t = 0;
      const bool ok = device::bounded_wait(p.ctx, p.ctx.first_nvl_rank + src, WaitSite::kDispatchData, [&] {
        t = device::load_acquire_sys(tail);
        return t > consumed;
      });
      s_tail[src] = ok ? t : -1;
    }
    device::named_barrier(1 + src, group_warps * 32);
    WarpStamps::mark(kWait);
    const int avail = s_tail[src];
    if (avail < 0) {
      // Shrink mode: the source died mid-call (now masked); its rows left are padding.
      if (p.ctx.mask != nullptr) pad_rows(p, row0 + consumed, row0 + count, group_warps, g, lane);
      break;
    }
    for (int n = consumed + g; o.recv_x != nullptr && n < avail; n += group_warps) {
      const char* slot = ring + static_cast<int64_t>(n % Q) * region.slot_bytes;
      const int64_t row = row0 + n;
      // Small loads first (from L2: another GPU wrote them), then the row.
      const auto* meta = reinterpret_cast<const int32_t*>(slot);
      TokenParts parts;
#pragma unroll
      for (int m = 0; m < 2; ++m)
        if (lane + 32 * m < a.num_scales) parts.scale[m] = __ldcg(meta + s.scales / 4 + lane + 32 * m);
      if (lane < a.num_topk) {
        parts.expert = __ldcg(meta + s.topk / 4 + lane);
        parts.weight = __int_as_float(__ldcg(meta + s.weights / 4 + lane));
      }
      const int32_t src_idx = lane == 0 ? __ldcg(meta + s.src / 4) : 0;
      device::warp_copy_shared_16_cut(static_cast<char*>(o.recv_x) + row * a.row_bytes, slot, n16, lane);
      store_token_parts(o, a, row, parts, src_idx, lane);
      auto* out_scales = static_cast<int32_t*>(o.recv_x_scales) + row * a.num_scales;
      for (int i = lane + 64; i < a.num_scales; i += 32) out_scales[i] = __ldcg(meta + s.scales / 4 + i);
      WarpStamps::row();
    }
    WarpStamps::mark(kRow);
    // Every warp has read its slots: hand them back to the sender. A relaxed
    // store: a release would hold warp 0, and so the group's next round, until
    // its output stores were acknowledged.
    device::named_barrier(1 + src, group_warps * 32);
    if (g == 0 && lane == 0) device::store_relaxed_sys(head, avail);
    WarpStamps::mark(kHandOff);
    consumed = avail;
  }
  WarpStamps::print("dispatch", "receive", me, channel, src);
}

// Rows past the received ones (num_worst_tokens; all of them when the call
// failed) get no expert and no source.
__device__ void fill_padding(const DispatchParams& p, int receiver, int num_receivers, bool failed) {
  const DispatchArgs& a = p.args;
  const int R = p.peers.num_ranks, me = p.peers.rank;
  const int num_recv = failed ? 0 : a.rank_prefix_matrix[(R - 1) * R + me];
  const int64_t per_row = 1 + a.num_topk;
  const int64_t total = (a.num_recv_rows - static_cast<int64_t>(num_recv)) * per_row;
  for (int64_t i = receiver * static_cast<int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(num_receivers) * kThreads) {
    const int64_t row = num_recv + i / per_row;
    const int k = static_cast<int>(i % per_row);
    if (k == 0) {
      a.out.recv_src_idx[row] = -1;
    } else {
      a.out.recv_topk_idx[row * a.num_topk + k - 1] = -1;
      a.out.recv_topk_weights[row * a.num_topk + k - 1] = 0.0f;
    }
  }
}

// The data step, on every block: even blocks send a channel, odd ones receive one.
__device__ __forceinline__ void dispatch_blocks(const DispatchParams& p) {
  if (device::wait_abandoned(p.ctx.errors)) return;
  const char* self = bytes(p.peers.buffers[p.peers.rank]);
  // The counts step found a bad input on some rank: every rank skips, leaving
  // outputs a later kernel can read safely.
  const bool failed = device::load_volatile(reinterpret_cast<const int32_t*>(self + p.region.status)) != 0;
  const int channel = blockIdx.x / 2;
  const DispatchArgs& a = p.args;
  if (blockIdx.x % 2 == 0) {
    if (!failed) send_tokens(p, channel);
    return;
  }
  if (a.num_worst_tokens > 0) fill_padding(p, channel, p.region.num_channels, failed);
  if (!failed) {
    receive_tokens(p, channel);
  } else if (blockIdx.x == 1 && a.out.source_num_tokens != nullptr && threadIdx.x < p.peers.num_ranks) {
    a.out.source_num_tokens[threadIdx.x] = -1;
  }
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(DispatchParams p) {
  dispatch_blocks(p);
}

// Both steps in one launch, where the rank has its GPU to itself (every block
// resident at once) and the host knows the receive rows before the counts: one
// launch less on the host's time.
__global__ void __launch_bounds__(kThreads, 1)
    counts_and_dispatch_kernel(const __grid_constant__ NotifyParams counts, const __grid_constant__ DispatchParams p) {
  if (blockIdx.x == 0) notify_step::notify_block_out_of_line<kThreads>(counts);
  if (wait_for_first_block(p.peers, p.ctx, WaitSite::kDispatchCounts)) dispatch_blocks(p);
}

}  // namespace

KernelLaunch intranode_dispatch_launch(const DispatchParams& p) {
  return {reinterpret_cast<const void*>(dispatch_kernel), dim3(p.region.num_channels * 2), dim3(kThreads), 0};
}

KernelLaunch intranode_counts_and_dispatch_launch(const DispatchParams& p) {
  return {reinterpret_cast<const void*>(counts_and_dispatch_kernel), dim3(p.region.num_channels * 2), dim3(kThreads),
          0};
}

void launch_intranode_dispatch(const DispatchParams& p, cudaStream_t stream) {
  void* args[] = {const_cast<DispatchParams*>(&p)};
  launch(intranode_dispatch_launch(p), args, stream);
}

void launch_intranode_counts_and_dispatch(const NotifyParams& counts, const DispatchParams& p, cudaStream_t stream) {
  void* args[] = {const_cast<NotifyParams*>(&counts), const_cast<DispatchParams*>(&p)};
  launch(intranode_counts_and_dispatch_launch(p), args, stream);
}

}  // namespace turnout::kernels
