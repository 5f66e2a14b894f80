// Per-token, per-128-channel FP8 cast of low-latency dispatch. Every float operation is
// spelled out in the order the GPU does it, so a kernel can match it bitwise.
#include <bit>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "reference.hpp"

namespace turnout::reference {

namespace {

constexpr int kGroup = 128;
constexpr float kE4m3Max = 448.0f;
// Keeps an all-zero group's scale finite and non-zero.
constexpr float kAmaxFloor = 1e-4f;

// ceil(log2(v)) exactly, for a positive normal float: frexp gives v = m * 2^e with m in
// [0.5, 1), and only m == 0.5 (v a power of two) makes the ceiling e - 1.
int log2_ceil(float v) {
  int e = 0;
  float m = std::frexp(v, &e);
  return m == 0.5f ? e - 1 : e;
}

}  // namespace

Fp8Row cast_row_to_fp8(std::span<const uint16_t> x, bool round_scale, bool use_ue8m0) {
  const size_t hidden = x.size();
  if (hidden == 0 || hidden % kGroup != 0)
    throw std::invalid_argument("hidden: the fp8 cast needs a positive multiple of 128, got " + std::to_string(hidden));
  if (use_ue8m0 && !round_scale)
    throw std::invalid_argument("use_ue8m0: needs round_scale (a ue8m0 byte holds a power of two)");
  if (use_ue8m0 && hidden % (4 * kGroup) != 0)
    throw std::invalid_argument(
        "hidden: use_ue8m0 packs 4 scales per int32, needs a multiple of "
        "512, got " +
        std::to_string(hidden));

  const size_t num_groups = hidden / kGroup;
  Fp8Row row;
  row.q.resize(hidden);
  row.scales.resize(num_groups);
  for (size_t g = 0; g < num_groups; ++g) {
    float amax = 0.0f;
    for (size_t c = g * kGroup; c < (g + 1) * kGroup; ++c)
      amax = std::fmax(amax, std::fabs(bf16_to_float(x[c])));  // fmax skips NaN
    amax = std::fmax(amax, kAmaxFloor);

    float scale = 0.0f;
    float inv_scale = 0.0f;
    if (round_scale) {
      // A power of two >= amax / 448 keeps every |x| * inv within 448 and inv exact.
      int exponent = log2_ceil(amax / kE4m3Max);
      scale = std::ldexp(1.0f, exponent);
      inv_scale = std::ldexp(1.0f, -exponent);
    } else {
      scale = amax / kE4m3Max;
      inv_scale = kE4m3Max / amax;
    }
    row.scales[g] = scale;
    for (size_t c = g * kGroup; c < (g + 1) * kGroup; ++c) row.q[c] = float_to_e4m3(bf16_to_float(x[c]) * inv_scale);
  }

  if (use_ue8m0) {
    row.packed_scales.assign(hidden / (4 * kGroup), 0u);
    for (size_t g = 0; g < num_groups; ++g) {
      uint32_t biased_exponent = (std::bit_cast<uint32_t>(row.scales[g]) >> 23) & 0xffu;
      row.packed_scales[g / 4] |= biased_exponent << (8 * (g % 4));
    }
  }
  return row;
}

}  // namespace turnout::reference
