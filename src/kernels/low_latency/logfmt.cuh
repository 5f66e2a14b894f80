// The compact wire format of low-latency combine (use_logfmt): LogFMT-10.
//
// A row of hidden H (a multiple of 128) is G = H / 128 groups of 128
// channels. Values are bf16 (the sender rounds others to bf16 first), so a
// group's amax (largest magnitude) and amin (smallest NONZERO magnitude) are
// exact in bf16. A group with amax < 1 is cast: each value crosses as 10
// bits, a sign and a 9-bit code; code 0 is zero, codes 1..511 are levels
// evenly spaced in log2,
//   level(c) = a' 2^((c - 1) s),  a' = max(amin, amax / 2^32),
//   s = log2(amax / a') / 510       (level 1 = a', level 511 = amax),
// and a value takes the level nearest to it (linear distance, ties to the
// lower), nearest among the levels the decoder computes. Any other group
// (amax >= 1, inf or NaN) crosses as its bf16 values.
//
// Row, logfmt_row_bytes(H) = align_up(2H + 4G, 16) bytes (its slot may be longer):
//   group g's data at byte 256 g: cast, 160 bytes (lane i of its 8 lanes at
//   20 i, 16 fields as logfmt_pack16 lays them); bf16, 256 bytes (lane i at
//   32 i, its 16 values);
//   meta word g at logfmt_meta_offset(H) + 4 g: bf16 amax | bf16 amin << 16;
//   the receiver casts back iff that amax is below 1.
// Bytes on the wire: 164 per cast group, 260 per bf16 group. DeepEP's
// LogFMT has the same bytes per group but casts only whole chunks of 1024
// channels (512 where H % 1024 != 0) whose every group has amax < 1 and an
// amin, zeros included, below amax. Our cast groups are a superset of its
// cast groups, so a row never takes more bytes than with DeepEP's.
//
// Error per value v (the bf16 value that crossed), d its decoding:
//   bf16 groups, zeros (sign kept), groups of one magnitude:  d = v;
//   cast group, |v| >= a':  |d - v| <= |v| ((2^s - 1) / 2 + 2^-18);
//   cast group, |v| < a' (only where amin < amax / 2^32):
//                           |d - v| <= min(|v|, a' - |v|) <= min(|v|, a' / 2);
// each + 2^-150 where |d| < 2^-126 (the last scaling rounds to a subnormal).
// DeepEP's cast groups are at least as coarse (its amin counts zeros, and a
// zero stretches its range to the full 32 octaves), so where both cast,
// this bound is at most DeepEP's: at most ((2^(32/510) - 1) / 2 + 2^-18) |v|
// < 2.3% of |v| above a'.
//
// Proof. Both sides work in a domain scaled by 2^k, amax 2^k in [1, 2) (in
// [2^-7, 1) for a subnormal amax): exact, and every quantity is a normal
// float. There level 1 is a', level 511 is amax, and level c in 2..510 is
//   D(c) = fl(a' exp2f(fl((c - 1) s^))),  s^ = fl(log2f(fl(amax / a')) / 510).
// With log2f within 1 ulp, exp2f within 2 ulp (CUDA's documented bounds;
// the host's libm, which the CPU tests use, is within 1) and correctly
// rounded * and /: |s^ - s| <= 2^-26.3; D(c) = a' 2^((c - 1) s^ + e_c) with
// |e_c| <= 2^-20 (the argument) + 2^-21.1 (exp2f and the product) <= 2^-19.4
// for c <= 510 and |e_511| = |log2(amax / a') - 510 s^| <= 2^-17.3. So
// neighbouring levels are at most a factor 2^(s + 2^-17) apart. The encoder
// brackets m = |v| 2^k between neighbours D(c) <= m <= D(c + 1) (D(0) = 0)
// and takes the nearer (the distances are exact: Sterbenz), so for c >= 1
//   |d - v| <= (D(c + 1) - D(c)) / 2 <= m (2^(s + 2^-17) - 1) / 2
//           <= m ((2^s - 1) / 2 + 2^-18)              (s <= 32 / 510),
// and for c = 0 (m < a') it is min(m, a' - m). Scaling back by 2^-k is
// exact unless the result is subnormal.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/device/vector_copy.cuh"
#include "kernels/low_latency/logfmt_codec.hpp"

