// Where internode ops keep things: the network region (NVSHMEM symmetric
// memory, num_rdma_bytes) and the NVL buffer (num_nvl_bytes). Every rank
// computes the same offsets from the same call, so a writer knows where to
// write in its peers' memory. Shared by the size hints, the host checks and
// the kernels (docs/INTERNODE.md "Buffers").
#pragma once

#include <cuda_runtime_api.h>  // __host__ __device__ for the C++ compiler too

#include <cstdint>

#include "kernels/intranode/region.hpp"
#include "runtime/align.hpp"

namespace turnout::kernels::internode {

// Bytes of the counts areas in front of the rings of either memory. Fixed, so
// that the size hints (which know no expert count) cover them; a call whose
// counts do not fit is refused by name.
inline constexpr int64_t kNetMetaBytes = 256 * 1024;
inline constexpr int64_t kNvlMetaBytes = 64 * 1024;
// The most domains: a warp lane per domain, domain masks in a uint32.
inline constexpr int kMaxDomains = 32;
// A dispatch channel's send block holds a warp per domain and one per local
// rank: N + D warps, at most a block's 32.
inline constexpr int kMaxBlockWarps = 32;

// Ints in front of each counts message: {num_tokens, num_worst_tokens, bad input, unused}.
inline constexpr int kInfoInts = 4;

// The shape every offset follows from.
struct Shape {
  int num_domains = 0;        // N
  int num_nvl_ranks = 0;      // D
  int num_channels = 0;       // C
  int num_local_experts = 0;  // L (0 without per-expert counts)
  int net_slots = 0;          // Q_net: num_max_rdma_chunked_recv_tokens
  int nvl_slots = 0;          // Q_nvl: num_max_nvl_chunked_recv_tokens
  int slot_bytes = 0;         // one token in a ring slot
  // Shrink mode across domains (docs/INTERNODE.md "Shrink across domains"):
  // a live rank may forward for up to D columns, so its network rings are
  // split into parts and its counters and counts messages are kept per
  // (domain, part). 1 without shrink mode: the layout of today, index for
  // index; D with it (the most parts a rank can have).
  int max_parts = 1;
};

// A block pair runs the warps of K channels side by side: a channel's
// stages are one warp each and a token waits for each of them in turn, so
// more channels keep more tokens in flight on the same SMs. K is as large as
// 32 warps a block allow (a dispatch channel has N + D warps), at most
// kMaxChannelsPerBlock; each channel gets 1/K of the config's ring slots, so
// the regions keep their size.
inline constexpr int kMaxChannelsPerBlock = 4;

__host__ __device__ inline int channels_per_block(int num_domains, int num_nvl_ranks) {
  const int k = kMaxBlockWarps / (num_domains + num_nvl_ranks);
  return k < 1 ? 1 : (k > kMaxChannelsPerBlock ? kMaxChannelsPerBlock : k);
}

// The shape of a call on num_sms SMs: num_sms / 2 block pairs of K channels,
// each channel with 1/K of the config's network (net_slots) and NVL
// (nvl_slots) ring slots.
inline Shape make_shape(int num_domains, int num_nvl_ranks, int num_sms, int net_slots, int nvl_slots,
                        int num_local_experts, int slot_bytes, bool shrink = false) {
  const int k = channels_per_block(num_domains, num_nvl_ranks);
  Shape s;
  s.num_domains = num_domains;
  s.num_nvl_ranks = num_nvl_ranks;
  s.num_channels = num_sms / 2 * k;
  s.num_local_experts = num_local_experts;
  s.net_slots = net_slots / k;
  s.nvl_slots = nvl_slots / k;
  s.slot_bytes = slot_bytes;
  s.max_parts = shrink ? num_nvl_ranks : 1;
  return s;
}

// Where the parts of a counts message start, in ints from its start.
struct MessageLayout {
  int per_rank, per_channel, per_expert, domain_channels;
  __host__ __device__ explicit MessageLayout(const Shape& s)
      : per_rank(kInfoInts),
        per_channel(kInfoInts + s.num_nvl_ranks),
        per_expert(kInfoInts + s.num_nvl_ranks + s.num_nvl_ranks * s.num_channels),
        domain_channels(kInfoInts + s.num_nvl_ranks + s.num_nvl_ranks * (s.num_channels + s.num_local_experts)) {}
};

// Where the parts of a relayed source entry start, in ints: info, its token
// count to me, its channel prefix to me [C], its counts per expert of mine [L].
inline constexpr int kSourceCount = kInfoInts;
inline constexpr int kSourceChannels = kInfoInts + 1;

// The network region. "[s]" arrays are written by the domain peer (s, my
// local index) through NVSHMEM; counters only grow, so nothing is zeroed
// between calls. With shrink mode (max_parts = D) the barrier and arrival
// counters have a word per global rank (every far rank meets every other, so
// that a rank that starts to forward for a masked column finds its new
// sources' counters in step), and messages, tails and heads a word per
// (domain, part): part p of a rank's rings serves the p-th column it forwards
// (Forwarders::part), in slots [p Q / P, (p + 1) Q / P) of the ring.
struct NetRegion {
  Shape shape;
  int64_t barrier = 0;         // uint32 [N] ([R] with shrink): barriers peer s (rank g) has reached
  int64_t counts_arrived = 0;  // uint32 [N] ([R] with shrink): counts messages of peer s (rank g) landed
  int64_t epoch = 0;           // uint32: this rank's own completed counts steps
  int64_t counts = 0;          // [N][P] messages of message_bytes: what source (s, part p) sends my domain
  int64_t outbox = 0;          // [N] messages: what I put to domain e (registered memory a put reads)
  int64_t message_bytes = 0;
  int64_t tails = 0;        // int32 [C][N][P]: tokens source (s, p) has put into my ring (c, s) part p
  int64_t heads = 0;        // int32 [C][N][P]: tokens domain e's forwarder has drained of what I put there
  int64_t recv_rings = 0;   // [C][N][Q_net] slots: ring (c, s) is written by peer s
  int64_t stage_rings = 0;  // [C][N][Q_net] slots: what I put to domain e, at the slot it lands in
  int64_t total = 0;

