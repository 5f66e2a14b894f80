// The internode combine data kernel (docs/INTERNODE.md "Combine"), a
// template on the network transport: dispatch's pairs of blocks run
// backwards. Channel c of rank (d, j):
//
// - send block: a warp per forwarder n of this domain streams the rows this
//   rank received from each source (s, n) in channel c, in receive order,
//   into sub-ring (c, j, s) of rank (d, n), serving whichever sub-ring has room.
// - forward block: a warp per other domain s walks the tokens this rank
//   forwarded from (s, n) in channel c, sums in fp32 the next row of each local
//   rank they went to (local rank order), rounds to bf16 and puts the partial
//   (with its fp32 weights) back to (s, n). The warp of this rank's own domain
//   is the final reduce: for each of this rank's tokens, in order, its own
//   domain's rows (local rank order) and each other domain's partial (domain
//   order), in fp32, then the biases; rounded to bf16 once.
//
// The order of every sum is fixed, so the result is the same run after run.
// No wait closes a cycle: senders poll all their sub-rings, forwarders wait
// for rows the senders always deliver or for ring room the final reduce always
// frees (it drains each network ring in token order, the order the forwarder
// fills it), holding nothing unpublished.
//
// Shrink mode: every wait is judged (ctx: the mask, the shrink timeout), and a
// rank of the dispatch's live set that is masked (since the dispatch, or by a
// wait of this call) is left out: a sender's rows leave the sums, a
// forwarder's partials are lost (its sources sum the other domains'), a
// source gets nothing more. Senders still stream every row of the plan to a
// forwarder that is there, whichever of its sources are gone, so that its
// sub-rings hold the plan's rows: sender and forwarder need not agree on who
// else is gone (docs/INTERNODE.md "A rank that stops calling between a
// dispatch and its combine").
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/device/bounded_wait.cuh"
#include "kernels/device/error_record.cuh"
#include "kernels/device/memory_order.cuh"
#include "kernels/device/vector_copy.cuh"
#include "kernels/internode/forwarders.hpp"
#include "kernels/internode/launch.hpp"
#include "kernels/internode/transport.cuh"
#include "turnout/error.hpp"

