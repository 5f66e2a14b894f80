// The per-128-channel e4m3 cast of low-latency mode, in the pieces a warp
// puts together: the largest magnitude of a lane's 16-byte word, of a group
// of lanes (shuffles), the group's scale and its inverse, and the cast of
// scaled channels. Each float step is the one tests/reference/fp8_cast.cpp
// spells out (same operations, same rounding), so a kernel built from these
// matches it bitwise.
//
// Dispatch: 16 lanes hold one 128-channel group of bf16 (8 channels a lane):
//   amax  = group_max<16>(abs_max_bf16x8(word));
//   scale = fp8_scale(amax, round_scale);
//   bytes = bf16x8_to_e4m3(word, scale.inv);
// Combine's rows take the same steps with round_scale false.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

namespace turnout::device {

inline constexpr float kE4m3Max = 448.0f;
// Keeps an all-zero group's scale finite and non-zero.
inline constexpr float kFp8AmaxFloor = 1e-4f;

__device__ __forceinline__ __nv_bfloat162 bf16x2_from_bits(uint32_t bits) {
  __nv_bfloat162 v;
  static_assert(sizeof(v) == sizeof(bits));
  memcpy(&v, &bits, sizeof(bits));
  return v;
}

// The largest |channel| of the 8 bf16 channels of a 16-byte word. NaN
// channels are skipped (max returns the other operand), as the reference's
// fmax does; the max of bf16 magnitudes is exact, so doing it in bf16 first
// changes nothing.
__device__ __forceinline__ float abs_max_bf16x8(const int4& v) {
  const __nv_bfloat162 a = __hmax2(__habs2(bf16x2_from_bits(v.x)), __habs2(bf16x2_from_bits(v.y)));
  const __nv_bfloat162 b = __hmax2(__habs2(bf16x2_from_bits(v.z)), __habs2(bf16x2_from_bits(v.w)));
  const __nv_bfloat162 m = __hmax2(a, b);
  return fmaxf(__low2float(m), __high2float(m));
}

// The max of `v` over each aligned group of kLanes lanes (a power of two
// <= 32), in every lane of the group. All 32 lanes must call it.
template <int kLanes>
__device__ __forceinline__ float group_max(float v) {
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0);
#pragma unroll
  for (int m = kLanes / 2; m > 0; m /= 2) v = fmaxf(v, __shfl_xor_sync(~0u, v, m));
  return v;
}

struct Fp8Scale {
  float scale;  // what the receiver multiplies e4m3 values by
  float inv;    // what the sender multiplies channels by before the cast
};

// From a group's amax (floored here at kFp8AmaxFloor): scale = amax / 448 and
// inv = 448 / amax, each one correctly rounded division. With round_scale,
// scale = 2^e for e = ceil(log2(amax / 448)) and inv = 2^-e, both exact.
__device__ __forceinline__ Fp8Scale fp8_scale(float amax, bool round_scale) {
  amax = fmaxf(amax, kFp8AmaxFloor);
  const float ratio = __fdiv_rn(amax, kE4m3Max);
  if (!round_scale) return {ratio, __fdiv_rn(kE4m3Max, amax)};
  // ratio is a normal float (>= 1e-4 / 448), 1.f * 2^(biased - 127): its
  // log2 is a whole number only when the fraction f is zero.
  const uint32_t bits = __float_as_uint(ratio);
  const int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
  return {__uint_as_float(static_cast<uint32_t>(127 + exponent) << 23),
          __uint_as_float(static_cast<uint32_t>(127 - exponent) << 23)};
}

// Two already scaled values to e4m3: round to nearest even, saturating at
// +-448 (inf too), NaN to 0x7f; `first` in the low byte.
__device__ __forceinline__ uint32_t e4m3x2(float first, float second) {
  return __nv_cvt_float2_to_fp8x2(make_float2(first, second), __NV_SATFINITE, __NV_E4M3);
}

// The 8 bf16 channels of a 16-byte word times `inv`, each product rounded to
// float once, then cast to e4m3: channel i in byte i of the result.
__device__ __forceinline__ uint2 bf16x8_to_e4m3(const int4& v, float inv) {
  const uint32_t words[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                             static_cast<uint32_t>(v.w)};
  uint32_t packed[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = __uint_as_float(words[i] << 16);
    const float hi = __uint_as_float(words[i] & 0xffff0000u);
    packed[i] = e4m3x2(__fmul_rn(lo, inv), __fmul_rn(hi, inv));
  }
  return make_uint2(packed[0] | packed[1] << 16, packed[2] | packed[3] << 16);
}

// The ue8m0 byte of a power-of-two scale: its biased exponent.
__device__ __forceinline__ uint32_t ue8m0_exponent(float scale) {
  return (__float_as_uint(scale) >> 23) & 0xffu;
}

}  // namespace turnout::device
