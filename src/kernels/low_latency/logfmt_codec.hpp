// The scalar core of low-latency combine's LogFMT-10 format (logfmt.cuh has
// the format, its bound and the warp-level functions): group parameters from
// the meta word, levels, the nearest-level code of one value, its decoding,
// and the packing of a lane's 16 codes. Host and device alike, so the CPU
// tests run this very code; only the encoder's first guess of a level uses a
// faster function on the device, and the guess is corrected by comparisons.
#pragma once

#include <cuda_runtime_api.h>  // __host__ __device__ for the C++ compiler too

#include <cmath>
#include <cstdint>

#ifndef __CUDA_ARCH__
#include <bit>
#endif

#include "runtime/align.hpp"

namespace turnout::kernels::low_latency {

inline constexpr int kLogfmtGroup = 128;      // channels per group (one meta word)
inline constexpr int kLogfmtCastBytes = 160;  // 128 values of 10 bits
inline constexpr int kLogfmtBf16Bytes = 256;  // 128 bf16 values
inline constexpr int kLogfmtMetaBytes = 4;    // bf16 amax, bf16 amin
inline constexpr int kLogfmtTopCode = 511;    // codes 1..511 are the levels, 0 is zero
// Below amax / 2^32 the levels stop: smaller values go to 0 or the lowest level.
inline constexpr int kLogfmtOctaves = 32;
// bf16 1.0: a group casts iff its amax bits are below this (NaN and inf are above).
inline constexpr uint32_t kBf16OneBits = 0x3F80;

// Bytes of one combine row slot with its logfmt meta, hidden a multiple of 8
// (also the size of a bf16 row's slot).
__host__ __device__ constexpr int64_t logfmt_row_bytes(int hidden) {
  return align_up(int64_t(hidden) * 2 + int64_t(kLogfmtMetaBytes) * ((hidden + kLogfmtGroup - 1) / kLogfmtGroup), 16);
}
__host__ __device__ constexpr int64_t logfmt_meta_offset(int hidden) {
  return align_up(int64_t(hidden) * 2, 16);
}

__host__ __device__ inline float logfmt_bits_to_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  return std::bit_cast<float>(bits);
#endif
}

__host__ __device__ inline uint32_t logfmt_float_to_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  return std::bit_cast<uint32_t>(x);
#endif
}

// 2^e for e in [-126, 127]: a normal float, built exactly.
__host__ __device__ inline float logfmt_pow2(int e) {
  return logfmt_bits_to_float(static_cast<uint32_t>(e + 127) << 23);
}

__host__ __device__ constexpr uint32_t logfmt_meta(uint32_t amax_bits, uint32_t amin_bits) {
  return amax_bits | amin_bits << 16;
}

__host__ __device__ constexpr bool logfmt_is_cast(uint32_t meta) {
  return (meta & 0xFFFFu) < kBf16OneBits;
}

// What both sides derive from a cast group's meta word, in a scaled domain
// where A = amax * 2^k lies in [1, 2) (in [2^-7, 1) for a subnormal amax), so
// every quantity below is a normal float and the scaling is exact.
struct LogfmtGroup {
  float amax;      // A
  float amin;      // a' = max(amin, A / 2^32) scaled; 0 for an all-zero group
  float step;      // s = log2(A / a') / 510, the log2 spacing of the levels
  float inv_step;  // 510 / log2(A / a'), 0 when s is 0: the encoder's guess only
  float scale;     // 2^k: the sender's |v| to the scaled domain (exact)
  float unscale;   // 2^-k: the receiver's way back
};

__host__ __device__ inline LogfmtGroup logfmt_group(uint32_t meta) {
  const uint32_t amax_bits = meta & 0xFFFFu, amin_bits = meta >> 16;
  const int exponent = static_cast<int>(amax_bits >> 7);  // biased; below 127 for a cast group
  const int k = exponent == 0 ? 126 : 127 - exponent;
  LogfmtGroup g;
  g.scale = logfmt_pow2(k);
  g.unscale = logfmt_pow2(-k);
  g.amax = logfmt_bits_to_float(amax_bits << 16) * g.scale;
  const float amin = logfmt_bits_to_float(amin_bits << 16) * g.scale;
  const float lowest = g.amax * logfmt_pow2(-kLogfmtOctaves);
  g.amin = amin < lowest ? lowest : amin;
  // NaN for an all-zero group, whose values never reach a level.
  const float range = log2f(g.amax / g.amin);
  g.step = range / static_cast<float>(kLogfmtTopCode - 1);
  g.inv_step = range > 0.0f ? static_cast<float>(kLogfmtTopCode - 1) / range : 0.0f;
  return g;
}