  // A counts message from a domain peer about my domain: info, then per
  // local rank j of my domain its token count, then per (j, c) the prefix
  // over channels of its tokens to j, per expert of my domain its count, and
  // per channel the prefix of its tokens reaching my domain (entry [1]'s row).
  __host__ __device__ static int64_t message_size(const Shape& s) {
    const int64_t ints = kInfoInts + s.num_nvl_ranks + int64_t(s.num_nvl_ranks) * s.num_channels +
                         int64_t(s.num_nvl_ranks) * s.num_local_experts + s.num_channels;
    return align_up(ints * 4, 16);
  }
  // Without shrink mode (max_parts 1): a message, tail and head per domain.
  __host__ __device__ int64_t message(int source_domain) const { return counts + source_domain * message_bytes; }
  __host__ __device__ int64_t tail(int channel, int domain) const {
    return tails + (int64_t(channel) * shape.num_domains + domain) * 4;
  }
  __host__ __device__ int64_t head(int channel, int domain) const {
    return heads + (int64_t(channel) * shape.num_domains + domain) * 4;
  }
  // Shrink mode: per (domain, part).
  __host__ __device__ int64_t message(int source_domain, int part) const {
    return counts + (int64_t(source_domain) * shape.max_parts + part) * message_bytes;
  }
  __host__ __device__ int64_t tail(int channel, int domain, int part) const {
    return tails + ((int64_t(channel) * shape.num_domains + domain) * shape.max_parts + part) * 4;
  }
  __host__ __device__ int64_t head(int channel, int domain, int part) const {
    return heads + ((int64_t(channel) * shape.num_domains + domain) * shape.max_parts + part) * 4;
  }
  __host__ __device__ int64_t outgoing(int domain) const { return outbox + domain * message_bytes; }
  __host__ __device__ int64_t recv_slot(int channel, int domain, int slot) const {
    return recv_rings + ((int64_t(channel) * shape.num_domains + domain) * shape.net_slots + slot) * shape.slot_bytes;
  }
  __host__ __device__ int64_t stage_slot(int channel, int domain, int slot) const {
    return stage_rings + ((int64_t(channel) * shape.num_domains + domain) * shape.net_slots + slot) * shape.slot_bytes;
  }
  // Counter words of the barrier and arrival arrays, and their count.
  __host__ __device__ int counter_words() const {
    return shape.max_parts == 1 ? shape.num_domains : shape.num_domains * shape.num_nvl_ranks;
  }
  // Shrink mode: what a fresh dispatch's ranks agree on who takes part with
  // (kernels/internode/live_set.hpp), in the last bytes of the counts area
  // (before kNetMetaBytes), at offsets of N and D only. view_epoch and viewed
  // are counters that only grow, so, like barrier, counts_arrived and epoch,
  // they must stay in place whatever a call's channel or expert count (which
  // move every offset from the tails on: a later call of another shape would
  // find them on its counts or outbox); and at D = 1 shrink mode's layout is
  // the plain one (max_parts 1), so they cannot hang on max_parts. Unused
  // without shrink mode: no offset moves; the host refuses a shrink-mode call
  // whose counts reach them (check.cpp). Computed from the shape, so the
  // struct keeps its size.
  __host__ __device__ int view_words() const { return (shape.num_domains * shape.num_nvl_ranks + 31) / 32; }
  __host__ __device__ int64_t views_bytes() const {
    const int64_t R = int64_t(shape.num_domains) * shape.num_nvl_ranks;
    return 128 + align_up(R * 4, 128) + align_up(R * view_words() * 4, 128) + align_up(int64_t(view_words()) * 4, 128);
  }
  // uint32: the agreements this rank has completed (their rounds).
  __host__ __device__ int64_t view_epoch() const { return kNetMetaBytes - views_bytes(); }
  // uint32 [R]: views rank g has sent me (a counter per rank, only grows).
  __host__ __device__ int64_t viewed() const { return view_epoch() + 128; }
  // uint32 [R][view_words]: rank g's view of this call (a bit per rank).
  __host__ __device__ int64_t view(int rank) const {
    const int64_t first = viewed() + align_up(int64_t(shape.num_domains) * shape.num_nvl_ranks * 4, 128);
    return first + int64_t(rank) * view_words() * 4;
  }
  // uint32 [view_words]: this rank's view, where a put reads it.
  __host__ __device__ int64_t view_out() const {
    return view(0) + align_up(int64_t(shape.num_domains) * shape.num_nvl_ranks * view_words() * 4, 128);
  }
  __host__ __device__ int64_t views_end() const { return view_out() + (int64_t(view_words()) * 4 + 127) / 128 * 128; }
};

// Part p of P of a ring of Q slots: its first slot and its slots. A part is
// never empty: the host refuses a ring of fewer slots than parts.
__host__ __device__ inline int part_first_slot(int ring_slots, int num_parts, int part) {
  return ring_slots / num_parts * part;
}
__host__ __device__ inline int part_slots(int ring_slots, int num_parts) {
  return ring_slots / num_parts;
}

inline NetRegion make_net_region(const Shape& s) {
  NetRegion r;
  r.shape = s;
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t start = at;
    at = align_up(at + bytes, 128);
    return start;
  };
  const int64_t N = s.num_domains, C = s.num_channels;
  const int64_t P = s.max_parts, words = P == 1 ? N : N * s.num_nvl_ranks;
  r.barrier = take(words * 4);
  r.counts_arrived = take(words * 4);
  r.epoch = take(4);
  r.tails = take(C * N * P * 4);
  r.heads = take(C * N * P * 4);
  r.message_bytes = NetRegion::message_size(s);
  // Last, so no other offset depends on the expert count.
  r.counts = take(N * P * r.message_bytes);
  r.outbox = take(N * r.message_bytes);
  r.recv_rings = at > kNetMetaBytes ? at : kNetMetaBytes;
  const int64_t ring_bytes = C * N * s.net_slots * int64_t(s.slot_bytes);
  r.stage_rings = r.recv_rings + ring_bytes;
  r.total = r.stage_rings + ring_bytes;
  return r;
}

