// Where low-latency mode keeps things in each rank's low-latency region (the
// num_rdma_bytes part of its peer allocation), and the plan a dispatch leaves
// for its combine. Shared by the host launchers and the kernels: every rank
// computes the same offsets from the same call.
//
// Calls are told apart by sequence numbers, not by zeroing: each phase
// (dispatch send / receive, combine send / receive) counts its own calls in
// LocalState, and a call with number n uses the areas of parity n & 1. So a
// graph replay, which cannot take a new number from the host, still gets one.
// The numbers are 64-bit and never wrap; what a call writes for others to
// match (bad-call words, message headers, tagged weights and chunk counts)
// carries its 32-bit tag (call_tag), which is never 0, so memory that no call
// has written matches no call. The tagged 8-byte words carry it mixed
// (word_tag): a call of another shape lays its areas elsewhere, so what it
// left where this call's words lie must not pass for them.
//
// A sending block signals each destination on its own: once its stores are
// out it adds to that destination's arrival counter for it (a release), and
// every call adds exactly kArrivalsPerCall over all of a rank's blocks. So a
// receiver knows a source is complete when the counter of the call's parity
// reaches its number of calls of that parity times kArrivalsPerCall: no block
// of the sender waits for another or closes the call for it.
#pragma once

#include <cuda_runtime_api.h>  // __host__ __device__ for the C++ compiler too

#include <cstdint>

#include "runtime/align.hpp"
#include "turnout/low_latency.hpp"
#include "turnout/topology.hpp"

