// The internode dispatch data kernel (docs/INTERNODE.md "Data step"), a
// template on the network transport. Channel c is a pair of blocks:
//
// - send block: a sender warp per destination domain e walks the channel's
//   tokens in order, numbers those that reach e (handle [8]) and, for e other
//   than this domain, stages each in the slot of the network ring it lands in
//   and puts runs of staged slots to the forwarder (e, n), then arrives on its
//   tail. Beside them a receiver warp per forwarder n of this domain drains
//   the NVL sub-rings (c, n, s) into output rows.
// - forward block: a forwarder warp per source domain s takes that source's
//   tokens in order (from the network ring, or from x for this domain) and
//   writes each into NVL sub-ring (c, n, s) of every local rank it goes to.
//
// Every ring has one writer and one reader. No wait closes a cycle: a
// receiver polls all its sub-rings; a forwarder waits for its source's data
// or a receiver's room, never holding unpublished slots; a sender waits for
// credit only with every staged slot put. Every wait is bounded.
#pragma once

#include <cuda_runtime.h>

#include "kernels/device/bounded_wait.cuh"
#include "kernels/device/memory_order.cuh"
#include "kernels/device/vector_copy.cuh"
#include "kernels/internode/forwarders.hpp"
#include "kernels/internode/launch.hpp"
#include "kernels/internode/transport.cuh"
#include "turnout/error.hpp"

