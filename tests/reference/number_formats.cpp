// bf16 and fp8 e4m3 scalar conversions, written from the format definitions so that
// they can be trusted without a GPU.
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "reference.hpp"

namespace turnout::reference {

namespace {

// Rounds x to the nearest number with `mantissa_bits` fraction bits, ties to even;
// below 2^min_exponent the spacing stays that of the lowest binade (subnormals).
// Working by value in double keeps this obviously right: x / ulp is exact (ulp is a
// power of two) and nearbyint rounds ties to even in the default rounding mode.
double round_to_grid(double x, int mantissa_bits, int min_exponent) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  int e = 0;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  int exponent = e - 1 < min_exponent ? min_exponent : e - 1;
  double ulp = std::ldexp(1.0, exponent - mantissa_bits);
  return std::nearbyint(x / ulp) * ulp;
}

}  // namespace

uint16_t float_to_bf16(float x) {
  uint32_t bits = std::bit_cast<uint32_t>(x);
  // Truncating a NaN could leave an all-zero mantissa (inf); force the quiet bit.
  if (std::isnan(x)) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  // Adding 0x7fff plus the lowest kept bit rounds the dropped half to even in one add.
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float bf16_to_float(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

uint16_t double_to_bf16(double x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xffc0 : 0x7fc0;
  // bf16 has float's exponent range: 7 fraction bits, normal down to 2^-126.
  double r = round_to_grid(x, 7, -126);
  // Past the largest finite bf16 the grid's next step is 2^128, which is inf.
  if (std::fabs(r) >= std::ldexp(1.0, 128)) return std::signbit(r) ? 0xff80 : 0x7f80;
  // r is a bf16 value, so the float is exact and its low 16 bits are zero.
  return static_cast<uint16_t>(std::bit_cast<uint32_t>(static_cast<float>(r)) >> 16);
}

uint8_t float_to_e4m3(float x) {
  // One canonical NaN whatever the sign, as CUDA's conversion returns.
  if (std::isnan(x)) return 0x7f;
  uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  // e4m3: 3 fraction bits, exponent bias 7, normal down to 2^-6, subnormal step 2^-9.
  double r = std::fabs(round_to_grid(static_cast<double>(x), 3, -6));
  // satfinite: 480 (the grid's value above 448) and inf both clamp to the max normal.
  if (r > 448.0) return sign | 0x7e;
  if (r < std::ldexp(1.0, -6)) return sign | static_cast<uint8_t>(r * 512.0);
  int e = 0;
  std::frexp(r, &e);
  int exponent = e - 1;  // r = 1.mmm * 2^exponent
  int mantissa = static_cast<int>(std::ldexp(r, -exponent) * 8.0) - 8;
  return sign | static_cast<uint8_t>(((exponent + 7) << 3) | mantissa);
}

float e4m3_to_float(uint8_t bits) {
  int exponent_field = (bits >> 3) & 0xf;
  int mantissa = bits & 0x7;
  float magnitude = 0.0f;
  if (exponent_field == 0xf && mantissa == 0x7)
    magnitude = std::numeric_limits<float>::quiet_NaN();
  else if (exponent_field == 0)
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);
  else
    magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent_field - 10);
  return (bits & 0x80) ? -magnitude : magnitude;
}

}  // namespace turnout::reference