namespace turnout::kernels::low_latency {

// The ranks of a low-latency group, in one NVL domain or across several: at
// most one per expert.
inline constexpr int kMaxGroupRanks = kLowLatencyMaxExperts;
// Groups up to this size publish combine weights to every rank (stores over
// NVLink are cheap); larger ones only to the ranks holding the token's experts.
inline constexpr int kPublishToAllRanks = kMaxNvlRanks;
inline constexpr int kMaxLocalExperts = kLowLatencyMaxExperts;  // one rank may hold them all
inline constexpr int kScaleGroup = kLowLatencyScaleGroup;

// More than any grid has blocks: block 0 adds the rest of it.
inline constexpr uint32_t kArrivalsPerCall = 1u << 12;

// What a source's counter of call n's parity reads once call n of it has
// fully arrived (mod 2^32: a parity's calls times kArrivalsPerCall).
__host__ __device__ constexpr uint32_t arrivals_after(uint64_t n) {
  return static_cast<uint32_t>(((n + 1) >> 1) * kArrivalsPerCall);
}

// Call n's tag: 1, 2, ..., 2^32 - 1, then 1 again. Never 0 (zeroed memory);
// calls 2^32 - 1 apart share a tag but not a parity, so not the areas that
// hold it (calls 2 (2^32 - 1) apart share both: a slot left unwritten that
// long could read as current, as one 2^32 calls old could with 32-bit
// numbers). (n - 1) mod (2^32 - 1) by folding the halves (2^32 is 1 there),
// not by a 64-bit division.
__host__ __device__ constexpr uint32_t call_tag(uint64_t n) {
  constexpr uint64_t kLow = 0xffffffffull;
  const uint64_t x = n - 1;
  uint64_t r = (x >> 32) + (x & kLow);  // below 2^33
  r = (r >> 32) + (r & kLow);           // at most 2^32
  return static_cast<uint32_t>(1 + (r >= kLow ? r - kLow : r));
}

// A source's arrival counter of `parity` once its calls 1..last have run.
__host__ __device__ constexpr uint32_t arrivals_through(uint64_t last, int parity) {
  if (last == 0) return 0;
  return arrivals_after((last & 1) == static_cast<uint64_t>(parity) ? last : last - 1);
}

// The tag of a tagged 8-byte word (a published combine weight, a staged
// row's chunk count) of the call with tag `seq`: the tag times an odd
// constant, a bijection that keeps 0 at 0 (only 0). Plain tags are small
// while a buffer is young, and so are numbers a call of another shape leaves
// where this call's words now lie: a dispatch header's second word is its
// token index, and read as a weight's tag it matched the combine call of that
// number. Mixed, the first 65,535 tags are all at least 2^16, above any token
// index, count or entry number.
__host__ __device__ constexpr uint32_t word_tag(uint32_t seq) {
  return seq * 0x9e3779b1u;
}
// The call tag a word tag stands for (0x0e8b2f51 is 0x9e3779b1's inverse mod
// 2^32): readers unmix what they load rather than keep the mixed tag live.
__host__ __device__ constexpr uint32_t tag_of_word(uint32_t word_tag) {
  return word_tag * 0x0e8b2f51u;
}
static_assert(tag_of_word(word_tag(12345)) == 12345 && tag_of_word(word_tag(0xffffffffu)) == 0xffffffffu);

// A shrink-mode verdict word (device/rank_mask.cuh: 31 bits of the tag, then
// whether the peer counted) as call `last` left it, the peer counted.
__host__ __device__ constexpr uint32_t verdict_after(uint64_t last) {
  return (call_tag(last) & 0x7fffffffu) << 1 | 1u;
}

// One phase's call counter, and the blocks of its current call that have
// finished (where a launch runs one phase): the last one stores seq (the
// call's number) and zeroes `done`.
struct CallCounter {
  uint64_t seq;
  uint32_t done;
  uint32_t pad;
};
static_assert(sizeof(CallCounter) == 16);

// This rank's own; peers never touch it.
struct LocalState {
  CallCounter dispatch_send;
  CallCounter dispatch_recv;
  CallCounter combine_send;
  CallCounter combine_recv;
  // Combine send on a shared GPU: the first block of a call to take it publishes the weights.
  uint32_t weights_claim;
  uint32_t pad[3];
  // Shrink mode: per peer, whether the last call that judged it counted it
  // (call * 2 + counted), so that every block of a call agrees.
  uint32_t dispatch_verdict[kMaxGroupRanks];
  uint32_t combine_verdict[kMaxGroupRanks];
};

// Slot [parity][s] of a destination, written by source rank s.
struct DispatchSignal {
  uint32_t arrivals;   // kArrivalsPerCall per call over s's blocks (release)
  int32_t num_tokens;  // T of rank s (its block 0)
  uint32_t bad_call;   // the number of a call of s that had a bad expert id: no destination places anything
  // Rank s gave weights to dispatch (or had no tokens): combine takes the
  // dispatch's weights only if every rank says so, so all ranks agree.
  int32_t has_weights;
};

// Tokens source s sends to each of the destination's experts in call n, added
// by s as it sends, in set n & 3 ([set][s * L + local expert]; L experts a
// rank, R * L = E of the call). The receive of
// call n zeroes set (n + 2) & 3 whole, which call n - 2 used and call n + 2
// will: no block waits for the others to have read its counts.
inline constexpr int kCountSets = 4;

// Which of source s's tokens name each local expert, in sets like the counts:
// bit t % 32 of word [set][(s * L + l) * W + t / 32] (W = token_words(M)),
// set by s as it sends. The receive places token t's row for local expert l at
// the pair's first row plus the bits below t: no scan of the messages. Sized
// for any call (R * L <= kLowLatencyMaxExperts, M <= kLowLatencyMaxTokens),
// so that the receive of call n zeroes set (n + 2) & 3 whole, as the counts.
__host__ __device__ constexpr int token_words(int num_max_tokens) {
  return (num_max_tokens + 31) / 32;
}
inline constexpr int kTokenBitsWords = kLowLatencyMaxExperts * token_words(kLowLatencyMaxTokens);

// Slot [parity][d] of a source rank, written by expert rank d.
struct CombineSignal {
  uint32_t arrivals;
  uint32_t bad_call;  // the number of a call of d whose plan was unusable: no source writes its output
  int32_t pad[2];
};

struct FixedArea {
  LocalState local;
  DispatchSignal dispatch[2][kMaxGroupRanks];
  CombineSignal combine[2][kMaxGroupRanks];
  int32_t counts[kCountSets][kLowLatencyMaxExperts];
  uint32_t token_bits[kCountSets][kTokenBitsWords];
};

inline constexpr int64_t kFixedBytes = align_up(sizeof(FixedArea), 4096);

// The head of a dispatch message: one per (token, destination rank), in slot
// [parity][source][token] of the destination. Valid for a call only if `seq`
// is its sequence number and `token` the slot's token (a slot a call does
// not use keeps an older message).
struct MessageHeader {
  uint32_t seq;
  int32_t token;
  int32_t num_entries;  // distinct experts of the token on the destination, in top-k order
  int32_t pad;
  int16_t local_expert[kLowLatencyMaxTopk];
  uint16_t slots[kLowLatencyMaxTopk];  // the top-k slots naming that expert (bit k: slot k)
  float weight[kLowLatencyMaxTopk];    // with dispatch weights: the sum over those slots
};
static_assert(sizeof(MessageHeader) == 144);

// The payload follows the header at the slot's next 128-byte line: the bf16
// row (2 * hidden bytes), or the e4m3 row (hidden bytes) then hidden / 128
// float scales. Its slot is sized for bf16 and whole lines, so that every
// payload starts on a line and a warp's 512 contiguous bytes of it are four
// whole lines on the wire, not five pieces.
inline constexpr int64_t kPayloadOffset = align_up(int64_t(sizeof(MessageHeader)), 128);
__host__ __device__ constexpr int64_t message_bytes(int hidden) {
  return align_up(kPayloadOffset + int64_t(hidden) * 2, 128);
}

// A combine row on the wire: one per (token, expert rank), the expert rank's
// weighted sum of its rows of the token. bf16, or (use_logfmt) the LogFMT
// groups; either way followed by room for one 4-byte word per 128 channels.
// Slots are whole 128-byte lines, as the dispatch's.
__host__ __device__ constexpr int64_t combine_meta_offset(int hidden) {
  return align_up(int64_t(hidden) * 2, 16);
}
__host__ __device__ constexpr int64_t combine_row_bytes(int hidden) {
  return align_up(combine_meta_offset(hidden) + 4 * ((int64_t(hidden) + kScaleGroup - 1) / kScaleGroup), 128);
}

// A source's combine weights for one token, as an expert rank reads them: per
// top-k slot the weight (0 where combine's topk_idx names no expert) and the
// number of the call that wrote it, in one 8-byte word, so that a reader
// that sees the number sees the weight (no flag, no fence).
struct TaggedWeight {
  float weight;
  uint32_t seq;
};
static_assert(sizeof(TaggedWeight) == 8);

// The staging areas hold what this rank sends to peers out of load/store
// reach (other NVL domains), so that a network put has its source in
// registered memory; a group within one domain never touches them. Sized
// anyway, so that one size hint fits any group. Reused every other call of
// their phase, like the areas that receive: by then the peer has received
// the call before (the protocol's double buffering), so its puts are done.
struct Region {
  int num_max_tokens = 0;  // M
  int hidden = 0;
  int num_ranks = 0;
  int num_topk = 0;
  int64_t message = 0;             // bytes of one dispatch slot
  int64_t combine_row = 0;         // bytes of one combine slot
  int64_t dispatch_data[2] = {};   // [R][M] message slots, [s][t] written by rank s
  int64_t combine_data[2] = {};    // [M][R] rows, [t][d] written by expert rank d
  int64_t weights[2] = {};         // [R][M][kLowLatencyMaxTopk] TaggedWeight, [s][t] written by rank s
  int64_t dispatch_stage[2] = {};  // [M] message slots: token t's payload, once for every far destination
  int64_t header_stage[2] = {};    // [M][kLowLatencyMaxTopk] MessageHeader: token t's header for its i-th destination
  int64_t combine_stage[2] = {};   // [R][M] rows: the row for token t of far source s
  int64_t combine_chunks[2] = {};  // [R][M] uint64: call number << 32 | chunks of that row staged
  int64_t total = 0;