namespace turnout::kernels::low_latency {

// Channels one warp handles per call: 16 per lane, four groups.
inline constexpr int kLogfmtChunk = 512;

__device__ __forceinline__ int logfmt_lane() {
  int lane;
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// Sender. All 32 lanes of a warp call it together for one 512-channel chunk
// of a row: lane l holds channels 512 chunk + 16 l .. + 15, so lanes
// 8q..8q+7 hold group 4 chunk + q; `in_row` is false for lanes past the
// row's end (whole groups). `dst` is the row's slot, possibly a peer's memory:
// only 16-byte stores of contiguous words reach it (and 4-byte meta stores in
// a last, partial chunk), staged through `smem`, 1024 bytes of this warp's
// own, 16-byte aligned, free again on return. Returns the bytes this chunk
// put on the wire (data and meta), the same on every lane.
__device__ inline int put_logfmt_chunk(char* dst, int hidden, int chunk, const float (&v)[16], bool in_row,
                                       char* smem) {
  const int lane = logfmt_lane(), q = lane / 8, i = lane % 8;
  // The values as bf16, two a word (the first in the low half).
  uint32_t pair[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * j], v[2 * j + 1]);
    pair[j] = *reinterpret_cast<const uint32_t*>(&h);
  }
  // Magnitude bits order like magnitudes (NaN above inf above the rest), so
  // amax and amin are integer max / min, both halves at once; a zero half
  // counts as 0xFFFF for amin.
  uint32_t hi = 0, lo = ~0u;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t m = pair[j] & 0x7FFF7FFFu;
    hi = __vmaxu2(hi, m);
    lo = __vminu2(lo, m | __vcmpeq2(m, 0));
  }
  uint32_t amax = max(hi & 0xFFFFu, hi >> 16), amin = min(lo & 0xFFFFu, lo >> 16);
  if (!in_row) {
    amax = 0;
    amin = 0xFFFFu;
  }
  // Over the group's 8 lanes: max of amax and of 0xFFFF - amin, in one word.
  uint32_t both = amax | (0xFFFFu - amin) << 16;
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) both = __vmaxu2(both, __shfl_xor_sync(~0u, both, o));
  amax = both & 0xFFFFu;
  amin = 0xFFFFu - (both >> 16);
  const uint32_t meta = logfmt_meta(amax, amin == 0xFFFFu ? 0u : amin);
  const bool cast = logfmt_is_cast(meta);

  char* group_smem = smem + kLogfmtBf16Bytes * q;
  __syncwarp();
  if (in_row && cast) {
    const LogfmtGroup g = logfmt_group(meta);
    uint32_t field[16], w[5];
#pragma unroll
    for (int j = 0; j < 16; ++j) field[j] = logfmt_encode(g, pair[j / 2] >> (16 * (j % 2)) & 0xFFFFu);
    logfmt_pack16(field, w);
    auto* s = reinterpret_cast<uint32_t*>(group_smem + 20 * i);
#pragma unroll
    for (int k = 0; k < 5; ++k) s[k] = w[k];
  } else if (in_row) {
    auto* s = reinterpret_cast<uint4*>(group_smem + 32 * i);
    s[0] = make_uint4(pair[0], pair[1], pair[2], pair[3]);
    s[1] = make_uint4(pair[4], pair[5], pair[6], pair[7]);
  }
  __syncwarp();

  // Bit 8q: group q is in the row / is cast.
  const uint32_t in_groups = __ballot_sync(~0u, in_row && i == 0);
  const uint32_t cast_groups = __ballot_sync(~0u, in_row && i == 0 && cast);
  char* data = dst + static_cast<int64_t>(kLogfmtChunk) * 2 * chunk;
  // Word j of group gq (16 bytes each, 10 of a cast group, 16 of a bf16 one).
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int word = lane + 32 * u, gq = word / 16, j = word % 16;
    const bool has = (in_groups >> (8 * gq) & 1u) != 0;
    const int words = (cast_groups >> (8 * gq) & 1u) != 0 ? kLogfmtCastBytes / 16 : kLogfmtBf16Bytes / 16;
    if (has && j < words) {
      const int offset = kLogfmtBf16Bytes * gq + 16 * j;
      device::store_16(data + offset, *reinterpret_cast<const int4*>(smem + offset));
    }
  }
  const int groups = __popc(in_groups);
  char* meta_dst = dst + logfmt_meta_offset(hidden) + 16 * static_cast<int64_t>(chunk);
  const uint32_t m1 = __shfl_sync(~0u, meta, 8), m2 = __shfl_sync(~0u, meta, 16), m3 = __shfl_sync(~0u, meta, 24);
  if (groups == 4) {
    if (lane == 0)
      device::store_16(meta_dst, make_int4(static_cast<int>(meta), static_cast<int>(m1), static_cast<int>(m2),
                                           static_cast<int>(m3)));
  } else if (in_row && i == 0) {
    __stcg(reinterpret_cast<unsigned int*>(meta_dst) + q, meta);
  }
  __syncwarp();
  const int cast_count = __popc(cast_groups);
  return cast_count * kLogfmtCastBytes + (groups - cast_count) * kLogfmtBf16Bytes + groups * kLogfmtMetaBytes;
}

