// The internode counts step (docs/INTERNODE.md "Counts step"), a template on
// the network transport: counting blocks, then one block that meets the
// peers, resets this rank's rings and exchanges the counts in two levels.
// Each rank puts its domain peer (e, n) one message about the ranks of domain
// e; that forwarder relays the part about each local rank j over NVLink. So
// every rank learns what every source rank sends it, per channel and per
// expert, and whether its input was bad: then every rank skips the data step.
//
// Counters only grow (barrier arrivals, message arrivals, relays), checked
// against this rank's own count of steps (`epoch`), so nothing is zeroed
// between calls and a peer one step ahead is never taken for a late one.
#pragma once

#include <cuda_runtime.h>

#include "kernels/device/bounded_wait.cuh"
#include "kernels/device/error_record.cuh"
#include "kernels/device/memory_order.cuh"
#include "kernels/device/nvl_barrier.cuh"
#include "kernels/device/rank_mask.cuh"
#include "kernels/internode/forwarders.hpp"
#include "kernels/internode/launch.hpp"
#include "kernels/internode/live_set.hpp"
#include "kernels/internode/transport.cuh"
#include "turnout/error.hpp"

namespace turnout::kernels::internode {

inline constexpr int kNotifyThreads = 512;

namespace notify_detail {

__device__ __forceinline__ int32_t* ints(void* base, int64_t offset) {
  return reinterpret_cast<int32_t*>(static_cast<char*>(base) + offset);
}

__device__ __forceinline__ uint32_t* words(void* base, int64_t offset) {
  return reinterpret_cast<uint32_t*>(static_cast<char*>(base) + offset);
}

// Whether a monotonic counter has reached this step's `epoch`.
__device__ __forceinline__ bool reached(const uint32_t* counter, uint32_t epoch) {
  return static_cast<int32_t>(device::load_acquire_sys(counter) - epoch) >= 0;
}

// Shrink mode: whether rank g takes part in this call, as the mask buffer
// says when the call starts (ranks masked before the call; this rank always).
__device__ __forceinline__ bool unmasked(const NotifyParams& p, int g) {
  return g == p.peers.rank || p.mask == nullptr || device::load_acquire_sys(p.mask + g) == 0;
}

// Block c of kCount: this rank's tokens of channel c per destination rank
// (handle [2]) and per destination domain (handle [1]), not yet summed over
// channels; and the first expert id outside [-1, E), left for the exchange.
// kShrink: a masked rank's column of is_token_in_rank reads as cleared (the
// user's layout may predate the mask).
template <bool kShrink>
__device__ __forceinline__ void count_channel_as(const NotifyParams& p) {
  const InternodeDispatchCountsArgs& a = p.counts;
  const int R = p.peers.num_ranks, D = p.peers.num_nvl_ranks, N = R / D;
  const int C = static_cast<int>(gridDim.x), c = static_cast<int>(blockIdx.x);
  const int begin = channel_begin(a.num_tokens, c, C), end = channel_begin(a.num_tokens, c + 1, C);
  const bool* in = a.handle.is_token_in_rank;
  // A thread per destination: consecutive threads read consecutive flags of a token.
  for (int j = threadIdx.x; j < R; j += blockDim.x) {
    int count = 0;
    if (!kShrink || unmasked(p, j))
      for (int t = begin; t < end; ++t) count += in[static_cast<int64_t>(t) * R + j] ? 1 : 0;
    a.handle.gbl_channel_prefix_matrix[j * C + c] = count;
  }
  for (int e = threadIdx.x; e < N; e += blockDim.x) {
    uint32_t columns = ~0u;  // the live local ranks of domain e
    if constexpr (kShrink) {
      columns = 0;
      for (int k = 0; k < D; ++k) columns |= unmasked(p, e * D + k) ? 1u << k : 0u;
    }
    int count = 0;
    for (int t = begin; t < end; ++t) {
      bool any = false;
      for (int k = 0; k < D; ++k) any = any || ((columns >> k & 1) && in[static_cast<int64_t>(t) * R + e * D + k]);
      count += any ? 1 : 0;
    }
    a.handle.rdma_channel_prefix_matrix[e * C + c] = count;
  }
  const int64_t last = static_cast<int64_t>(end) * a.num_topk;
  auto* record =
      reinterpret_cast<unsigned long long*>(static_cast<char*>(p.peers.buffers[p.peers.rank % D]) + p.nvl.input_error);
  for (int64_t i = static_cast<int64_t>(begin) * a.num_topk + threadIdx.x; i < last; i += blockDim.x) {
    const int64_t e = a.topk_idx[i];
    if ((e < -1 || e >= a.num_experts) && atomicCAS(record, 0ull, 1ull) == 0ull) {
      record[1] = static_cast<unsigned long long>(i);
      record[2] = static_cast<unsigned long long>(e);
    }
  }
}

// Plain functions around the template, so that the compiler keeps its choice
// of not inlining them into the kernel (as before shrink mode).
__device__ void count_channel(const NotifyParams& p) {
  count_channel_as<false>(p);
}
__device__ void count_channel_shrink(const NotifyParams& p) {
  count_channel_as<true>(p);
}

// Round 2 of a fresh dispatch's agreement on who takes part (live_set.hpp),
// after round 1 (the barrier, judged under the shrink timeout, which masked
// every rank that did not come). `start`: the ranks unmasked when the call
// started. This rank's view (start less the ranks masked since) goes to every
// rank of `start`; the views of the ranks of the view come back, and their
// intersection goes to `agreed`. Returns false, the call failing by a
// recorded error, when a view did not come in time or the peers left this
// rank out.
template <NetTransport T>
__device__ bool agree_on_live(const NotifyParams& p, const T& net, const uint32_t* start, uint32_t* agreed) {
  const int R = p.peers.num_ranks, me = p.peers.rank, W = rank_set_words(R);
  const int tid = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  const int warp = tid / 32, num_warps = threads / 32;
  char* local = net.local();
  const NetRegion& r = p.net;
  __shared__ uint32_t s_view[kMaxLiveWords];
  for (int w = tid; w < W; w += threads) {
    uint32_t bits = start[w];
    for (int b = 0; b < 32 && 32 * w + b < R; ++b)
      if (32 * w + b != me && device::load_acquire_sys(p.mask + 32 * w + b) != 0) bits &= ~(1u << b);
    s_view[w] = bits;
    words(local, r.view_out())[w] = bits;
  }
  const uint32_t round = *reinterpret_cast<volatile uint32_t*>(local + r.view_epoch()) + 1;
  __threadfence_system();
  __syncthreads();
  // To every rank met in round 1, seen or not: a rank that came late learns
  // from the others' views that it was left out, instead of waiting for them.
  for (int g = warp; g < R; g += num_warps)
    if (g != me && rank_in_set(start, g)) net.put_warp(g, r.view(me), local + r.view_out(), W * 4);
  __syncthreads();
  for (int g = tid; g < R; g += threads)
    if (g != me && rank_in_set(start, g)) net.arrive(g, r.viewed() + me * 4, 1);
  // A rank of the view that sends no view fails the call by name: a live set
  // taken from some views only could differ between ranks. Twice as patient
  // as round 1: a rank that came late may still be waiting out a dead one.
  WaitContext patient = p.ctx;
  patient.timeout_ns = 2 * p.shrink_timeout_ns;
  bool ok = true;
  for (int g = tid; g < R; g += threads)
    if (g != me && rank_in_set(s_view, g))
      ok = ok && device::bounded_wait(patient, g, WaitSite::kDispatchCounts,
                                      [&] { return reached(words(local, r.viewed()) + g, round); });
  if (!__syncthreads_and(ok)) return false;
  if (tid == 0) *reinterpret_cast<volatile uint32_t*>(local + r.view_epoch()) = round;
  const uint32_t* views = words(local, r.view(0));
  for (int w = tid; w < W; w += threads) agreed[w] = agreed_live_word(s_view, views, R, me, w);
  __syncthreads();
  if (rank_in_set(agreed, me)) return true;
  if (tid == 0) {
    // A survivor that left this rank out; else (every rank that did was
    // itself dropped by some) one of the view that did: never -1.
    int by = left_out_by(agreed, views, R, me);
    if (by < 0) by = left_out_by(s_view, views, R, me);
    device::record_error(p.ctx.errors, DeviceErrorCode::kTimeout, p.ctx.rank, by, static_cast<int>(WaitSite::kLeftOut),
                         0, 0);
  }
  return false;
}

// After the agreement: the ranks it dropped (in `start`, not live) were
// counted by the counting blocks. Their rows of [2] become zeros and the rows
// of [1] of their domains are counted again over the live columns.
__device__ void recount_dropped(const NotifyParams& p, const uint32_t* start, const uint32_t* live) {
  const InternodeDispatchCountsArgs& a = p.counts;
  const InternodeHandle& h = a.handle;
  const int R = p.peers.num_ranks, D = p.peers.num_nvl_ranks, N = R / D, C = p.net.shape.num_channels;
  const int tid = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  __shared__ uint32_t s_domains;  // bit e: domain e lost a rank
  if (tid == 0) s_domains = 0;
  __syncthreads();
  for (int g = tid; g < R; g += threads)
    if (rank_in_set(start, g) && !rank_in_set(live, g)) {
      for (int c = 0; c < C; ++c) h.gbl_channel_prefix_matrix[g * C + c] = 0;
      atomicOr(&s_domains, 1u << (g / D));
    }
  __syncthreads();
  const uint32_t domains = s_domains;
  if (domains == 0) return;
  for (int i = tid; i < N * C; i += threads) {
    const int e = i / C, c = i % C;
    if (!(domains >> e & 1)) continue;
    uint32_t columns = 0;
    for (int k = 0; k < D; ++k) columns |= rank_in_set(live, e * D + k) ? 1u << k : 0u;
    const int begin = channel_begin(a.num_tokens, c, C), end = channel_begin(a.num_tokens, c + 1, C);
    int count = 0;
    for (int t = begin; t < end; ++t) {
      bool any = false;
      for (int k = 0; k < D; ++k)
        any = any || ((columns >> k & 1) && a.handle.is_token_in_rank[int64_t(t) * R + e * D + k]);
      count += any ? 1 : 0;
    }
    h.rdma_channel_prefix_matrix[i] = count;
  }
  __syncthreads();
  for (int e = tid; e < N; e += threads)
    if (domains >> e & 1)
      for (int c = 1; c < C; ++c)
        h.rdma_channel_prefix_matrix[e * C + c] += h.rdma_channel_prefix_matrix[e * C + c - 1];
  __syncthreads();
}

// kShrink (shrink mode, docs/INTERNODE.md "Shrink across domains"): a fresh
// dispatch starts from the ranks the mask buffer leaves, judges them under
// the shrink timeout and agrees with the others on the call's live set
// (agree_on_live), which it masks the rest by and leaves in handle [10]; a
// cached dispatch and a combine take handle [10]. A combine comes with a
// judged ctx (the mask, the shrink timeout): a rank of [10] masked since the
// dispatch is neither sent to nor waited for, one that does not come is
// masked, and the call goes on without it (its data step leaves it out).
// Every rank derives the same forwarders from that set (Forwarders). Barriers and
// arrivals go to every live far rank; each source puts its message to its
// forwarder in each domain, into the part that serves its column; a forwarder
// relays each part's message to its live local ranks, zeros for a masked
// source; a masked source counts as sending nothing.
template <bool kShrink, NetTransport T>
__device__ void exchange(const NotifyParams& p, const T& net) {
  const int R = p.peers.num_ranks, D = p.peers.num_nvl_ranks, N = R / D;
  const int me = p.peers.rank, n = me % D, d = me / D;
  const int C = p.net.shape.num_channels, L = p.net.shape.num_local_experts;
  const int tid = static_cast<int>(threadIdx.x), threads = static_cast<int>(blockDim.x);
  const int warp = tid / 32, num_warps = threads / 32;
  char* local = net.local();
  void* self = p.peers.buffers[n];
  const InternodeDispatchCountsArgs& a = p.counts;
  const InternodeHandle& h = a.handle;
  const uint32_t epoch = *reinterpret_cast<volatile uint32_t*>(local + p.net.epoch) + 1;
  // The live set (kShrink), and the plan and this rank's parts that follow.
  __shared__ uint32_t s_live[kMaxLiveWords];
  if constexpr (kShrink) {
    for (int w = tid; w < rank_set_words(R); w += threads) {
      uint32_t bits = 0;
      if (p.exchange_counts) {
        for (int b = 0; b < 32 && 32 * w + b < R; ++b) bits |= unmasked(p, 32 * w + b) ? 1u << b : 0u;
      } else {
        bits = h.live[w];
      }
      s_live[w] = bits;
    }
    __syncthreads();
  }
  const Forwarders plan{s_live, N, D};
  // kShrink: a far rank this one meets (every live rank of another domain).
  const auto far_peer = [&](int g) { return g / D != d && plan.is_live(g / D, g % D); };
  // A combine's waits are judged (ctx has the mask): one that gave up leaves
  // its rank masked, and the call goes on unless it failed (another wait
  // recorded an error). A far peer masked since the dispatch is out of it.
  const bool judged_combine = kShrink && p.ctx.mask != nullptr;
  const auto in_call = [&](int g) { return far_peer(g) && !device::rank_masked(p.ctx, g); };
  const auto gone = [&] { return judged_combine && !device::wait_abandoned(p.ctx.errors); };
  // Why this rank's input is bad (the OpKind whose check found it), or 0.
  __shared__ int s_bad;
  __shared__ int64_t s_bad_index, s_bad_value;
  __shared__ bool s_pending;  // the reason is an unshared error of an earlier call (a layout's)
  if (tid == 0) {
    s_bad = p.exchange_counts ? device::unshared_input_error(p.ctx.errors) : 0;
    s_pending = s_bad != 0;
    auto* record = reinterpret_cast<volatile int64_t*>(static_cast<char*>(self) + p.nvl.input_error);
    if (p.exchange_counts && record[0] != 0) {
      if (!s_bad) {
        s_bad = static_cast<int>(OpKind::kDispatch);
        s_bad_index = record[1];
        s_bad_value = record[2];
      }
      record[0] = 0;
    }
  }
  // The counting blocks' counts become prefixes over channels (our own inputs,
  // read before the first barrier so that the reading overlaps the wait).
  if (p.exchange_counts) {
    for (int j = tid; j < R; j += threads)
      for (int c = 1; c < C; ++c) h.gbl_channel_prefix_matrix[j * C + c] += h.gbl_channel_prefix_matrix[j * C + c - 1];
    for (int e = tid; e < N; e += threads)
      for (int c = 1; c < C; ++c)
        h.rdma_channel_prefix_matrix[e * C + c] += h.rdma_channel_prefix_matrix[e * C + c - 1];
  }

  // Barrier 1, over the NVL domain and over the domain peers: every peer has
  // finished the previous op (its puts completed), so no late write lands in
  // the counters reset next. The network arrival goes first, so that a rank
  // held up in its NVL barrier does not hold up its domain peers too (each
  // wait then names the rank that is really missing).
  bool ok = true;
  if constexpr (kShrink) {
    for (int g = tid; g < R; g += threads)
      if (in_call(g)) net.add(g, p.net.barrier + me * 4, 1);
    // The NVL barrier skips the local ranks the mask holds (ranks masked
    // before the dispatch: the same as the handle's live set for its cached
    // dispatch, and since it for a combine). A fresh dispatch judges every
    // rank under the shrink timeout (round 1 of agree_on_live): a wait masks a
    // rank that does not come, and the call goes on to the agreement. A
    // combine judges them the same way (its ctx is judge).
    WaitContext judge = p.ctx;
    judge.mask = p.mask;
    if (p.exchange_counts) judge.timeout_ns = p.shrink_timeout_ns;
    if (!device::nvl_barrier(p.peers.control, n, D, judge)) return;
    for (int g = tid; g < R; g += threads)
      if (in_call(g)) {
        const bool came = device::bounded_wait(p.exchange_counts ? judge : p.ctx, g, WaitSite::kBarrier,
                                               [&] { return reached(words(local, p.net.barrier) + g, epoch); });
        ok = ok && (came || (p.exchange_counts && !device::wait_abandoned(p.ctx.errors)) || gone());
      }
  } else {
    if (tid < N && tid != d) net.add(tid * D + n, p.net.barrier + d * 4, 1);
    if (!device::nvl_barrier(p.peers.control, n, D, p.ctx)) return;
    if (tid < N && tid != d)
      ok = device::bounded_wait(p.ctx, tid * D + n, WaitSite::kBarrier,
                                [&] { return reached(words(local, p.net.barrier) + tid, epoch); });
  }
  if (!__syncthreads_and(ok)) return;
  if constexpr (kShrink) {
    if (p.exchange_counts) {
      __shared__ uint32_t s_agreed[kMaxLiveWords];
      if (!agree_on_live(p, net, s_live, s_agreed)) return;
      recount_dropped(p, s_live, s_agreed);
      // Every survivor masks the same ranks, so later calls skip them at once.
      WaitContext judge = p.ctx;
      judge.mask = p.mask;
      for (int g = tid; g < R; g += threads)
        if (rank_in_set(s_live, g) && !rank_in_set(s_agreed, g)) device::mask_rank(judge, g);
      __syncthreads();
      for (int w = tid; w < rank_set_words(R); w += threads) {
        s_live[w] = s_agreed[w];
        h.live[w] = s_agreed[w];
      }
      __syncthreads();
    }
  }
  const int P = kShrink ? plan.num_parts(d, n) : 1;
  for (int i = tid; i < C * N * p.net.shape.max_parts; i += threads) {
    ints(local, p.net.tails)[i] = 0;
    ints(local, p.net.heads)[i] = 0;
  }
  for (int i = tid; i < C * D * N; i += threads) {
    ints(self, p.nvl.tails)[i] = 0;
    ints(self, p.nvl.heads)[i] = 0;
  }
  if (tid == 0) *ints(self, p.nvl.status) = 0;

  // Our message to each domain e (our own domain's stays here, in its slot of
  // the counts area, which no peer writes).
  const MessageLayout m(p.net.shape);
  const int message_ints = static_cast<int>(p.net.message_bytes / 4);
  if (p.exchange_counts) {
    const int32_t* gbl = h.gbl_channel_prefix_matrix;
    for (int i = tid; i < N * message_ints; i += threads) {
      const int e = i / message_ints, k = i % message_ints;
      int32_t v = 0;
      if (k < kInfoInts)
        v = k == 0 ? a.num_tokens : k == 1 ? a.num_worst_tokens : k == 2 ? s_bad : C;
      else if (k < m.per_channel)
        v = gbl[(e * D + k - m.per_rank) * C + C - 1];
      else if (k < m.per_expert)
        v = gbl[(e * D + (k - m.per_channel) / C) * C + (k - m.per_channel) % C];
      else if (k < m.domain_channels)
        v = a.num_tokens_per_expert != nullptr ? a.num_tokens_per_expert[e * D * L + k - m.per_expert] : 0;
      else if (k < m.domain_channels + C)
        v = h.rdma_channel_prefix_matrix[e * C + k - m.domain_channels];
      ints(local, e != d ? p.net.outgoing(e) : kShrink ? p.net.message(d, plan.part(d, n)) : p.net.message(d))[k] = v;
    }
  }
  __threadfence_system();
  __syncthreads();
  if (p.exchange_counts)
    for (int e = warp; e < N; e += num_warps) {
      if (e == d) continue;
      if constexpr (kShrink) {
        // To the forwarder of my column in e, into the part that serves it (none: e has no live rank).
        const int f = plan.forwarder(e, n);
        if (f != kNoForwarder)
          net.put_warp(e * D + f, p.net.message(d, plan.part(e, n)), local + p.net.outgoing(e), p.net.message_bytes);
      } else {
        net.put_warp(e * D + n, p.net.message(d), local + p.net.outgoing(e), p.net.message_bytes);
      }
    }
  __syncthreads();
  // The arrival also tells the peer our counters are reset: its data step,
  // which writes them, starts only after it has every arrival.
  ok = true;
  if constexpr (kShrink) {
    for (int g = tid; g < R; g += threads)
      if (in_call(g)) net.arrive(g, p.net.counts_arrived + me * 4, 1);
    for (int g = tid; g < R; g += threads)
      if (in_call(g))
        ok = ok && (device::bounded_wait(p.ctx, g, WaitSite::kDispatchCounts,
                                         [&] { return reached(words(local, p.net.counts_arrived) + g, epoch); }) ||
                    gone());
  } else {
    if (tid < N && tid != d) net.arrive(tid * D + n, p.net.counts_arrived + d * 4, 1);
    if (tid < N && tid != d)
      ok = device::bounded_wait(p.ctx, tid * D + n, WaitSite::kDispatchCounts,
                                [&] { return reached(words(local, p.net.counts_arrived) + tid, epoch); });
  }
  if (!__syncthreads_and(ok)) return;

  // As forwarder: to each local rank j, what every source (s, n) sends it.
  if (kShrink && p.exchange_counts) {
    // Part q serves column m: every source (s, m)'s message goes to my live
    // local ranks (zeros for a masked source, which sends nothing).
    const int source_ints = static_cast<int>(p.nvl.source_ints);
    for (int i = tid; i < P * N * D * source_ints; i += threads) {
      const int q = i / (N * D * source_ints), s = i / (D * source_ints) % N, j = i / source_ints % D;
      const int k = i % source_ints, col = plan.served_column(d, n, q);
      if (!plan.is_live(d, j)) continue;
      const int32_t* message = ints(local, p.net.message(s, q));
      int32_t v = 0;
      if (!plan.is_live(s, col))
        v = 0;
      else if (k < kInfoInts)
        v = message[k];
      else if (k == kSourceCount)
        v = message[m.per_rank + j];
      else if (k < kSourceChannels + C)
        v = message[m.per_channel + j * C + k - kSourceChannels];
      else
        v = message[m.per_expert + j * L + k - kSourceChannels - C];
      ints(p.peers.buffers[j], p.nvl.source(s * D + col))[k] = v;
    }
    // Handle [3] and [4]: a row per (source domain, part).
    const auto part_prefix = [&](int row, int c) {
      const int s = row / P, q = row % P;
      return plan.is_live(s, plan.served_column(d, n, q)) ? ints(local, p.net.message(s, q))[m.domain_channels + c] : 0;
    };
    // With num_worst_tokens the host, which does not wait for P, kept a row
    // per part a rank may have: those past N x P become parts with no tokens.
    const int rows = a.num_worst_tokens > 0 ? N * p.net.shape.max_parts : N * P;
    for (int i = tid; i < rows * C; i += threads)
      h.recv_rdma_channel_prefix_matrix[i] = i < N * P * C ? part_prefix(i / C, i % C) : 0;
    if (tid == 0) {
      // From the messages, not from [3]: other threads' writes of [3] are not yet visible here.
      int sum = 0;
      for (int i = 0; i < rows; ++i) {
        sum += i < N * P ? part_prefix(i, C - 1) : 0;
        h.recv_rdma_rank_prefix_sum[i] = sum;
      }
    }
  } else if (p.exchange_counts) {
    const int source_ints = static_cast<int>(p.nvl.source_ints);
    for (int i = tid; i < N * D * source_ints; i += threads) {
      const int s = i / (D * source_ints), j = i / source_ints % D, k = i % source_ints;
      const int32_t* message = ints(local, p.net.message(s));
      int32_t v;
      if (k < kInfoInts)
        v = message[k];
      else if (k == kSourceCount)
        v = message[m.per_rank + j];
      else if (k < kSourceChannels + C)
        v = message[m.per_channel + j * C + k - kSourceChannels];
      else
        v = message[m.per_expert + j * L + k - kSourceChannels - C];
      ints(p.peers.buffers[j], p.nvl.source(s * D + n))[k] = v;
    }
    for (int i = tid; i < N * C; i += threads)
      h.recv_rdma_channel_prefix_matrix[i] = ints(local, p.net.message(i / C))[m.domain_channels + i % C];
    if (tid == 0) {
      int sum = 0;
      for (int s = 0; s < N; ++s) {
        sum += ints(local, p.net.message(s))[m.domain_channels + C - 1];
        h.recv_rdma_rank_prefix_sum[s] = sum;
      }
    }
  }
  __threadfence_system();
  __syncthreads();
  const bool local_peer =
      tid < D && (!kShrink || (plan.is_live(d, tid) && (tid == n || !device::rank_masked(p.ctx, d * D + tid))));
  if (local_peer) device::red_add_release_sys(words(p.peers.buffers[tid], p.nvl.relayed) + n, 1);
  ok = true;
  if (local_peer) {
    ok = device::bounded_wait(p.ctx, d * D + tid, WaitSite::kDispatchCounts,
                              [&] { return reached(words(self, p.nvl.relayed) + tid, epoch); });
    if constexpr (kShrink) ok = ok || gone();
  }
  if (!__syncthreads_and(ok)) return;
  if (tid == 0) *reinterpret_cast<volatile uint32_t*>(local + p.net.epoch) = epoch;
  if (!p.exchange_counts) return;

  // Every source's counts are here: the receive layout ([5], [6]), the
  // per-expert counts, and whether the call goes ahead.
  if (tid == 0) {
    if (s_pending)
      device::mark_shared(p.ctx.errors);
    else if (s_bad)
      device::record_error(p.ctx.errors, DeviceErrorCode::kInvalidExpert, p.ctx.rank,
                           static_cast<int>(s_bad_index % a.num_topk), 0, s_bad_index / a.num_topk, s_bad_value);
  }
  const int source_ints = static_cast<int>(p.nvl.source_ints);
  const int32_t* sources = ints(self, p.nvl.sources);
  // kShrink: a masked source sends nothing (no forwarder may have relayed its entry).
  const auto sends = [&](int g) { return !kShrink || plan.is_live(g / D, g % D); };
  if (tid == 0) {
    int sum = 0;
    for (int g = 0; g < R; ++g) {
      sum += sends(g) ? sources[g * source_ints + kSourceCount] : 0;
      h.recv_gbl_rank_prefix_sum[g] = sum;
    }
  }
  __syncthreads();
  for (int i = tid; i < R * C; i += threads) {
    const int g = i / C, c = i % C;
    const int start = g == 0 ? 0 : h.recv_gbl_rank_prefix_sum[g - 1];
    h.recv_gbl_channel_prefix_matrix[i] =
        start + (c == 0 || !sends(g) ? 0 : sources[g * source_ints + kSourceChannels + c - 1]);
  }
  __shared__ int s_failed;
  if (tid == 0) s_failed = 0;
  __syncthreads();
  for (int g = tid; g < R; g += threads) {
    const int bad = sends(g) ? sources[g * source_ints + 2] : 0;
    if (bad != 0) {
      s_failed = 1;
      if (g != me) device::record_error(p.ctx.errors, DeviceErrorCode::kPeerInputError, p.ctx.rank, g, bad, 0, 0);
    }
  }
  __syncthreads();
  const int num_recv = h.recv_gbl_rank_prefix_sum[R - 1];
  if (tid == 0 && a.num_worst_tokens > 0 && num_recv > a.num_worst_tokens) {
    s_failed = 1;
    device::record_error(p.ctx.errors, DeviceErrorCode::kWorstTokensExceeded, p.ctx.rank, me, 0, a.num_worst_tokens,
                         num_recv);
  }
  // Handle [9] has D x num_worst_tokens rows, enough while no local rank
  // receives more than num_worst_tokens; one that does fails alone, and this
  // rank's forwarders would write [9] past its rows before their waits on it
  // time out. So a forwarder past the bound fails here instead (where 1).
  if (tid == 0 && a.num_worst_tokens > 0) {
    const int forwarded = h.recv_rdma_rank_prefix_sum[N * P - 1];
    const int64_t bound = static_cast<int64_t>(D) * a.num_worst_tokens;
    if (forwarded > bound) {
      s_failed = 1;
      device::record_error(p.ctx.errors, DeviceErrorCode::kWorstTokensExceeded, p.ctx.rank, me, 1, bound, forwarded);
    }
  }
  __syncthreads();
  if (tid == 0) *ints(self, p.nvl.status) = s_failed;
  if (p.mailbox == nullptr) return;
  const int align = a.expert_alignment;
  if (a.num_tokens_per_expert != nullptr)
    for (int l = tid; l < L; l += threads) {
      int sum = 0;
      for (int g = 0; g < R; ++g) sum += sends(g) ? sources[g * source_ints + kSourceChannels + C + l] : 0;
      p.mailbox->num_recv_tokens_per_expert[l] = (sum + align - 1) / align * align;
    }
  __syncthreads();
  if (tid == 0) {
    p.mailbox->num_recv_tokens = num_recv;
    p.mailbox->num_forward_tokens = h.recv_rdma_rank_prefix_sum[N * P - 1];
    p.mailbox->num_parts = P;
    p.mailbox->failed = s_failed;
    __threadfence_system();
    *static_cast<volatile int32_t*>(&p.mailbox->sequence) = p.sequence;
  }
}

}  // namespace notify_detail

// One symbol for both phases, so that a profiler shows one `notify` row.
// kShrink: shrink mode (the handle carries a live set, [10]); without it the
// code is that of a build without shrink mode.
template <NetTransport T, bool kShrink>
__global__ void __launch_bounds__(kNotifyThreads, 1) internode_notify_kernel(NotifyParams p, NotifyPhase phase, T net) {
  if (phase == NotifyPhase::kCount)
    if constexpr (kShrink)
      notify_detail::count_channel_shrink(p);
    else
      notify_detail::count_channel(p);
  else
    notify_detail::exchange<kShrink>(p, net);
}

template <NetTransport T, bool kShrink>
void launch_notify_as(const NotifyParams& p, const T& net, cudaStream_t stream) {
  if (p.exchange_counts)
    internode_notify_kernel<T, kShrink>
        <<<p.net.shape.num_channels, kNotifyThreads, 0, stream>>>(p, NotifyPhase::kCount, net);
  internode_notify_kernel<T, kShrink><<<1, kNotifyThreads, 0, stream>>>(p, NotifyPhase::kExchange, net);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

template <NetTransport T>
void launch_notify_on(const NotifyParams& p, const T& net, cudaStream_t stream) {
  if (p.counts.handle.live != nullptr)
    launch_notify_as<T, true>(p, net, stream);
  else
    launch_notify_as<T, false>(p, net, stream);
}

}  // namespace turnout::kernels::internode