// The NVL buffer of an internode call. "[s, n]" rows are written by the
// forwarder of my domain that received them from source (s, n).
struct NvlRegion {
  Shape shape;
  int64_t barrier = 0;  // uint32 [D]: NVL barriers local rank j has reached
  int64_t epoch = 0;    // uint32: this rank's own completed NVL barriers
  int64_t status = 0;   // int32: nonzero = the data kernels skip this call (bad input somewhere)
  // int64 {claimed, token * K + slot, id}: this rank's first bad expert id,
  // left by the counting blocks for the exchange, which clears it.
  int64_t input_error = 0;
  int64_t sources = 0;  // int32 [R][source_ints]: what source rank g sends me (relayed by its forwarder)
  int64_t source_ints = 0;
  int64_t relayed = 0;  // uint32 [D]: calls whose counts forwarder n has relayed to me
  // Each ring (c, n) is split per source domain s into sub-rings of
  // Q_nvl / N slots (c, n, s), each with one writer and one reader, so that a
  // stalled source domain stalls no other. Dispatch: forwarder n writes
  // sub-ring (c, n, s) of local rank j; combine: local rank n writes it at
  // forwarder j.
  int64_t tails = 0;  // int32 [C][D][N]: tokens peer n has written into my sub-ring (c, n, s)
  int64_t heads = 0;  // int32 [C][D][N]: tokens peer j has drained of my writes to its sub-ring (c, ., s)
  int64_t rings = 0;  // [C][D][N][Q_nvl / N] slots
  int64_t total = 0;