// What one lane of a receiving warp reads of a chunk: its group's meta word
// and both possible forms of its 16 values, loaded together (one round trip;
// the form not used is stale bytes of the slot). Split from the decoding so a
// caller can put several rows' loads in flight before decoding any.
struct LogfmtLaneWords {
  uint32_t meta;
  uint4 bf16[2];
  uint32_t cast[5];
};

// `row` is this GPU's memory, written by a peer whose data the caller has
// already acquired; read from L2 (ld.global.cg). Lanes past the row's end read
// nothing and decode to zeros.
__device__ __forceinline__ LogfmtLaneWords load_logfmt_lane(const char* row, int hidden, int chunk, bool in_row) {
  LogfmtLaneWords r{};
  if (!in_row) return r;
  const int lane = logfmt_lane(), group = 4 * chunk + lane / 8, i = lane % 8;
  const char* data = row + static_cast<int64_t>(kLogfmtBf16Bytes) * group;
  r.meta = __ldcg(reinterpret_cast<const unsigned int*>(row + logfmt_meta_offset(hidden)) + group);
  r.bf16[0] = __ldcg(reinterpret_cast<const uint4*>(data + 32 * i));
  r.bf16[1] = __ldcg(reinterpret_cast<const uint4*>(data + 32 * i) + 1);
#pragma unroll
  for (int k = 0; k < 5; ++k) r.cast[k] = __ldcg(reinterpret_cast<const unsigned int*>(data + 20 * i) + k);
  return r;
}

__device__ __forceinline__ void decode_logfmt_lane(const LogfmtLaneWords& r, float (&v)[16]) {
  if (logfmt_is_cast(r.meta)) {
    const LogfmtGroup g = logfmt_group(r.meta);
    uint32_t field[16];
    logfmt_unpack16(r.cast, field);
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = logfmt_decode(g, field[j]);
  } else {
    const uint32_t w[8] = {r.bf16[0].x, r.bf16[0].y, r.bf16[0].z, r.bf16[0].w,
                           r.bf16[1].x, r.bf16[1].y, r.bf16[1].z, r.bf16[1].w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      v[2 * j] = __uint_as_float(w[j] << 16);
      v[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    }
  }
}

// Receiver. All 32 lanes call it; lane l gets the decoded values of the
// channels it would hold in put_logfmt_chunk. Deterministic: the same slot
// bytes give the same floats.
__device__ __forceinline__ void load_logfmt_chunk(const char* row, int hidden, int chunk, bool in_row, float (&v)[16]) {
  decode_logfmt_lane(load_logfmt_lane(row, hidden, chunk, in_row), v);
}

}  // namespace turnout::kernels::low_latency