namespace turnout::kernels::internode {

namespace combine_detail {

__device__ __forceinline__ char* at(void* base, int64_t offset) {
  return static_cast<char*>(base) + offset;
}

__device__ __forceinline__ int32_t* ints(void* base, int64_t offset) {
  return reinterpret_cast<int32_t*>(at(base, offset));
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

__device__ __forceinline__ int4 to_bf16x8(const float (&acc)[8]) {
  int4 out;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int k = 0; k < 4; ++k) h[k] = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
  return out;
}

// The most rows one sum reads: a row from every local rank, or a row of this
// domain's and a partial of every other.
inline constexpr int kMaxSummands = kMaxNvlRanks + kMaxDomains;
// Warp-wide: out = bf16(sum of rows[0..m) then bias0, bias1), in fp32 in that
// order for every element (the order the reference sums in), for a row of
// n16 16-byte words. Each lane loads kWords words of a summand before it adds
// them, so that a summand's row is read in n16 / (32 kWords) round trips.
template <int kWords>
__device__ __forceinline__ void sum_rows(const char* const* rows, int m, const void* bias0, const void* bias1,
                                         void* out, int n16, int lane) {
  for (int v0 = lane; v0 < n16; v0 += 32 * kWords) {
    float acc[kWords][8] = {};
    const auto add = [&](const char* base, bool input) {
      int4 w[kWords];
#pragma unroll
      for (int u = 0; u < kWords; ++u) {
        const int v = v0 + 32 * u;
        if (v < n16) w[u] = input ? device::load_input_16(base + v * 16) : device::load_shared_16(base + v * 16);
      }
#pragma unroll
      for (int u = 0; u < kWords; ++u)
        if (v0 + 32 * u < n16) add_bf16x8(acc[u], w[u]);
    };
    for (int k = 0; k < m; ++k) add(rows[k], false);
    if (bias0) add(static_cast<const char*>(bias0), true);
    if (bias1) add(static_cast<const char*>(bias1), true);
#pragma unroll
    for (int u = 0; u < kWords; ++u) {
      const int v = v0 + 32 * u;
      if (v < n16) device::store_16(static_cast<char*>(out) + v * 16, to_bf16x8(acc[u]));
    }
  }
}

template <typename Ready>
__device__ __forceinline__ bool warp_wait(const CombineParams& p, int peer, Ready ready, int lane) {
  bool ok = true;
  if (lane == 0) ok = device::bounded_wait(p.ctx, peer, WaitSite::kCombineData, ready);
  return __shfl_sync(~0u, ok, 0);
}

// Shrink mode, after a wait that gave up: its peer is masked (go on without
// it), unless the call failed (some wait of this rank recorded an error).
__device__ __forceinline__ bool peer_gone(const CombineParams& p, int lane) {
  bool failed = false;
  if (lane == 0) failed = device::wait_abandoned(p.ctx.errors);
  return !__shfl_sync(~0u, failed, 0);
}

// Shrink mode: whether rank g is masked, alike on every lane.
__device__ __forceinline__ bool masked(const CombineParams& p, int g, int lane) {
  bool out = false;
  if (lane == 0) out = device::rank_masked(p.ctx, g);
  return __shfl_sync(~0u, out, 0);
}

// Bit k: token t of this rank went to local rank k of domain e.
__device__ __forceinline__ uint32_t domain_mask(const CombineParams& p, int t, int e) {
  const int R = p.peers.num_ranks, D = p.peers.num_nvl_ranks;
  const bool* row = p.args.handle.is_token_in_rank + static_cast<int64_t>(t) * R + e * D;
  uint32_t mask = 0;
  for (int k = 0; k < D; ++k) mask |= row[k] ? 1u << k : 0u;
  return mask;
}

// Shrink mode: bit k: local rank k of domain e takes part in the call.
__device__ __forceinline__ uint32_t live_columns(const Forwarders& plan, int e) {
  uint32_t columns = 0;
  for (int k = 0; k < plan.num_nvl_ranks; ++k) columns |= plan.is_live(e, k) ? 1u << k : 0u;
  return columns;
}

// The rows of source rank g in channel c: its first row here and how many.
__device__ __forceinline__ int2 channel_rows(const InternodeHandle& h, int g, int c, int C) {
  const int first = h.recv_gbl_channel_prefix_matrix[g * C + c];
  const int stop = c + 1 < C ? h.recv_gbl_channel_prefix_matrix[g * C + c + 1] : h.recv_gbl_rank_prefix_sum[g];
  return make_int2(first, stop - first);
}

// Shrink mode: the k-th row of channel c that goes to the forwarder serving
// columns `served`: sources (s, m) in column order, rows in order.
__device__ __forceinline__ int64_t served_row(const InternodeHandle& h, uint32_t served, int s, int k, int c, int C,
                                              int D) {
  for (int m = 0; m < D; ++m) {
    if (!(served >> m & 1)) continue;
    const int2 rows = channel_rows(h, s * D + m, c, C);
    if (k < rows.y) return rows.x + k;
    k -= rows.y;
  }
  return -1;  // not reached: k is below the served sources' rows
}

// Send block, warp for forwarder n: this rank's rows of sources (s, n).
// kShrink: of every source (s, m) whose column m forwarder n serves, source
// after source in column order (the order n sums them in).
template <bool kShrink>
__device__ __forceinline__ void send_rows_as(const CombineParams& p, int c, int n, int lane) {
  const InternodeCombineArgs& a = p.args;
  const InternodeHandle& h = a.handle;
  const int D = p.peers.num_nvl_ranks, N = p.peers.num_ranks / D;
  const int d = p.peers.rank / D, j = p.peers.rank % D;
  const int C = p.net.shape.num_channels, Qs = p.nvl.sub_slots();
  const int row_bytes = a.hidden * 2;
  void* self = p.peers.buffers[j];
  void* forwarder = p.peers.buffers[n];
  __shared__ int s_sent[32][32], s_count[32][32];
  const int warp = threadIdx.x / 32;
  const uint32_t served = kShrink ? Forwarders{h.live, N, D}.served(d, n) : 0u;
  // A forwarder gone since the dispatch: its columns' partials are lost.
  if constexpr (kShrink)
    if (n != j && masked(p, d * D + n, lane)) return;
  // Lane s: the rows of source (s, n) in channel c, and how many went.
  int first = 0, count = 0, sent = 0;
  if (lane < N) {
    if constexpr (kShrink) {
      for (int m = 0; m < D; ++m)
        if (served >> m & 1) count += channel_rows(h, lane * D + m, c, C).y;
    } else {
      const int2 rows = channel_rows(h, lane * D + n, c, C);
      first = rows.x;
      count = rows.y;
    }
  }
  while (__any_sync(~0u, sent < count)) {
    const int drained = lane < N ? device::load_acquire_sys(ints(self, p.nvl.head(c, n, lane))) : 0;
    const int room = lane < N ? min(count - sent, Qs - (sent - drained)) : 0;
    if (!__any_sync(~0u, room > 0)) {
      s_sent[warp][lane] = sent;
      s_count[warp][lane] = count;
      __syncwarp();
      const bool ok = warp_wait(
          p, d * D + n,
          [&] {
            for (int s = 0; s < N; ++s)
              if (s_sent[warp][s] < s_count[warp][s] &&
                  s_sent[warp][s] - device::load_acquire_sys(ints(self, p.nvl.head(c, n, s))) < Qs)
                return true;
            return false;
          },
          lane);
      if (!ok) return;
      continue;
    }
    for (int s = 0; s < N; ++s) {
      const int k = __shfl_sync(~0u, room, s), from = __shfl_sync(~0u, sent, s);
      if (k <= 0) continue;
      const int64_t row0 = __shfl_sync(~0u, first, s) + from;
      for (int i = 0; i < k; ++i) {
        char* dst = at(forwarder, p.nvl.slot(c, j, s, (from + i) % Qs));
        const int64_t row = kShrink ? served_row(h, served, s, from + i, c, C, D) : row0 + i;
        device::warp_copy_16<false>(dst, static_cast<const char*>(a.x) + row * row_bytes, row_bytes / 16, lane);
        for (int q = lane; q < a.num_topk; q += 32)
          reinterpret_cast<float*>(dst + p.slot.weights)[q] = a.topk_weights[row * a.num_topk + q];
      }
      __syncwarp();
      if (lane == 0) device::store_release_sys(ints(forwarder, p.nvl.tail(c, j, s)), from + k);
      if (lane == s) sent = from + k;
    }
  }
}

// Plain functions around the template, so that the compiler keeps its choice
// of not inlining them into the kernel (as before shrink mode).
__device__ void send_rows(const CombineParams& p, int c, int n, int lane) {
  send_rows_as<false>(p, c, n, lane);
}
__device__ void send_rows_shrink(const CombineParams& p, int c, int n, int lane) {
  send_rows_as<true>(p, c, n, lane);
}

// Forward block, warp for other domain s: the partial sums of the tokens this
// rank forwarded from (s, n), back to (s, n). kShrink: of every source (s, m)
// whose column m it serves, part after part (dispatch's forward order), each
// back to its source through that part of the rings; a local rank gone leaves
// its rows out, a source gone gets nothing (its rows are still taken).
template <bool kShrink, int kWords, NetTransport T>
__device__ void reduce_for(const CombineParams& p, const T& net, int c, int s, int lane) {
  const InternodeCombineArgs& a = p.args;
  const InternodeHandle& h = a.handle;
  const int D = p.peers.num_nvl_ranks;
  const int d = p.peers.rank / D, n = p.peers.rank % D;
  const int C = p.net.shape.num_channels, Qs = p.nvl.sub_slots();
  const Forwarders plan{h.live, p.peers.num_ranks / D, D};
  const int P = kShrink ? plan.num_parts(d, n) : 1;
  const int n16 = a.hidden * 2 / 16;
  char* local = net.local();
  void* self = p.peers.buffers[n];
  __shared__ int s_taken[32][32];
  const int warp = threadIdx.x / 32;
  __shared__ const char* s_sum[32][kMaxNvlRanks];
  int consumed = 0;  // lane j: rows taken from sub-ring (c, j, s)
  // kShrink, a token of a source gone: its rows go back to the senders unread.
  const auto release = [&](uint32_t mask) {
    if (lane < D && (mask >> lane & 1)) {
      ++consumed;
      device::store_release_sys(ints(p.peers.buffers[lane], p.nvl.head(c, n, s)), consumed);
    }
  };
  // kShrink: bit j: local rank j still sends (not masked).
  uint32_t senders = ~0u;
  if constexpr (kShrink)
    senders = __ballot_sync(~0u, lane < D && (lane == n || !device::rank_masked(p.ctx, d * D + lane)));
  bool ok = true;
  for (int part = 0; ok && part < P; ++part) {
    const int column = kShrink ? plan.served_column(d, n, part) : n, pe = s * D + column, row = s * P + part;
    const int first_slot = kShrink ? part_first_slot(p.net.shape.net_slots, P, part) : 0;
    const int Q = kShrink ? part_slots(p.net.shape.net_slots, P) : p.net.shape.net_slots;
    const int chunk = min(a.config.num_max_rdma_chunked_send_tokens, Q);
    const int32_t* prefix = h.recv_rdma_channel_prefix_matrix + row * C;
    const int before = c == 0 ? 0 : prefix[c - 1];
    const int count = prefix[c] - before;
    const int64_t row0 = (row == 0 ? 0 : h.recv_rdma_rank_prefix_sum[row - 1]) + before;
    const int32_t* head = ints(local, kShrink ? p.net.head(c, s, part) : p.net.head(c, s));
    // kShrink: the part's source is gone: no partials for it, its rows only taken.
    bool lost = false;
    if constexpr (kShrink) lost = masked(p, pe, lane);
    int placed = 0, put = 0;
    const auto flush = [&] {
      if constexpr (kShrink)
        put_staged_part(net, p.net, p.slot.bytes, pe, c, d, s, part, first_slot, Q, put, placed, lane);
      else
        put_staged(net, p.net, p.slot.bytes, pe, c, d, s, put, placed, lane);
    };
    for (int i = 0; ok && i < count; ++i) {
      // The local ranks the token went to, from handle [9].
      const bool to_lane = lane < D && h.send_nvl_head[(row0 + i) * D + lane] >= 0;
      uint32_t mask = __ballot_sync(~0u, to_lane);
      if constexpr (kShrink) mask &= senders;
      // Every row of the token has come.
      for (uint32_t left = mask; ok && left; left &= left - 1) {
        const int j = __ffs(left) - 1;
        const int want = __shfl_sync(~0u, consumed, j) + 1;
        const int32_t* tail = ints(self, p.nvl.tail(c, j, s));
        ok = warp_wait(p, d * D + j, [&] { return device::load_acquire_sys(tail) >= want; }, lane);
        if constexpr (kShrink)
          if (!ok && peer_gone(p, lane)) {
            ok = true;
            mask &= ~(1u << j);
            senders &= ~(1u << j);
          }
      }
      if (!ok) break;
      if constexpr (kShrink)
        if (lost) {
          release(mask);
          continue;
        }
      if (placed - __shfl_sync(~0u, device::load_acquire_sys(head), 0) >= Q) {
        flush();
        ok = warp_wait(p, pe, [&] { return placed - device::load_acquire_sys(head) < Q; }, lane);
        if constexpr (kShrink)
          if (!ok && peer_gone(p, lane)) {
            ok = true;
            lost = true;
            release(mask);
            continue;
          }
        if (!ok) break;
      }
      char* out = local + p.net.stage_slot(c, s, first_slot + placed % Q);
      // Every lane reads every row's place (lanes that finish early leave the loops below).
      s_taken[warp][lane] = consumed;
      __syncwarp();
      int m = 0;
      for (uint32_t left = mask; left; left &= left - 1) {
        const int j = __ffs(left) - 1;
        if (lane == 0) s_sum[warp][m] = at(self, p.nvl.slot(c, j, s, s_taken[warp][j] % Qs));
        ++m;
      }
      __syncwarp();
      sum_rows<kWords>(s_sum[warp], m, nullptr, nullptr, out, n16, lane);
      for (int q = lane; q < a.num_topk; q += 32) {
        float w = 0.0f;
        for (uint32_t left = mask; left; left &= left - 1) {
          const int j = __ffs(left) - 1;
          w += __ldcg(
              reinterpret_cast<const float*>(at(self, p.nvl.slot(c, j, s, s_taken[warp][j] % Qs)) + p.slot.weights) +
              q);
        }
        reinterpret_cast<float*>(out + p.slot.weights)[q] = w;
      }
      __syncwarp();
      // The rows are read: their slots go back to the senders.
      if (lane < D && (mask >> lane & 1)) {
        ++consumed;
        device::store_release_sys(ints(p.peers.buffers[lane], p.nvl.head(c, n, s)), consumed);
      }
      ++placed;
      if (placed - put == chunk) flush();
    }
    if (ok && !lost) flush();
  }
  net.quiet();
}

// Forward block, warp of this rank's own domain: the final sums of this
// rank's tokens of channel c.
// kShrink: masked ranks' columns of handle [0] read as cleared; domain e's
// partials come from the forwarder of this rank's column there, through the
// part of its rings that serves the column. A local rank gone leaves its rows
// out; a forwarder gone, its domain's partials (they count as zero).
template <bool kShrink, int kWords, NetTransport T>
__device__ void reduce_final(const CombineParams& p, const T& net, int c, int lane) {
  const InternodeCombineArgs& a = p.args;
  const int D = p.peers.num_nvl_ranks, N = p.peers.num_ranks / D;
  const int d = p.peers.rank / D, n = p.peers.rank % D;
  const int C = p.net.shape.num_channels, Qs = p.nvl.sub_slots();
  const Forwarders plan{a.handle.live, N, D};
  // Lane e < N: domain e's forwarder of my column, my part there and its slots.
  int f = n, part = 0, first_slot = 0, Q = p.net.shape.net_slots;
  uint32_t columns = ~0u;
  if constexpr (kShrink) {
    if (lane < N) {
      columns = live_columns(plan, lane);
      f = plan.forwarder(lane, n);
      if (f != kNoForwarder) {
        const int parts = plan.num_parts(lane, f);
        part = plan.part(lane, n);
        first_slot = part_first_slot(Q, parts, part);
        Q = part_slots(Q, parts);
      }
      // Ranks gone since the dispatch: this domain's senders, another domain's forwarder.
      if (lane == d) {
        for (int k = 0; k < D; ++k)
          if (k != n && device::rank_masked(p.ctx, d * D + k)) columns &= ~(1u << k);
      } else if (f != kNoForwarder && device::rank_masked(p.ctx, lane * D + f)) {
        columns = 0;
      }
    }
  }
  uint32_t own_columns = kShrink ? __shfl_sync(~0u, columns, d) : ~0u;
  const int chunk = min(a.config.num_max_rdma_chunked_send_tokens, Q);
  const int n16 = a.hidden * 2 / 16;
  char* local = net.local();
  void* self = p.peers.buffers[n];
  const int num_tokens = a.handle.num_tokens;
  const int begin = channel_begin(num_tokens, c, C), end = channel_begin(num_tokens, c + 1, C);
  // Lane j < D: rows taken from own sub-ring (c, j, d); lane e < N: partials
  // taken from network ring (c, e), and how many of those were credited.
  __shared__ int s_rows[32][32], s_partials[32][32];
  const int warp = threadIdx.x / 32;
  __shared__ const char* s_sum[32][kMaxSummands];
  int rows_taken = 0, partials = 0, credited = 0;
  bool ok = true;
  for (int t = begin; ok && t < end; ++t) {
    uint32_t own = domain_mask(p, t, d) & own_columns;
    const bool reaches = lane < N && lane != d && (domain_mask(p, t, lane) & columns) != 0;
    uint32_t far = __ballot_sync(~0u, reaches);
    for (uint32_t left = own; ok && left; left &= left - 1) {
      const int j = __ffs(left) - 1;
      const int want = __shfl_sync(~0u, rows_taken, j) + 1;
      const int32_t* tail = ints(self, p.nvl.tail(c, j, d));
      ok = warp_wait(p, d * D + j, [&] { return device::load_acquire_sys(tail) >= want; }, lane);
      if constexpr (kShrink)
        if (!ok && peer_gone(p, lane)) {
          ok = true;
          own &= ~(1u << j);
          own_columns &= ~(1u << j);
        }
    }
    for (uint32_t left = far; ok && left; left &= left - 1) {
      const int e = __ffs(left) - 1;
      const int want = __shfl_sync(~0u, partials, e) + 1;
      const int32_t* tail = ints(local, kShrink ? p.net.tail(c, e, __shfl_sync(~0u, part, e)) : p.net.tail(c, e));
      const int pe = e * D + (kShrink ? __shfl_sync(~0u, f, e) : n);
      ok = warp_wait(p, pe, [&] { return device::load_acquire_sys(tail) >= want; }, lane);
      if constexpr (kShrink)
        if (!ok && peer_gone(p, lane)) {
          ok = true;
          far &= ~(1u << e);
          if (lane == e) columns = 0;
        }
    }
    if (!ok) break;
    const int64_t out_row = static_cast<int64_t>(t) * a.hidden * 2;
    // Every lane reads every row's and partial's place (lanes that finish
    // early leave the loops below).
    s_rows[warp][lane] = rows_taken;
    // The slot of this lane's next partial (its domain's ring part).
    s_partials[warp][lane] = first_slot + partials % Q;
    __syncwarp();
    // The summands in the reference's order: this domain's rows (local rank
    // order) where its turn comes, every other domain's partial (domain order).
    int m = 0;
    for (int e = 0; e < N; ++e) {
      if (e == d) {
        for (uint32_t left = own; left; left &= left - 1) {
          const int j = __ffs(left) - 1;
          if (lane == 0) s_sum[warp][m] = at(self, p.nvl.slot(c, j, d, s_rows[warp][j] % Qs));
          ++m;
        }
      } else if (far >> e & 1) {
        if (lane == 0) s_sum[warp][m] = local + p.net.recv_slot(c, e, s_partials[warp][e]);
        ++m;
      }
    }
    const auto* bias0 = a.bias0 ? static_cast<const char*>(a.bias0) + out_row : nullptr;
    const auto* bias1 = a.bias1 ? static_cast<const char*>(a.bias1) + out_row : nullptr;
    __syncwarp();
    sum_rows<kWords>(s_sum[warp], m, bias0, bias1, static_cast<char*>(a.combined_x) + out_row, n16, lane);
    if (a.combined_topk_weights != nullptr)
      for (int q = lane; q < a.num_topk; q += 32) {
        float w = 0.0f;
        for (int e = 0; e < N; ++e) {
          if (e == d) {
            for (uint32_t left = own; left; left &= left - 1) {
              const int j = __ffs(left) - 1;
              const char* slot = at(self, p.nvl.slot(c, j, d, s_rows[warp][j] % Qs));
              w += __ldcg(reinterpret_cast<const float*>(slot + p.slot.weights) + q);
            }
          } else if (far >> e & 1) {
            const char* slot = local + p.net.recv_slot(c, e, s_partials[warp][e]);
            w += __ldcg(reinterpret_cast<const float*>(slot + p.slot.weights) + q);
          }
        }
        a.combined_topk_weights[static_cast<int64_t>(t) * a.num_topk + q] = w;
      }
    __syncwarp();
    if (lane < D && (own >> lane & 1)) {
      ++rows_taken;
      device::store_release_sys(ints(p.peers.buffers[lane], p.nvl.head(c, n, d)), rows_taken);
    }
    if (far >> lane & 1) {
      ++partials;
      if (partials - credited >= chunk) {
        net.add(lane * D + f, kShrink ? p.net.head(c, d, part) : p.net.head(c, d), partials - credited);
        credited = partials;
      }
    }
  }
  // kShrink: no credit to a forwarder gone (its columns read as none).
  if (ok && lane < N && lane != d && partials > credited && (!kShrink || columns != 0))
    net.add(lane * D + f, kShrink ? p.net.head(c, d, part) : p.net.head(c, d), partials - credited);
  net.quiet();
}

}  // namespace combine_detail

// kMaxThreads: the block's size bound. Groups of up to 16 domains (blocks of
// at most 512 threads) get 128 registers a thread, room for four words in
// flight per summand; a 1024-thread block's 64 hold two.
// kShrink: shrink mode (the handle carries a live set, [10]); without it the
// code is that of a build without shrink mode.
template <NetTransport T, int kMaxThreads, bool kShrink>
__global__ void __launch_bounds__(kMaxThreads, 1) internode_combine_kernel(CombineParams p, T net) {
  using namespace combine_detail;
  constexpr int kWords = kMaxThreads <= 512 ? 4 : 2;
  if (device::wait_abandoned(p.ctx.errors)) return;
  const int D = p.peers.num_nvl_ranks, N = p.peers.num_ranks / D, d = p.peers.rank / D;
  // A failed dispatch's handle (handle [4] marked -1 on every rank): nothing moves.
  const int rows = kShrink ? N * Forwarders{p.args.handle.live, N, D}.num_parts(d, p.peers.rank % D) : N;
  if (p.args.handle.recv_rdma_rank_prefix_sum[rows - 1] < 0) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      device::record_error(p.ctx.errors, DeviceErrorCode::kBadHandle, p.ctx.rank, p.args.handle.num_recv, 0, 2, 0);
    return;
  }
  // Warp w runs role w % W of channel (blockIdx.x / 2) K + w / W.
  const int W = N > D ? N : D, K = channels_per_block(N, D);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, role = warp % W;
  const int c = blockIdx.x / 2 * K + warp / W;
  if (blockIdx.x % 2 == 0) {
    if (role < D) {
      if constexpr (kShrink)
        send_rows_shrink(p, c, role, lane);
      else
        send_rows(p, c, role, lane);
    }
  } else if (role == d) {
    reduce_final<kShrink, kWords>(p, net, c, lane);
  } else if (role < N) {
    reduce_for<kShrink, kWords>(p, net, c, role, lane);
  }
}

template <NetTransport T>
void launch_combine_on(const CombineParams& p, const T& net, cudaStream_t stream) {
  const int D = p.peers.num_nvl_ranks, N = p.peers.num_ranks / D, K = channels_per_block(N, D);
  const int blocks = 2 * (p.net.shape.num_channels / K), threads = 32 * K * (N > D ? N : D);
  const bool shrink = p.args.handle.live != nullptr;
  if (threads <= 512 && shrink)
    internode_combine_kernel<T, 512, true><<<blocks, threads, 0, stream>>>(p, net);
  else if (threads <= 512)
    internode_combine_kernel<T, 512, false><<<blocks, threads, 0, stream>>>(p, net);
  else if (shrink)
    internode_combine_kernel<T, 1024, true><<<blocks, threads, 0, stream>>>(p, net);
  else
    internode_combine_kernel<T, 1024, false><<<blocks, threads, 0, stream>>>(p, net);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace turnout::kernels::internode