  // Per source rank: info, its token count to me, its channel prefix to me [C], its counts per expert of mine [L].
  __host__ __device__ static int64_t source_size(const Shape& s) {
    return kInfoInts + 1 + s.num_channels + s.num_local_experts;
  }
  __host__ __device__ int64_t source(int rank) const { return sources + rank * source_ints * 4; }
  __host__ __device__ int sub_slots() const { return shape.nvl_slots / shape.num_domains; }
  __host__ __device__ int64_t sub_ring(int channel, int peer, int domain) const {
    return (int64_t(channel) * shape.num_nvl_ranks + peer) * shape.num_domains + domain;
  }
  __host__ __device__ int64_t tail(int channel, int peer, int domain) const {
    return tails + sub_ring(channel, peer, domain) * 4;
  }
  __host__ __device__ int64_t head(int channel, int peer, int domain) const {
    return heads + sub_ring(channel, peer, domain) * 4;
  }
  __host__ __device__ int64_t slot(int channel, int peer, int domain, int index) const {
    return rings + (sub_ring(channel, peer, domain) * sub_slots() + index) * shape.slot_bytes;
  }
};

inline NvlRegion make_nvl_region(const Shape& s) {
  NvlRegion r;
  r.shape = s;
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t start = at;
    at = align_up(at + bytes, 128);
    return start;
  };
  const int64_t D = s.num_nvl_ranks, C = s.num_channels, R = int64_t(s.num_domains) * s.num_nvl_ranks;
  r.barrier = take(D * 4);
  r.epoch = take(4);
  r.status = take(4);
  r.input_error = take(3 * 8);
  r.relayed = take(D * 4);
  r.tails = take(C * D * s.num_domains * 4);
  r.heads = take(C * D * s.num_domains * 4);
  r.source_ints = NvlRegion::source_size(s);
  r.sources = take(R * r.source_ints * 4);
  r.rings = at > kNvlMetaBytes ? at : kNvlMetaBytes;
  r.total = r.rings + C * D * s.num_domains * int64_t(s.nvl_slots / s.num_domains) * s.slot_bytes;
  return r;
}

// One token in a ring slot, network or NVL: intranode's dispatch slot (row,
// scales, top-k ids as int32, weights, then 16 bytes of source meta: source
// token, bits of the destination domain's local ranks, source domain).
// Combine's slot (bf16 row and weights) is never larger than a BF16 dispatch's.
inline DispatchSlot make_token_slot(int row_bytes, int num_scales, int num_topk) {
  return make_dispatch_slot(row_bytes, num_scales, num_topk);
}

}  // namespace turnout::kernels::internode
