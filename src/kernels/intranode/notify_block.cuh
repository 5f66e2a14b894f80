// The counts step, before the data moves: meet the peers (none still touches
// our rings), reset our ring counters, then hand every peer what it needs from
// us: how many tokens we send it, per channel and per expert, and whether our
// input is bad, so that every rank skips the call together.
//
// Shrink mode: a masked rank is left out (no token counted for it, nothing
// written to it, nothing read from it), a peer that misses a barrier is
// masked, and the ranks that still take part when the counts are in go to
// the region's `live` word, which the data step of the call reads.
//
// One block of kThreads threads runs it: a launch of its own (notify.cu), or
// the first block of a dispatch's launch where the rank has its GPU to itself
// (dispatch.cu), whose other blocks wait for it.
#pragma once

#include <cuda_runtime.h>

#include "kernels/device/error_record.cuh"
#include "kernels/device/nvl_barrier.cuh"
#include "kernels/device/rank_mask.cuh"
#include "kernels/intranode/launch.hpp"
#include "turnout/error.hpp"

namespace turnout::kernels::notify_step {

// Why this rank's input is bad (the OpKind whose check found it), or 0; for
// kDispatch, where the first bad expert id of this call's topk_idx is.
struct BadInput {
  int reason;
  int64_t index;
  int64_t value;
  bool pending;  // the reason is an unshared error of an earlier call
};

// Keeps the first bad expert id seen (valid: -1, or in [0, num_experts)).
__device__ __forceinline__ void check_expert(BadInput& bad, int64_t e, int64_t index, int num_experts) {
  if ((e < -1 || e >= num_experts) && atomicCAS(&bad.reason, 0, static_cast<int>(OpKind::kDispatch)) == 0) {
    bad.index = index;
    bad.value = e;
  }
}

__device__ __forceinline__ int32_t* at(void* base, int64_t offset) {
  return reinterpret_cast<int32_t*>(static_cast<char*>(base) + offset);
}

// Combine's handle against its inputs: this rank's rows of rank_prefix_matrix
// must rise within x's rows, and a failed dispatch marked its counts -1.
// Returns the reason code of kBadHandle (1 rows, 2 failed dispatch) or 0,
// with the rows the handle counts in *rows.
__device__ __forceinline__ int handle_misfit(const NotifyParams& p, int* rows) {
  const HandleCheck& h = p.handle;
  const int R = p.peers.num_ranks, me = p.peers.rank;
  if (h.source_num_tokens[me] != h.num_tokens) return 2;
  int prev = 0;
  for (int i = 0; i < R; ++i) {
    const int v = h.rank_prefix_matrix[i * R + me];
    if (v < prev || v > h.num_rows) {
      *rows = v;
      return 1;
    }
    prev = v;
  }
  return 0;
}

// The stage tag this rank tells its peers: its own, unless its stage skipped
// rows the handle does not place as this rank's from itself (then 0: rows a
// peer reads would be missing, and every rank takes the rings).
__device__ __forceinline__ int published_stage_tag(const NotifyParams& p) {
  const HandleCheck& h = p.handle;
  if (h.stage_tag == 0 || h.skipped_begin < 0) return h.stage_tag;
  const int R = p.peers.num_ranks, me = p.peers.rank;
  const int begin = me > 0 ? h.rank_prefix_matrix[(me - 1) * R + me] : 0;
  const bool same = begin == h.skipped_begin && h.rank_prefix_matrix[me * R + me] - begin == h.skipped_rows;
  return same ? h.stage_tag : 0;
}

// Combine's top-k weights into this rank's stage, by the whole block before
// its first barrier (which publishes them): a copy enqueued on the host costs
// as much host time as a launch, and these reads overlap the wait for the
// slowest peer.
template <int kThreads>
__device__ __forceinline__ void copy_stage_weights(const HandleCheck& h, void* self) {
  if (h.stage_weights_at < 0) return;
  float* to = reinterpret_cast<float*>(static_cast<char*>(self) + h.stage_weights_at);
  const float* from = h.stage_weights;
  const int64_t n = h.num_stage_weights;
  // The stage is 4096-aligned; the weights in fours where torch's 16-byte alignment holds.
  const int64_t n4 = reinterpret_cast<uintptr_t>(from) % 16 == 0 ? n / 4 : 0;
  constexpr int kInFlight = 8;
  for (int64_t base = threadIdx.x; base < n4; base += kThreads * kInFlight) {
    float4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < n4) v[u] = __ldg(reinterpret_cast<const float4*>(from) + i);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t i = base + u * kThreads;
      if (i < n4) reinterpret_cast<float4*>(to)[i] = v[u];
    }
  }
  for (int64_t i = 4 * n4 + threadIdx.x; i < n; i += kThreads) to[i] = from[i];
}