// Level c in the scaled domain: 0, a' * 2^((c - 1) s), with the ends exact
// (a' and A), so groups of one or two magnitudes cross exactly.
__host__ __device__ inline float logfmt_level(const LogfmtGroup& g, int c) {
  const float inner = g.amin * exp2f(static_cast<float>(c - 1) * g.step);
  return c == 0 ? 0.0f : c == 1 ? g.amin : c == kLogfmtTopCode ? g.amax : inner;
}

// The code of the level nearest to m (ties to the lower), m = |v| * scale in
// (0, A]. A guess from log2 picks a pair of neighbouring levels; the loops
// move it until the pair brackets m (level 0 is 0 <= m and level 511 is
// A >= m, so they stop), then the nearer of the two wins. The distances are
// exact (the levels are less than a factor 2 apart, and m >= a' / 2 wherever
// the upper one can win), so this is the nearest level the decoder has.
__host__ __device__ inline int logfmt_encode_magnitude(const LogfmtGroup& g, float m) {
  int c = 0;
  if (m >= g.amin) {
#ifdef __CUDA_ARCH__
    const float t = __log2f(__fdividef(m, g.amin)) * g.inv_step;
#else
    const float t = log2f(m / g.amin) * g.inv_step;
#endif
    c = t < static_cast<float>(kLogfmtTopCode - 2) ? static_cast<int>(t) + 1 : kLogfmtTopCode - 1;
  }
  float lo = logfmt_level(g, c), hi = logfmt_level(g, c + 1);
  while (m < lo) {
    --c;
    hi = lo;
    lo = logfmt_level(g, c);
  }
  while (m > hi) {
    ++c;
    lo = hi;
    hi = logfmt_level(g, c + 1);
  }
  return m - lo <= hi - m ? c : c + 1;
}

// A bf16 value (its bits) to its 10-bit field: bit 9 the sign, bits 0..8 the code.
__host__ __device__ inline uint32_t logfmt_encode(const LogfmtGroup& g, uint32_t bf16_bits) {
  const uint32_t sign = (bf16_bits >> 15) & 1u;
  const uint32_t magnitude = bf16_bits & 0x7FFFu;
  const uint32_t code =
      magnitude == 0
          ? 0u
          : static_cast<uint32_t>(logfmt_encode_magnitude(g, logfmt_bits_to_float(magnitude << 16) * g.scale));
  return code | sign << 9;
}

__host__ __device__ inline float logfmt_decode(const LogfmtGroup& g, uint32_t field) {
  const int c = static_cast<int>(field & 0x1FFu);
  const float magnitude = c == 0 ? 0.0f : logfmt_level(g, c) * g.unscale;
  return logfmt_bits_to_float(logfmt_float_to_bits(magnitude) | (field >> 9 & 1u) << 31);
}

// A lane's 16 fields in 20 bytes: words 0..3 hold the low 8 bits of fields
// 4j..4j+3 (byte i of the words = field i), word 4 the top 2 bits of field i
// at bits 2i, 2i+1.
__host__ __device__ inline void logfmt_pack16(const uint32_t (&field)[16], uint32_t (&w)[5]) {
  w[4] = 0;
  for (int j = 0; j < 4; ++j) {
    w[j] = 0;
    for (int b = 0; b < 4; ++b) w[j] |= (field[4 * j + b] & 0xFFu) << (8 * b);
  }
  for (int i = 0; i < 16; ++i) w[4] |= (field[i] >> 8) << (2 * i);
}

__host__ __device__ inline void logfmt_unpack16(const uint32_t (&w)[5], uint32_t (&field)[16]) {
  for (int i = 0; i < 16; ++i) field[i] = (w[i / 4] >> (8 * (i % 4)) & 0xFFu) | (w[4] >> (2 * i) & 3u) << 8;
}

}  // namespace turnout::kernels::low_latency