  __host__ __device__ int64_t dispatch_slot(int parity, int source, int token) const {
    return dispatch_data[parity] + (int64_t(source) * num_max_tokens + token) * message;
  }
  __host__ __device__ int64_t combine_slot(int parity, int token, int expert_rank) const {
    return combine_data[parity] + (int64_t(token) * num_ranks + expert_rank) * combine_row;
  }
  __host__ __device__ int64_t weights_slot(int parity, int source, int token) const {
    return weights[parity] +
           (int64_t(source) * num_max_tokens + token) * kLowLatencyMaxTopk * int64_t(sizeof(TaggedWeight));
  }
  __host__ __device__ int64_t dispatch_stage_slot(int parity, int token) const {
    return dispatch_stage[parity] + int64_t(token) * message;
  }
  __host__ __device__ int64_t header_stage_slot(int parity, int token, int index) const {
    return header_stage[parity] + (int64_t(token) * kLowLatencyMaxTopk + index) * int64_t(sizeof(MessageHeader));
  }
  __host__ __device__ int64_t combine_stage_slot(int parity, int source, int token) const {
    return combine_stage[parity] + (int64_t(source) * num_max_tokens + token) * combine_row;
  }
  __host__ __device__ int64_t combine_chunks_slot(int parity, int source, int token) const {
    return combine_chunks[parity] + (int64_t(source) * num_max_tokens + token) * int64_t(sizeof(uint64_t));
  }
};

__host__ __device__ inline Region make_region(int num_max_tokens, int hidden, int num_ranks, int num_topk) {
  Region r;
  r.num_max_tokens = num_max_tokens;
  r.hidden = hidden;
  r.num_ranks = num_ranks;
  r.num_topk = num_topk;
  r.message = message_bytes(hidden);
  r.combine_row = combine_row_bytes(hidden);
  const int64_t M = num_max_tokens, R = num_ranks;
  int64_t at = kFixedBytes;
  auto take = [&](int64_t bytes) {
    const int64_t start = at;
    at = align_up(at + bytes, 128);
    return start;
  };
  for (int p = 0; p < 2; ++p) r.dispatch_data[p] = take(R * M * r.message);
  for (int p = 0; p < 2; ++p) r.combine_data[p] = take(M * R * r.combine_row);
  for (int p = 0; p < 2; ++p) r.weights[p] = take(R * M * kLowLatencyMaxTopk * int64_t(sizeof(TaggedWeight)));
  for (int p = 0; p < 2; ++p) r.dispatch_stage[p] = take(M * r.message);
  for (int p = 0; p < 2; ++p) r.header_stage[p] = take(M * kLowLatencyMaxTopk * int64_t(sizeof(MessageHeader)));
  for (int p = 0; p < 2; ++p) r.combine_stage[p] = take(R * M * r.combine_row);
  for (int p = 0; p < 2; ++p) r.combine_chunks[p] = take(R * M * int64_t(sizeof(uint64_t)));
  r.total = at;
  return r;
}

// What a dispatch's receive leaves for its combine (caller memory). Rows are
// numbered l * M*R + row.
struct PlanHeader {
  int32_t num_tokens;  // T of this rank's dispatch
  int32_t num_topk;
  int32_t has_weights;  // every rank's dispatch had weights (or no tokens): combine takes those, not its own
  int32_t num_max_tokens;
  int32_t hidden;
  int32_t num_experts;
  int32_t num_ranks;
  int32_t failed;  // the dispatch had a bad input somewhere: its combine moves nothing
};

struct Plan {
  int num_max_tokens = 0;
  int num_ranks = 0;
  int num_local_experts = 0;
  int64_t header = 0;         // PlanHeader
  int64_t recv_count = 0;     // int32 [L]
  int64_t source_tokens = 0;  // int32 [R]: T of each source rank
  int64_t token_entries = 0;  // int32 [R][M]: rows received for (s, t); 0 = none
  int64_t token_rows = 0;     // int32 [R][M][kLowLatencyMaxTopk]: their row numbers (l * M*R + row), in top-k order
  int64_t token_slots = 0;    // uint16 [R][M][kLowLatencyMaxTopk]: the top-k slots of each (bit k: slot k)
  int64_t token_weights = 0;  // float [R][M][kLowLatencyMaxTopk]: their weights (with dispatch weights)
  int64_t total = 0;
};

__host__ __device__ inline Plan make_plan(int num_max_tokens, int num_ranks, int num_experts) {
  Plan p;
  p.num_max_tokens = num_max_tokens;
  p.num_ranks = num_ranks;
  p.num_local_experts = num_experts / num_ranks;
  const int64_t M = num_max_tokens, R = num_ranks, L = p.num_local_experts;
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t start = at;
    at = align_up(at + bytes, 128);
    return start;
  };
  p.header = take(sizeof(PlanHeader));
  p.recv_count = take(L * 4);
  p.source_tokens = take(R * 4);
  p.token_entries = take(R * M * 4);
  p.token_rows = take(R * M * kLowLatencyMaxTopk * 4);
  p.token_slots = take(R * M * kLowLatencyMaxTopk * 2);
  p.token_weights = take(R * M * kLowLatencyMaxTopk * 4);
  p.total = at;
  return p;
}

}  // namespace turnout::kernels::low_latency
