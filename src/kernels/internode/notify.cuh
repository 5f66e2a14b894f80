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
#include "kernels/internode/launch.hpp"
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

// Block c of kCount: this rank's tokens of channel c per destination rank
// (handle [2]) and per destination domain (handle [1]), not yet summed over
// channels; and the first expert id outside [-1, E), left for the exchange.
__device__ void count_channel(const NotifyParams& p) {
  const InternodeDispatchCountsArgs& a = p.counts;
  const int R = p.peers.num_ranks, D = p.peers.num_nvl_ranks, N = R / D;
  const int C = static_cast<int>(gridDim.x), c = static_cast<int>(blockIdx.x);
  const int begin = channel_begin(a.num_tokens, c, C), end = channel_begin(a.num_tokens, c + 1, C);
  const bool* in = a.handle.is_token_in_rank;
  // A thread per destination: consecutive threads read consecutive flags of a token.
  for (int j = threadIdx.x; j < R; j += blockDim.x) {
    int count = 0;
    for (int t = begin; t < end; ++t) count += in[static_cast<int64_t>(t) * R + j] ? 1 : 0;
    a.handle.gbl_channel_prefix_matrix[j * C + c] = count;
  }
  for (int e = threadIdx.x; e < N; e += blockDim.x) {
    int count = 0;
    for (int t = begin; t < end; ++t) {
      bool any = false;
      for (int k = 0; k < D; ++k) any = any || in[static_cast<int64_t>(t) * R + e * D + k];
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

template <NetTransport T>
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
  if (tid < N && tid != d) net.add(tid * D + n, p.net.barrier + d * 4, 1);
  if (!device::nvl_barrier(p.peers.control, n, D, p.ctx)) return;
  bool ok = true;
  if (tid < N && tid != d)
    ok = device::bounded_wait(p.ctx, tid * D + n, WaitSite::kBarrier,
                              [&] { return reached(words(local, p.net.barrier) + tid, epoch); });
  if (!__syncthreads_and(ok)) return;
  for (int i = tid; i < C * N; i += threads) {
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
      ints(local, e == d ? p.net.message(d) : p.net.outgoing(e))[k] = v;
    }
  }
  __threadfence_system();
  __syncthreads();
  if (p.exchange_counts)
    for (int e = warp; e < N; e += num_warps)
      if (e != d) net.put_warp(e * D + n, p.net.message(d), local + p.net.outgoing(e), p.net.message_bytes);
  __syncthreads();
  // The arrival also tells the peer our counters are reset: its data step,
  // which writes them, starts only after it has every arrival.
  if (tid < N && tid != d) net.arrive(tid * D + n, p.net.counts_arrived + d * 4, 1);
  ok = true;
  if (tid < N && tid != d)
    ok = device::bounded_wait(p.ctx, tid * D + n, WaitSite::kDispatchCounts,
                              [&] { return reached(words(local, p.net.counts_arrived) + tid, epoch); });
  if (!__syncthreads_and(ok)) return;

  // As forwarder: to each local rank j, what every source (s, n) sends it.
  if (p.exchange_counts) {
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
  if (tid < D) device::red_add_release_sys(words(p.peers.buffers[tid], p.nvl.relayed) + n, 1);
  ok = true;
  if (tid < D)
    ok = device::bounded_wait(p.ctx, d * D + tid, WaitSite::kDispatchCounts,
                              [&] { return reached(words(self, p.nvl.relayed) + tid, epoch); });
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
  if (tid == 0) {
    int sum = 0;
    for (int g = 0; g < R; ++g) {
      sum += sources[g * source_ints + kSourceCount];
      h.recv_gbl_rank_prefix_sum[g] = sum;
    }
  }
  __syncthreads();
  for (int i = tid; i < R * C; i += threads) {
    const int g = i / C, c = i % C;
    const int start = g == 0 ? 0 : h.recv_gbl_rank_prefix_sum[g - 1];
    h.recv_gbl_channel_prefix_matrix[i] = start + (c == 0 ? 0 : sources[g * source_ints + kSourceChannels + c - 1]);
  }
  __shared__ int s_failed;
  if (tid == 0) s_failed = 0;
  __syncthreads();
  for (int g = tid; g < R; g += threads) {
    const int bad = sources[g * source_ints + 2];
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
  __syncthreads();
  if (tid == 0) *ints(self, p.nvl.status) = s_failed;
  if (p.mailbox == nullptr) return;
  const int align = a.expert_alignment;
  if (a.num_tokens_per_expert != nullptr)
    for (int l = tid; l < L; l += threads) {
      int sum = 0;
      for (int g = 0; g < R; ++g) sum += sources[g * source_ints + kSourceChannels + C + l];
      p.mailbox->num_recv_tokens_per_expert[l] = (sum + align - 1) / align * align;
    }
  __syncthreads();
  if (tid == 0) {
    p.mailbox->num_recv_tokens = num_recv;
    p.mailbox->num_forward_tokens = h.recv_rdma_rank_prefix_sum[N - 1];
    p.mailbox->failed = s_failed;
    __threadfence_system();
    *static_cast<volatile int32_t*>(&p.mailbox->sequence) = p.sequence;
  }
}

}  // namespace notify_detail

// One symbol for both phases, so that a profiler shows one `notify` row.
template <NetTransport T>
__global__ void __launch_bounds__(kNotifyThreads, 1) internode_notify_kernel(NotifyParams p, NotifyPhase phase, T net) {
  if (phase == NotifyPhase::kCount)
    notify_detail::count_channel(p);
  else
    notify_detail::exchange(p, net);
}

template <NetTransport T>
void launch_notify_on(const NotifyParams& p, const T& net, cudaStream_t stream) {
  if (p.exchange_counts)
    internode_notify_kernel<T><<<p.net.shape.num_channels, kNotifyThreads, 0, stream>>>(p, NotifyPhase::kCount, net);
  internode_notify_kernel<T><<<1, kNotifyThreads, 0, stream>>>(p, NotifyPhase::kExchange, net);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace turnout::kernels::internode