namespace turnout::kernels::internode {

namespace dispatch_detail {

// The slot's 16 bytes of source meta, as int32.
constexpr int kMetaToken = 0;   // the token's index on its source rank
constexpr int kMetaMask = 1;    // bit k: goes to local rank k of the destination domain
constexpr int kMetaDomain = 2;  // the source's domain
constexpr int kMetaColumn = 3;  // the source's local index

__device__ __forceinline__ char* at(void* base, int64_t offset) {
  return static_cast<char*>(base) + offset;
}

__device__ __forceinline__ int32_t* ints(void* base, int64_t offset) {
  return reinterpret_cast<int32_t*>(at(base, offset));
}

// Shrink mode: bit k: local rank k of domain e takes part in the call.
__device__ __forceinline__ uint32_t live_columns(const Forwarders& plan, int e) {
  uint32_t columns = 0;
  for (int k = 0; k < plan.num_nvl_ranks; ++k) columns |= plan.is_live(e, k) ? 1u << k : 0u;
  return columns;
}

// Bit k: token t goes to local rank k of domain e.
__device__ __forceinline__ uint32_t domain_mask(const DispatchParams& p, int t, int e) {
  const int R = p.peers.num_ranks, D = p.peers.num_nvl_ranks;
  const bool* row = p.args.handle.is_token_in_rank + static_cast<int64_t>(t) * R + e * D;
  uint32_t mask = 0;
  for (int k = 0; k < D; ++k) mask |= row[k] ? 1u << k : 0u;
  return mask;
}

// Warp-wide: token t of this rank's input into the slot at `dst` (staging,
// or a local rank's NVL slot).
__device__ void pack_token(const DispatchParams& p, int t, char* dst, uint32_t mask, int lane) {
  const InternodeDispatchArgs& a = p.args;
  const DispatchSlot& s = p.slot;
  device::warp_copy_16<false>(dst, static_cast<const char*>(a.x) + static_cast<int64_t>(t) * a.row_bytes,
                              a.row_bytes / 16, lane);
  const auto* scales = static_cast<const int32_t*>(a.x_scales);
  for (int g = lane; g < a.num_scales; g += 32)
    reinterpret_cast<int32_t*>(dst + s.scales)[g] = scales[t * a.scale_stride_token + g * a.scale_stride_group];
  for (int k = lane; k < a.num_topk; k += 32) {
    const int64_t i = static_cast<int64_t>(t) * a.num_topk + k;
    reinterpret_cast<int32_t*>(dst + s.topk)[k] = static_cast<int32_t>(a.topk_idx[i]);
    reinterpret_cast<float*>(dst + s.weights)[k] = a.topk_weights[i];
  }
  if (lane == 0)
    device::store_16(dst + s.src, make_int4(t, static_cast<int>(mask), p.peers.rank / p.peers.num_nvl_ranks,
                                            p.peers.rank % p.peers.num_nvl_ranks));
}

// Warp-wide: the slot at `src` (written by another GPU) into output row `row`.
__device__ void unpack_token(const DispatchParams& p, const char* src, int64_t row, int lane) {
  const InternodeDispatchArgs& a = p.args;
  const DispatchSlot& s = p.slot;
  device::warp_copy_16<true>(at(a.recv_x, row * a.row_bytes), src, a.row_bytes / 16, lane);
  for (int g = lane; g < a.num_scales; g += 32)
    static_cast<int32_t*>(a.recv_x_scales)[row * a.num_scales + g] =
        __ldcg(reinterpret_cast<const int32_t*>(src + s.scales) + g);
  const int first = p.peers.rank * p.experts_per_rank;
  for (int k = lane; k < a.num_topk; k += 32) {
    const int32_t e = __ldcg(reinterpret_cast<const int32_t*>(src + s.topk) + k);
    const bool mine = e >= first && e < first + p.experts_per_rank;
    a.recv_topk_idx[row * a.num_topk + k] = mine ? e - first : -1;
    a.recv_topk_weights[row * a.num_topk + k] =
        mine ? __ldcg(reinterpret_cast<const float*>(src + s.weights) + k) : 0.f;
  }
  if (lane == 0 && !a.cached) {
    const int4 meta = device::load_shared_16(src + s.src);
    a.handle.recv_src_meta[row * 2] = meta.x;
    a.handle.recv_src_meta[row * 2 + 1] = meta.y;
  }
}

// Lane 0 waits, the warp learns the outcome.
template <typename Ready>
__device__ __forceinline__ bool warp_wait(const DispatchParams& p, int peer, Ready ready, int lane) {
  bool ok = true;
  if (lane == 0) ok = device::bounded_wait(p.ctx, peer, WaitSite::kDispatchData, ready);
  return __shfl_sync(~0u, ok, 0);
}

// kShrink: the token goes to the forwarder of this rank's column in e
// (Forwarders), into the part of its rings that serves the column; masked
// ranks' columns of is_token_in_rank read as cleared.
template <bool kShrink, NetTransport T>
__device__ void send(const DispatchParams& p, const T& net, int c, int e, int lane) {
  const InternodeDispatchArgs& a = p.args;
  const int D = p.peers.num_nvl_ranks, N = p.peers.num_ranks / D;
  const int d = p.peers.rank / D, n = p.peers.rank % D;
  const int C = p.net.shape.num_channels;
  int f = n, part = 0, first_slot = 0, Q = p.net.shape.net_slots;
  uint32_t columns = ~0u;
  if constexpr (kShrink) {
    const Forwarders plan{a.handle.live, N, D};
    columns = live_columns(plan, e);
    f = plan.forwarder(e, n);  // kNoForwarder only where no column is live: nothing reaches e
    if (f != kNoForwarder) {
      const int parts = plan.num_parts(e, f);
      part = plan.part(e, n);
      first_slot = part_first_slot(Q, parts, part);
      Q = part_slots(Q, parts);
    }
  }
  const int pe = e * D + f;
  // A channel's ring (or part) may have fewer slots than a chunk (1/K of the config's).
  const int chunk = min(a.config.num_max_rdma_chunked_send_tokens, Q);
  const int begin = channel_begin(a.num_tokens, c, C), end = channel_begin(a.num_tokens, c + 1, C);
  char* local = net.local();
  const int32_t* head = ints(local, kShrink ? p.net.head(c, e, part) : p.net.head(c, e));
  int placed = 0, put = 0;  // tokens numbered (staged when e is far), tokens put
  const auto flush = [&] {
    if constexpr (kShrink)
      put_staged_part(net, p.net, p.slot.bytes, pe, c, d, e, part, first_slot, Q, put, placed, lane);
    else
      put_staged(net, p.net, p.slot.bytes, pe, c, d, e, put, placed, lane);
  };
  bool ok = true;
  for (int base = begin; ok && base < end; base += 32) {
    const int t_lane = base + lane;
    const bool reaches = t_lane < end && (domain_mask(p, t_lane, e) & columns) != 0;
    if (!a.cached && t_lane < end && !reaches) a.handle.send_rdma_head[static_cast<int64_t>(t_lane) * N + e] = -1;
    for (uint32_t ballot = __ballot_sync(~0u, reaches); ok && ballot; ballot &= ballot - 1) {
      const int t = base + __ffs(ballot) - 1;
      if (!a.cached && lane == 0) a.handle.send_rdma_head[static_cast<int64_t>(t) * N + e] = placed;
      if (e != d) {
        // Lane 0's view of the credit, so that the warp branches as one.
        if (placed - __shfl_sync(~0u, device::load_acquire_sys(head), 0) >= Q) {
          // Everything staged is put before waiting, so the forwarder can drain it.
          flush();
          ok = warp_wait(p, pe, [&] { return placed - device::load_acquire_sys(head) < Q; }, lane);
          if (!ok) break;
        }
        pack_token(p, t, local + p.net.stage_slot(c, e, first_slot + placed % Q), domain_mask(p, t, e) & columns, lane);
        __syncwarp();
      }
      ++placed;
      if (e != d && placed - put == chunk) flush();
    }
  }
  if (e != d) {
    if (ok) flush();
    net.quiet();
  }
}

template <NetTransport T>
__device__ void forward(const DispatchParams& p, const T& net, int c, int s, int lane) {
  const InternodeDispatchArgs& a = p.args;
  const InternodeHandle& h = a.handle;
  const int D = p.peers.num_nvl_ranks;
  const int d = p.peers.rank / D, n = p.peers.rank % D;
  const int C = p.net.shape.num_channels, Q = p.net.shape.net_slots, Qs = p.nvl.sub_slots();
  const int credit_chunk = min(a.config.num_max_rdma_chunked_send_tokens, p.net.shape.net_slots);
  char* local = net.local();
  void* self = p.peers.buffers[n];
  const int32_t* recv_prefix = h.recv_rdma_channel_prefix_matrix + s * C;
  const int before = c == 0 ? 0 : recv_prefix[c - 1];
  const int count = recv_prefix[c] - before;
  const int64_t row0 = (s == 0 ? 0 : h.recv_rdma_rank_prefix_sum[s - 1]) + before;
  // Lane j: tokens written into sub-ring (c, n, s) of local rank j, and (for
  // handle [9]) its place in the channel's stream to j in forward order:
  // every earlier source domain's tokens of this channel to j first.
  int written = 0, place = 0;
  if (!a.cached && lane < D)
    for (int e = 0; e < s; ++e) {
      const int32_t* chan = ints(local, p.net.message(e)) + MessageLayout(p.net.shape).per_channel + lane * C;
      place += chan[c] - (c == 0 ? 0 : chan[c - 1]);
    }
  const int32_t* tail = ints(local, p.net.tail(c, s));
  int arrived = 0, credited = 0;
  // This domain's tokens come from x: the channel's tokens that reach it, in order.
  const int begin = channel_begin(a.num_tokens, c, C), end = channel_begin(a.num_tokens, c + 1, C);
  int own_next = begin;
  bool ok = true;
  for (int i = 0; ok && i < count; ++i) {
    const char* slot = nullptr;
    int t = -1;
    uint32_t mask;
    if (s != d) {
      if (i == arrived) {
        if (credited < i) {
          // Return every drained slot before waiting, so the sender is never short of them.
          if (lane == 0) net.add(s * D + n, p.net.head(c, d), i - credited);
          credited = i;
        }
        ok = warp_wait(p, s * D + n, [&] { return device::load_acquire_sys(tail) > i; }, lane);
        if (!ok) break;
        arrived = __shfl_sync(~0u, device::load_acquire_sys(tail), 0);
      }
      slot = local + p.net.recv_slot(c, s, i % Q);
      mask = static_cast<uint32_t>(__ldcg(reinterpret_cast<const int32_t*>(slot + p.slot.src) + kMetaMask));
    } else {
      for (mask = 0; own_next < end && (mask = domain_mask(p, own_next, d)) == 0;) ++own_next;
      t = own_next++;
    }
    for (uint32_t left = mask; ok && left; left &= left - 1) {
      const int j = __ffs(left) - 1;
      const int at_j = __shfl_sync(~0u, written, j);
      const int32_t* head = ints(self, p.nvl.head(c, j, s));
      ok = warp_wait(p, d * D + j, [&] { return at_j - device::load_acquire_sys(head) < Qs; }, lane);
      if (!ok) break;
      char* dst = at(p.peers.buffers[j], p.nvl.slot(c, n, s, at_j % Qs));
      if (s != d)
        device::warp_copy_16<true>(dst, slot, p.slot.bytes / 16, lane);
      else
        pack_token(p, t, dst, mask, lane);
      __syncwarp();
      if (lane == 0) device::store_release_sys(ints(p.peers.buffers[j], p.nvl.tail(c, n, s)), at_j + 1);
    }
    if (!ok) break;
    const bool mine = lane < D && (mask >> lane & 1);
    if (!a.cached && lane < D) h.send_nvl_head[(row0 + i) * D + lane] = mine ? place : -1;
    written += mine ? 1 : 0;
    place += mine ? 1 : 0;
    if (s != d && i + 1 - credited >= credit_chunk) {
      if (lane == 0) net.add(s * D + n, p.net.head(c, d), i + 1 - credited);
      credited = i + 1;
    }
  }
  if (ok && s != d && credited < count && lane == 0) net.add(s * D + n, p.net.head(c, d), count - credited);
  if (s != d) net.quiet();
}

// Shrink mode's forward: the rank forwards for every column it serves, a part
// of its rings each, drained part after part (column order), so that its
// forward order is (source domain, part, token), handle [3], [4] and [9]'s; a
// masked source's part is empty. (forward above is the one part of a rank
// whose column is its own, kept apart so that its code stays as it was.)
template <NetTransport T>
__device__ void forward_shrink(const DispatchParams& p, const T& net, int c, int s, int lane) {
  const InternodeDispatchArgs& a = p.args;
  const InternodeHandle& h = a.handle;
  const int D = p.peers.num_nvl_ranks;
  const int d = p.peers.rank / D, n = p.peers.rank % D;
  const int C = p.net.shape.num_channels, Qs = p.nvl.sub_slots();
  const Forwarders plan{h.live, p.peers.num_ranks / D, D};
  const int P = plan.num_parts(d, n);
  const uint32_t columns = live_columns(plan, d);
  char* local = net.local();
  void* self = p.peers.buffers[n];
  // Lane j: tokens written into sub-ring (c, n, s) of local rank j, and (for
  // handle [9]) its place in the channel's stream to j in forward order:
  // every earlier (source domain, part)'s tokens of this channel to j first.
  int written = 0, place = 0;
  if (!a.cached && lane < D)
    for (int e = 0; e < s; ++e)
      for (int q = 0; q < P; ++q) {
        if (!plan.is_live(e, plan.served_column(d, n, q))) continue;
        const int32_t* chan = ints(local, p.net.message(e, q)) + MessageLayout(p.net.shape).per_channel + lane * C;
        place += chan[c] - (c == 0 ? 0 : chan[c - 1]);
      }
  bool ok = true;
  for (int q = 0; ok && q < P; ++q) {
    const int column = plan.served_column(d, n, q), row = s * P + q;
    const int first_slot = part_first_slot(p.net.shape.net_slots, P, q);
    const int Q = part_slots(p.net.shape.net_slots, P);
    const int credit_chunk = min(a.config.num_max_rdma_chunked_send_tokens, Q);
    const int32_t* recv_prefix = h.recv_rdma_channel_prefix_matrix + row * C;
    const int before = c == 0 ? 0 : recv_prefix[c - 1];
    const int count = recv_prefix[c] - before;
    const int64_t row0 = (row == 0 ? 0 : h.recv_rdma_rank_prefix_sum[row - 1]) + before;
    const int32_t* tail = ints(local, p.net.tail(c, s, q));
    const int64_t credit_word = p.net.head(c, d, q);
    const int source = s * D + column;
    int arrived = 0, credited = 0;
    // This domain's tokens come from x: the channel's tokens that reach it, in
    // order (only this rank's own column has any: the others it serves are masked).
    const int begin = channel_begin(a.num_tokens, c, C), end = channel_begin(a.num_tokens, c + 1, C);
    int own_next = begin;
    for (int i = 0; ok && i < count; ++i) {
      const char* slot = nullptr;
      int t = -1;
      uint32_t mask;
      if (s != d) {
        if (i == arrived) {
          if (credited < i) {
            // Return every drained slot before waiting, so the sender is never short of them.
            if (lane == 0) net.add(source, credit_word, i - credited);
            credited = i;
          }
          ok = warp_wait(p, source, [&] { return device::load_acquire_sys(tail) > i; }, lane);
          if (!ok) break;
          arrived = __shfl_sync(~0u, device::load_acquire_sys(tail), 0);
        }
        slot = local + p.net.recv_slot(c, s, first_slot + i % Q);
        mask = static_cast<uint32_t>(__ldcg(reinterpret_cast<const int32_t*>(slot + p.slot.src) + kMetaMask));
      } else {
        for (mask = 0; own_next < end && (mask = domain_mask(p, own_next, d) & columns) == 0;) ++own_next;
        t = own_next++;
      }
      for (uint32_t left = mask; ok && left; left &= left - 1) {
        const int j = __ffs(left) - 1;
        const int at_j = __shfl_sync(~0u, written, j);
        const int32_t* head = ints(self, p.nvl.head(c, j, s));
        ok = warp_wait(p, d * D + j, [&] { return at_j - device::load_acquire_sys(head) < Qs; }, lane);
        if (!ok) break;
        char* dst = at(p.peers.buffers[j], p.nvl.slot(c, n, s, at_j % Qs));
        if (s != d)
          device::warp_copy_16<true>(dst, slot, p.slot.bytes / 16, lane);
        else
          pack_token(p, t, dst, mask, lane);
        __syncwarp();
        if (lane == 0) device::store_release_sys(ints(p.peers.buffers[j], p.nvl.tail(c, n, s)), at_j + 1);
      }
      if (!ok) break;
      const bool mine = lane < D && (mask >> lane & 1);
      if (!a.cached && lane < D) h.send_nvl_head[(row0 + i) * D + lane] = mine ? place : -1;
      written += mine ? 1 : 0;
      place += mine ? 1 : 0;
      if (s != d && i + 1 - credited >= credit_chunk) {
        if (lane == 0) net.add(source, credit_word, i + 1 - credited);
        credited = i + 1;
      }
    }
    if (ok && s != d && credited < count && lane == 0) net.add(source, credit_word, count - credited);
  }
  if (s != d) net.quiet();
}

// The rows of source rank g in channel c: its first row here and how many.
__device__ __forceinline__ int2 channel_rows(const InternodeHandle& h, int g, int c, int C) {
  const int start = h.recv_gbl_channel_prefix_matrix[g * C + c];
  const int stop = c + 1 < C ? h.recv_gbl_channel_prefix_matrix[g * C + c + 1] : h.recv_gbl_rank_prefix_sum[g];
  return make_int2(start, stop - start);
}

// kShrink: forwarder `from` may serve several columns; sub-ring (c, from, s)
// then holds the tokens of sources (s, m), m the columns it serves, source
// after source in column order (it drains its parts so), and a slot's row is
// found by counting per source rank.
template <bool kShrink>
__device__ __forceinline__ void receive_as(const DispatchParams& p, int c, int from, int lane) {
  const InternodeHandle& h = p.args.handle;
  const int D = p.peers.num_nvl_ranks, N = p.peers.num_ranks / D;
  const int d = p.peers.rank / D, me_local = p.peers.rank % D;
  const int C = p.net.shape.num_channels, Qs = p.nvl.sub_slots();
  void* self = p.peers.buffers[me_local];
  const Forwarders plan{h.live, N, D};
  const uint32_t served = kShrink ? plan.served(d, from) : 0u;
  // Lane s: the rows of source (s, from) in this channel (kShrink: of every
  // source whose column `from` serves), and how many came.
  int start = 0, expected = 0, done = 0;
  if (lane < N) {
    if constexpr (kShrink) {
      for (int m = 0; m < D; ++m)
        if (served >> m & 1) expected += channel_rows(h, lane * D + m, c, C).y;
    } else {
      const int2 rows = channel_rows(h, lane * D + from, c, C);
      start = rows.x;
      expected = rows.y;
    }
  }
  // Lane 0 waits on the warp's view of every sub-ring, kept in shared memory.
  __shared__ int s_done[32][32], s_expected[32][32];
  const int warp = threadIdx.x / 32;
  while (__any_sync(~0u, done < expected)) {
    // The sub-rings with data, polled together; a wait only when none has any.
    const int ready = lane < N ? device::load_acquire_sys(ints(self, p.nvl.tail(c, from, lane))) : 0;
    if (!__any_sync(~0u, ready > done)) {
      s_done[warp][lane] = done;
      s_expected[warp][lane] = expected;
      __syncwarp();
      const bool ok = warp_wait(
          p, d * D + from,
          [&] {
            for (int s = 0; s < N; ++s)
              if (s_done[warp][s] < s_expected[warp][s] &&
                  device::load_acquire_sys(ints(self, p.nvl.tail(c, from, s))) > s_done[warp][s])
                return true;
            return false;
          },
          lane);
      if (!ok) return;
      continue;
    }
    for (int s = 0; s < N; ++s) {
      const int upto = __shfl_sync(~0u, ready, s), from_done = __shfl_sync(~0u, done, s);
      if (upto <= from_done) continue;
      const int first_row = __shfl_sync(~0u, start, s);
      for (int k = from_done; k < upto; ++k) {
        int64_t row = first_row + k;
        if constexpr (kShrink) {
          // The k-th token of the sub-ring: past the earlier served sources' tokens.
          int left = k;
          for (int m = 0; m < D; ++m) {
            if (!(served >> m & 1)) continue;
            const int2 rows = channel_rows(h, s * D + m, c, C);
            if (left < rows.y) {
              row = rows.x + left;
              break;
            }
            left -= rows.y;
          }
        }
        unpack_token(p, at(self, p.nvl.slot(c, from, s, k % Qs)), row, lane);
      }
      __syncwarp();
      if (lane == 0) device::store_release_sys(ints(p.peers.buffers[from], p.nvl.head(c, me_local, s)), upto);
      if (lane == s) done = upto;
    }
  }
}

// Rows past the received ones (num_worst_tokens; all of them when the call
// failed) get no expert and no source; a failed call marks handle [4] -1, so
// that no combine or cached dispatch takes the handle.
template <bool kShrink>
__device__ __forceinline__ void fill_padding_as(const DispatchParams& p, bool failed) {
  const InternodeDispatchArgs& a = p.args;
  const InternodeHandle& h = a.handle;
  const int R = p.peers.num_ranks, D = p.peers.num_nvl_ranks, N = R / D, pair = blockIdx.x / 2;
  const int pairs = static_cast<int>(gridDim.x) / 2;
  // [4] has a row per (source domain, part): N x P of them, or with
  // num_worst_tokens one per part a rank may have (the counts step's rows).
  int rows = N;
  if constexpr (kShrink)
    rows = N * (a.num_worst_tokens > 0 ? p.net.shape.max_parts
                                       : Forwarders{h.live, N, D}.num_parts(p.peers.rank / D, p.peers.rank % D));
  if (failed && pair == 0 && !a.cached)
    for (int e = threadIdx.x; e < rows; e += blockDim.x) h.recv_rdma_rank_prefix_sum[e] = -1;
  if (a.num_worst_tokens == 0) return;
  const int num_recv = failed ? 0 : h.recv_gbl_rank_prefix_sum[R - 1];
  const int64_t per_row = 2 + a.num_topk;
  const int64_t total = (h.num_recv - static_cast<int64_t>(num_recv)) * per_row;
  for (int64_t i = pair * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(pairs) * blockDim.x) {
    const int64_t row = num_recv + i / per_row;
    const int k = static_cast<int>(i % per_row);
    if (k < 2) {
      if (!a.cached) h.recv_src_meta[row * 2 + k] = -1;
    } else {
      a.recv_topk_idx[row * a.num_topk + k - 2] = -1;
      a.recv_topk_weights[row * a.num_topk + k - 2] = 0.0f;
    }
  }
}

// Plain functions around the templates, so that the compiler keeps its
// choice of not inlining them into the kernel (as before shrink mode).
__device__ void receive(const DispatchParams& p, int c, int from, int lane) {
  receive_as<false>(p, c, from, lane);
}
__device__ void receive_shrink(const DispatchParams& p, int c, int from, int lane) {
  receive_as<true>(p, c, from, lane);
}
__device__ void fill_padding(const DispatchParams& p, bool failed) {
  fill_padding_as<false>(p, failed);
}
__device__ void fill_padding_shrink(const DispatchParams& p, bool failed) {
  fill_padding_as<true>(p, failed);
}

}  // namespace dispatch_detail

// kShrink: shrink mode (the handle carries a live set, [10]); without it the
// code is that of a build without shrink mode.
template <NetTransport T, bool kShrink>
__global__ void __launch_bounds__(1024, 1) internode_dispatch_kernel(DispatchParams p, T net) {
  using namespace dispatch_detail;
  if (device::wait_abandoned(p.ctx.errors)) return;
  const int D = p.peers.num_nvl_ranks, N = p.peers.num_ranks / D;
  const bool failed = device::load_volatile(ints(p.peers.buffers[p.peers.rank % D], p.nvl.status)) != 0;
  // Warp w runs role w % W of channel (blockIdx.x / 2) K + w / W.
  const int W = dispatch_block_warps(N, D), K = channels_per_block(N, D);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, role = warp % W;
  const int c = blockIdx.x / 2 * K + warp / W;
  if (blockIdx.x % 2 == 1) {
    if constexpr (kShrink)
      fill_padding_shrink(p, failed);
    else
      fill_padding(p, failed);
    if (!failed && role < N) {
      if constexpr (kShrink)
        forward_shrink(p, net, c, role, lane);
      else
        forward(p, net, c, role, lane);
    }
    return;
  }
  if (failed) return;
  if (role < N)
    send<kShrink>(p, net, c, role, lane);
  else if constexpr (kShrink)
    receive_shrink(p, c, role - N, lane);
  else
    receive(p, c, role - N, lane);
}

template <NetTransport T>
void launch_dispatch_on(const DispatchParams& p, const T& net, cudaStream_t stream) {
  const int D = p.peers.num_nvl_ranks, N = p.peers.num_ranks / D, K = channels_per_block(N, D);
  const dim3 blocks(2 * (p.net.shape.num_channels / K)), threads(32 * K * dispatch_block_warps(N, D));
  if (p.args.handle.live != nullptr)
    internode_dispatch_kernel<T, true><<<blocks, threads, 0, stream>>>(p, net);
  else
    internode_dispatch_kernel<T, false><<<blocks, threads, 0, stream>>>(p, net);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace turnout::kernels::internode
