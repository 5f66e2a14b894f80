// bf16 conversions of the host reference: rounding, specials, and the fp64 path that
// combine's results go through.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "reference.hpp"

namespace ref = turnout::reference;

namespace {

float from_bits(uint32_t bits) {
  return std::bit_cast<float>(bits);
}

}  // namespace

TEST(ReferenceBf16, KnownValues) {
  EXPECT_EQ(ref::float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(ref::float_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(ref::float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(ref::float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(ref::bf16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(ref::bf16_to_float(0xc040), -3.0f);
  EXPECT_EQ(ref::float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  // FLT_MAX is past the last bf16 plus half a step: rounds to inf.
  EXPECT_EQ(ref::float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
}

TEST(ReferenceBf16, RoundsHalfToEven) {
  // 1 + 2^-8 is halfway between 1 (0x3f80, even) and 1 + 2^-7 (0x3f81).
  EXPECT_EQ(ref::float_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 0x3f81 (odd) and 0x3f82 (even).
  EXPECT_EQ(ref::float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  // Just above halfway goes up.
  EXPECT_EQ(ref::float_to_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3f81);
  EXPECT_EQ(ref::double_to_bf16(1.0 + std::ldexp(1.0, -8)), 0x3f80);
  EXPECT_EQ(ref::double_to_bf16(1.0 + 3 * std::ldexp(1.0, -8)), 0x3f82);
}

TEST(ReferenceBf16, NanStaysNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(ref::bf16_to_float(ref::float_to_bf16(nan))));
  // A signalling NaN whose payload sits only in the dropped bits must not become inf.
  EXPECT_TRUE(std::isnan(ref::bf16_to_float(ref::float_to_bf16(from_bits(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(ref::bf16_to_float(ref::double_to_bf16(std::nan("")))));
}

TEST(ReferenceBf16, DoubleRoundsOnceNotTwice) {
  // Through float this would first round to the exact midpoint and then to even (0x3f80).
  const double x = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40);
  EXPECT_EQ(ref::float_to_bf16(static_cast<float>(x)), 0x3f80);
  EXPECT_EQ(ref::double_to_bf16(x), 0x3f81);
}

TEST(ReferenceBf16, DoubleSubnormalsAndOverflow) {
  EXPECT_EQ(ref::double_to_bf16(std::ldexp(1.0, -133)), 0x0001);
  EXPECT_EQ(ref::double_to_bf16(std::ldexp(1.0, -134)), 0x0000);        // tie to even
  EXPECT_EQ(ref::double_to_bf16(1.5 * std::ldexp(1.0, -134)), 0x0001);  // above the tie
  EXPECT_EQ(ref::double_to_bf16(-std::ldexp(1.0, -140)), 0x8000);
  EXPECT_EQ(ref::double_to_bf16(1e300), 0x7f80);
  EXPECT_EQ(ref::double_to_bf16(-1e300), 0xff80);
  // The largest finite bf16 survives; half a step above it is a tie that goes to inf.
  const double max_bf16 = ref::bf16_to_float(0x7f7f);
  EXPECT_EQ(ref::double_to_bf16(max_bf16), 0x7f7f);
  EXPECT_EQ(ref::double_to_bf16(max_bf16 + std::ldexp(1.0, 127 - 8)), 0x7f80);
}

TEST(ReferenceBf16, EveryCodeRoundTrips) {
  for (uint32_t code = 0; code < 0x10000; ++code) {
    const uint16_t bits = static_cast<uint16_t>(code);
    const float value = ref::bf16_to_float(bits);
    if (std::isnan(value)) continue;
    ASSERT_EQ(ref::float_to_bf16(value), bits) << std::hex << code;
    ASSERT_EQ(ref::double_to_bf16(value), bits) << std::hex << code;
  }
}

TEST(ReferenceBf16, FloatAndDoublePathsAgreeOnFloats) {
  // Two independent implementations (integer trick vs rounding by value) must agree.
  std::mt19937 rng(1234);
  for (int i = 0; i < 1000000; ++i) {
    const float x = from_bits(static_cast<uint32_t>(rng()));
    if (std::isnan(x)) continue;
    ASSERT_EQ(ref::float_to_bf16(x), ref::double_to_bf16(x)) << x;
  }
}