template <int kThreads>
__device__ __forceinline__ void notify_block(const NotifyParams& p) {
  __shared__ BadInput bad;
  const int R = p.peers.num_ranks, me = p.peers.rank;
  const IntranodeRegion& g = p.region;
  const int C = g.num_channels;
  void* self = p.peers.buffers[me];
  const DispatchCountsArgs& a = p.counts;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Our own inputs are read before the first barrier, so the reading overlaps
  // the wait for the slowest peer.
  __shared__ int32_t s_start[kMaxChannels + 1][kMaxNvlRanks];
  __shared__ int s_handle_misfit, s_handle_rows, s_stage_tag;
  const uint32_t live_at_start = device::live_peers(p.ctx, R, me);
  if (threadIdx.x == 0) {
    // A dispatch also fails for an unshared error of an earlier call (a
    // layout call's bad expert id): its host raises after the launches, and
    // the peers must not wait for the data step it then skips.
    bad.reason = p.exchange_counts ? device::unshared_input_error(p.ctx.errors) : 0;
    bad.pending = bad.reason != 0;
    s_handle_misfit = p.exchange_counts ? 0 : handle_misfit(p, &s_handle_rows);
    if (s_handle_misfit) bad.reason = static_cast<int>(OpKind::kCombine);
    s_stage_tag = p.exchange_counts || s_handle_misfit ? 0 : published_stage_tag(p);
  }
  if (!p.exchange_counts) copy_stage_weights<kThreads>(p.handle, self);
  if (p.exchange_counts) {
    for (int i = threadIdx.x; i < (C + 1) * kMaxNvlRanks; i += kThreads) (&s_start[0][0])[i] = 0;
    __syncthreads();
    // Tokens we send each rank, per channel. A warp takes 32 consecutive
    // tokens, which nearly always share a channel: then one shared atomic per
    // rank counts them all. The flags of kTokenPasses such spans are loaded
    // before any is counted, so their reads share one round trip.
    constexpr int kTokenPasses = 2;
    for (int base = warp * 32; base < a.num_tokens; base += kThreads * kTokenPasses) {
      bool in[kTokenPasses][kMaxNvlRanks];
#pragma unroll
      for (int u = 0; u < kTokenPasses; ++u) {
        const int t = base + u * kThreads + lane;
#pragma unroll
        for (int j = 0; j < kMaxNvlRanks; ++j)
          in[u][j] = t < a.num_tokens && j < R && (live_at_start >> j & 1) &&
                     a.is_token_in_rank[static_cast<int64_t>(t) * R + j];
      }
#pragma unroll
      for (int u = 0; u < kTokenPasses; ++u) {
        const int t = base + u * kThreads + lane;
        const bool valid = t < a.num_tokens;
        const int c = valid ? channel_of(t, a.num_tokens, C) : -1;
        const int c0 = __shfl_sync(~0u, c, 0);
        const bool one_channel = __all_sync(~0u, !valid || c == c0);
#pragma unroll
        for (int j = 0; j < kMaxNvlRanks; ++j) {
          if (one_channel) {
            const int n = __popc(__ballot_sync(~0u, in[u][j]));
            if (lane == 0 && n > 0) atomicAdd(&s_start[c0 + 1][j], n);
          } else if (in[u][j]) {
            atomicAdd(&s_start[c + 1][j], 1);
          }
        }
      }
    }
    // Expert ids: a bad one stops every rank (see below), so none is dropped
    // silently and nothing lands in a peer's outputs. The first one found is
    // recorded only after the second barrier: a recorded error ends every
    // wait, and this rank must still meet its peers there.
    // Read two ids per load where the tensor is 16-byte aligned (as torch
    // allocates it), the rest one by one: the reads are most of this step's
    // time before the barrier.
    constexpr int kInFlight = 8;
    const int64_t num_ids = static_cast<int64_t>(a.num_tokens) * a.num_topk;
    const int64_t num_pairs = reinterpret_cast<uintptr_t>(a.topk_idx) % 16 == 0 ? num_ids / 2 : 0;
    const auto* pairs = reinterpret_cast<const longlong2*>(a.topk_idx);
    for (int64_t base = threadIdx.x; base < num_pairs; base += kThreads * kInFlight) {
      longlong2 e[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int64_t i = base + u * kThreads;
        e[u] = i < num_pairs ? pairs[i] : make_longlong2(-1, -1);
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        check_expert(bad, e[u].x, 2 * (base + u * kThreads), a.num_experts);
        check_expert(bad, e[u].y, 2 * (base + u * kThreads) + 1, a.num_experts);
      }
    }
    for (int64_t base = 2 * num_pairs + threadIdx.x; base < num_ids; base += kThreads * kInFlight) {
      int64_t e[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int64_t i = base + u * kThreads;
        e[u] = i < num_ids ? a.topk_idx[i] : -1;
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) check_expert(bad, e[u], base + u * kThreads, a.num_experts);
    }
    __syncthreads();
    if (threadIdx.x < R) {
      const int j = threadIdx.x;
      for (int c = 1; c <= C; ++c) s_start[c][j] += s_start[c - 1][j];
    }
  }
  // Barrier 1: every peer has finished the previous op, so no late write can
  // land in the counters we reset next.
  if (!device::nvl_barrier(p.peers.control, me, R, p.ctx)) return;
  const uint32_t live = device::live_peers(p.ctx, R, me);
  for (int i = threadIdx.x; i < C * R; i += kThreads) {
    at(self, g.tails)[i] = 0;
    at(self, g.heads)[i] = 0;
  }
  for (int i = threadIdx.x; i < R; i += kThreads) at(self, g.landed)[i] = 0;
  if (threadIdx.x == 0) *at(self, g.status) = 0;
  for (int j = threadIdx.x; j < R; j += kThreads)
    if (live >> j & 1) {
      at(p.peers.buffers[j], g.source_info)[me * 4 + 2] = bad.reason;
      at(p.peers.buffers[j], g.source_info)[me * 4 + 3] = s_stage_tag;
    }

  if (p.exchange_counts) {
    // Our row of the matrix goes to everyone; the rest is per destination.
    const int L = g.num_local_experts;
    for (int i = threadIdx.x; i < R * R; i += kThreads) {
      const int j = i / R, k = i % R;
      if (live >> j & 1) at(p.peers.buffers[j], g.matrix)[me * R + k] = s_start[C][k];
    }
    for (int j = threadIdx.x; j < R; j += kThreads) {
      if (!(live >> j & 1)) continue;
      int32_t* info = at(p.peers.buffers[j], g.source_info) + me * 4;
      info[0] = a.num_tokens;
      info[1] = a.num_worst_tokens;
    }
    for (int i = threadIdx.x; i < R * (C + 1); i += kThreads) {
      const int j = i / (C + 1), c = i % (C + 1);
      if (live >> j & 1) at(p.peers.buffers[j], g.channel_start)[me * (C + 1) + c] = s_start[c][j];
    }
    if (a.num_tokens_per_expert)
      for (int i = threadIdx.x; i < R * L; i += kThreads) {
        const int j = i / L, l = i % L;
        if (live >> j & 1) at(p.peers.buffers[j], g.expert_counts)[me * L + l] = a.num_tokens_per_expert[j * L + l];
      }
  }
  // Barrier 2: our reset counters and every peer's counts are in place.
  if (!device::nvl_barrier(p.peers.control, me, R, p.ctx)) return;
  // Who takes part in the call: only ranks every step so far found, and that
  // we counted tokens for.
  const uint32_t taking_part = device::live_peers(p.ctx, R, me) & live & live_at_start;
  if (threadIdx.x == 0) *at(self, g.live) = static_cast<int32_t>(taking_part);
  if (threadIdx.x == 0) {
    if (bad.pending)
      device::mark_shared(p.ctx.errors);
    else if (s_handle_misfit)
      device::record_error(p.ctx.errors, DeviceErrorCode::kBadHandle, p.ctx.rank, p.handle.num_rows, 0, s_handle_misfit,
                           s_handle_rows);
    else if (bad.reason)
      device::record_error(p.ctx.errors, DeviceErrorCode::kInvalidExpert, p.ctx.rank,
                           static_cast<int>(bad.index % p.counts.num_topk), 0, bad.index / p.counts.num_topk,
                           bad.value);
  }
  const int32_t* info = at(self, g.source_info);
  if (!p.exchange_counts) {
    // Combine pulls from the stages only where every rank staged its rows in
    // the same one (ranks whose call counts parted after an error pull nothing).
    if (threadIdx.x == 0) {
      bool all_staged = taking_part == (1u << R) - 1 && s_stage_tag != 0;
      for (int j = 0; j < R; ++j) all_staged = all_staged && info[j * 4 + 3] == s_stage_tag;
      *at(self, g.pull) = all_staged;
    }
    for (int j = threadIdx.x; j < R; j += kThreads)
      if ((taking_part >> j & 1) && info[j * 4 + 2] != 0) {
        *at(self, g.status) = 1;
        if (j != me)
          device::record_error(p.ctx.errors, DeviceErrorCode::kPeerInputError, p.ctx.rank, p.ctx.first_nvl_rank + j,
                               info[j * 4 + 2], 0, 0);
      }
    return;
  }

  // A rank that does not take part sends and receives nothing in this call.
  const int32_t* matrix = at(self, g.matrix);
  const auto sent = [&](int i, int j) {
    return (taking_part >> i & 1) && (taking_part >> j & 1) ? matrix[i * R + j] : 0;
  };
  for (int j = threadIdx.x; j < R; j += kThreads) {
    int sum = 0;
    for (int i = 0; i < R; ++i) {
      sum += sent(i, j);
      a.rank_prefix_matrix[i * R + j] = sum;
    }
    if (!(taking_part >> j & 1)) continue;
    // Every rank sees every rank's bound and input check, so all skip the data
    // step together when any receiver would overflow or any input was bad.
    const int worst = info[j * 4 + 1];
    if (worst > 0 && sum > worst) {
      *at(self, g.status) = 1;
      device::record_error(p.ctx.errors, DeviceErrorCode::kWorstTokensExceeded, p.ctx.rank, p.ctx.first_nvl_rank + j, 0,
                           worst, sum);
    }
    if (info[j * 4 + 2] != 0) {
      *at(self, g.status) = 1;
      if (j != me)
        device::record_error(p.ctx.errors, DeviceErrorCode::kPeerInputError, p.ctx.rank, p.ctx.first_nvl_rank + j,
                             info[j * 4 + 2], 0, 0);
    }
  }
  if (p.mailbox == nullptr) return;
  const int L = g.num_local_experts;
  const int align = a.expert_alignment;
  if (a.num_tokens_per_expert)
    for (int l = threadIdx.x; l < L; l += kThreads) {
      int sum = 0;
      for (int s = 0; s < R; ++s)
        if (taking_part >> s & 1) sum += at(self, g.expert_counts)[s * L + l];
      p.mailbox->num_recv_tokens_per_expert[l] = (sum + align - 1) / align * align;
    }
  if (threadIdx.x == 0) {
    int most = 0;
    for (int j = 0; j < R; ++j) {
      int sum = 0;
      for (int s = 0; s < R; ++s) sum += sent(s, j);
      if (j == me) p.mailbox->num_recv_tokens = sum;
      most = sum > most ? sum : most;
    }
    p.mailbox->max_recv_tokens = most;
    int before = 0;
    for (int s = 0; s < me; ++s) before += sent(s, me);
    p.mailbox->own_rows_begin = before;
    p.mailbox->own_rows = sent(me, me);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    p.mailbox->failed = *at(self, g.status);
    __threadfence_system();
    *static_cast<volatile int32_t*>(&p.mailbox->sequence) = p.sequence;
  }
}

// Out of line, for a kernel that runs the counts step in one block beside its
// data step: the step's registers are its own, not the data step's.
template <int kThreads>
__device__ __noinline__ void notify_block_out_of_line(const NotifyParams& p) {
  notify_block<kThreads>(p);
}

}  // namespace turnout::kernels::notify_step
