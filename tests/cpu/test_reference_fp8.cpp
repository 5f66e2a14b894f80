// fp8 e4m3 scalar conversion and the per-128-channel row cast (scales, round_scale, ue8m0).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "expect_invalid_argument.hpp"
#include "reference.hpp"

namespace ref = turnout::reference;

namespace {

std::vector<uint16_t> random_row(std::mt19937& rng, int hidden, float spread) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> row(hidden);
  for (int c = 0; c < hidden; ++c) {
    // Each group gets its own magnitude so scales differ between groups.
    const float group_scale = std::ldexp(1.0f, (c / 128) % 7 - 3) * spread;
    row[c] = ref::float_to_bf16(normal(rng) * group_scale);
  }
  return row;
}

}  // namespace

TEST(ReferenceE4m3, KnownValues) {
  EXPECT_EQ(ref::float_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(ref::float_to_e4m3(-1.0f), 0xb8);
  EXPECT_EQ(ref::float_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(ref::float_to_e4m3(-448.0f), 0xfe);
  EXPECT_EQ(ref::float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(ref::float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(ref::float_to_e4m3(1.5f), 0x3c);
  EXPECT_EQ(ref::float_to_e4m3(std::ldexp(1.0f, -6)), 0x08);      // smallest normal
  EXPECT_EQ(ref::float_to_e4m3(std::ldexp(1.0f, -9)), 0x01);      // smallest subnormal
  EXPECT_EQ(ref::float_to_e4m3(7 * std::ldexp(1.0f, -9)), 0x07);  // largest subnormal
  EXPECT_EQ(ref::float_to_e4m3(std::ldexp(1.0f, -11)), 0x00);
  EXPECT_EQ(ref::e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(ref::e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(ref::e4m3_to_float(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(ref::e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(ref::e4m3_to_float(0xff)));
}

TEST(ReferenceE4m3, SaturatesAndKeepsNan) {
  EXPECT_EQ(ref::float_to_e4m3(1000.0f), 0x7e);
  EXPECT_EQ(ref::float_to_e4m3(-1000.0f), 0xfe);
  EXPECT_EQ(ref::float_to_e4m3(464.0f), 0x7e);  // tie between 448 and the NaN slot
  EXPECT_EQ(ref::float_to_e4m3(470.0f), 0x7e);  // nearer the NaN slot, still saturates
  EXPECT_EQ(ref::float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(ref::float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(ref::float_to_e4m3(std::numeric_limits<float>::max()), 0x7e);
  EXPECT_EQ(ref::float_to_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(ref::float_to_e4m3(-std::numeric_limits<float>::quiet_NaN()), 0x7f);
}

TEST(ReferenceE4m3, RoundsHalfToEven) {
  // 1 + 1/16 is halfway between 1.0 (0x38, even) and 1.125 (0x39).
  EXPECT_EQ(ref::float_to_e4m3(1.0625f), 0x38);
  // 1 + 3/16 is halfway between 1.125 (0x39) and 1.25 (0x3a, even).
  EXPECT_EQ(ref::float_to_e4m3(1.1875f), 0x3a);
  EXPECT_EQ(ref::float_to_e4m3(1.07f), 0x39);
  // Subnormal ties: 2^-10 between 0 and 2^-9 -> 0; 3 * 2^-10 between 0x01 and 0x02 -> 0x02.
  EXPECT_EQ(ref::float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(ref::float_to_e4m3(3 * std::ldexp(1.0f, -10)), 0x02);
  // Rounding up out of a binade carries into the exponent: 1.9375 -> 2.0 (0x40).
  EXPECT_EQ(ref::float_to_e4m3(1.9375f), 0x40);
  // 15.5 * 2^-10 rounds up out of the subnormals to the smallest normal.
  EXPECT_EQ(ref::float_to_e4m3(15.5f * std::ldexp(1.0f, -10)), 0x08);
}

TEST(ReferenceE4m3, EveryCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    const uint8_t bits = static_cast<uint8_t>(code);
    ASSERT_EQ(ref::float_to_e4m3(ref::e4m3_to_float(bits)), bits) << code;
  }
  // Codes increase with value on each sign, so the decoder has no gaps or swaps.
  for (int code = 1; code < 0x7f; ++code)
    ASSERT_LT(ref::e4m3_to_float(static_cast<uint8_t>(code - 1)), ref::e4m3_to_float(static_cast<uint8_t>(code)));
}

TEST(ReferenceE4m3, PicksTheNearestCode) {
  // Compare against a brute-force search over all finite codes.
  std::mt19937 rng(77);
  std::uniform_real_distribution<float> log_magnitude(-13.0f, 9.5f);
  for (int i = 0; i < 20000; ++i) {
    const float x = std::exp2(log_magnitude(rng)) * ((rng() & 1) ? -1.0f : 1.0f);
    const uint8_t got = ref::float_to_e4m3(x);
    const double err = std::fabs(static_cast<double>(ref::e4m3_to_float(got)) - x);
    for (int code = 0; code < 256; ++code) {
      if ((code & 0x7f) == 0x7f) continue;
      const double other = std::fabs(ref::e4m3_to_float(static_cast<uint8_t>(code)) - (double)x);
      if (std::fabs(x) <= 448.0f) {
        ASSERT_LE(err, other) << x << " code " << code;
      }
    }
  }
}

TEST(ReferenceFp8Cast, KnownRow) {
  // Group 0 all 1.0, group 1 all zero, group 2 ramps up to 3.5.
  std::vector<uint16_t> row(384, ref::float_to_bf16(0.0f));
  for (int c = 0; c < 128; ++c) row[c] = ref::float_to_bf16(1.0f);
  for (int c = 256; c < 384; ++c) row[c] = ref::float_to_bf16((c - 256) / 128.0f * 4.0f);
  row[383] = ref::float_to_bf16(-3.5f);

  const ref::Fp8Row cast = ref::cast_row_to_fp8(row, false, false);
  ASSERT_EQ(cast.q.size(), 384u);
  ASSERT_EQ(cast.scales.size(), 3u);
  EXPECT_TRUE(cast.packed_scales.empty());
  EXPECT_EQ(cast.scales[0], 1.0f / 448.0f);
  for (int c = 0; c < 128; ++c) EXPECT_EQ(cast.q[c], 0x7e);  // 1 * 448
  EXPECT_EQ(cast.scales[1], 1e-4f / 448.0f);                 // amax floor
  for (int c = 128; c < 256; ++c) EXPECT_EQ(cast.q[c], 0x00);
  // amax = |c=382| = 126/32 = 3.9375; its element maps to exactly 448.
  EXPECT_EQ(cast.scales[2], 3.9375f / 448.0f);
  EXPECT_EQ(cast.q[382], 0x7e);
  EXPECT_EQ(cast.q[383], ref::float_to_e4m3(-3.5f * (448.0f / 3.9375f)));
  EXPECT_EQ(cast.q[256], 0x00);
}

TEST(ReferenceFp8Cast, RoundScaleKnownRow) {
  std::vector<uint16_t> row(256, ref::float_to_bf16(1.0f));
  // Group 1: amax 56 = 448 / 8, so amax / 448 is already a power of two and stays.
  for (int c = 128; c < 256; ++c) row[c] = ref::float_to_bf16(c == 200 ? -56.0f : 7.0f);
  const ref::Fp8Row cast = ref::cast_row_to_fp8(row, true, false);
  // 1 / 448 lies in (2^-9, 2^-8]: rounds up to 2^-8; 1 * 256 = 2^8 = 0x78.
  EXPECT_EQ(cast.scales[0], std::ldexp(1.0f, -8));
  EXPECT_EQ(cast.q[0], 0x78);
  EXPECT_EQ(cast.scales[1], 0.125f);
  EXPECT_EQ(cast.q[200], 0xfe);
  EXPECT_EQ(cast.q[128], ref::float_to_e4m3(56.0f));
}

TEST(ReferenceFp8Cast, DequantizesWithinFp8Error) {
  std::mt19937 rng(5);
  for (int round_scale = 0; round_scale < 2; ++round_scale) {
    for (int trial = 0; trial < 50; ++trial) {
      const int hidden = 128 * (1 + trial % 8);
      const std::vector<uint16_t> row = random_row(rng, hidden, trial % 2 ? 1e-3f : 10.0f);
      const ref::Fp8Row cast = ref::cast_row_to_fp8(row, round_scale != 0, false);
      for (int c = 0; c < hidden; ++c) {
        const double x = ref::bf16_to_float(row[c]);
        const double scale = cast.scales[c / 128];
        const double deq = ref::e4m3_to_float(cast.q[c]) * scale;
        // Half an ulp (2^-4 relative) for normals, half the subnormal step 2^-9 below.
        const double bound = std::ldexp(std::fabs(x), -4) * (1 + 1e-6) + std::ldexp(scale, -10);
        ASSERT_LE(std::fabs(deq - x), bound) << "c=" << c << " x=" << x;
      }
    }
  }
}

TEST(ReferenceFp8Cast, RoundScaleIsSmallestPowerOfTwoAboveAmax) {
  std::mt19937 rng(6);
  for (int trial = 0; trial < 100; ++trial) {
    const std::vector<uint16_t> row = random_row(rng, 512, std::exp2(trial % 20 - 10.0f));
    const ref::Fp8Row cast = ref::cast_row_to_fp8(row, true, false);
    for (int g = 0; g < 4; ++g) {
      float amax = 1e-4f;
      for (int c = g * 128; c < (g + 1) * 128; ++c) amax = std::fmax(amax, std::fabs(ref::bf16_to_float(row[c])));
      const float scale = cast.scales[g];
      int e = 0;
      EXPECT_EQ(std::frexp(scale, &e), 0.5f) << "not a power of two: " << scale;
      EXPECT_GE(scale, amax / 448.0f);
      EXPECT_LT(scale / 2, amax / 448.0f);
      // A power-of-two scale never pushes a value past 448: no code saturates beyond amax.
      for (int c = g * 128; c < (g + 1) * 128; ++c)
        EXPECT_LE(std::fabs(ref::e4m3_to_float(cast.q[c]) * scale), amax * (1 + 1.0 / 16));
    }
  }
}

TEST(ReferenceFp8Cast, Ue8m0PacksExponentsLowByteFirst) {
  // Group amaxes 1, 2, 4, 0.5, then 448, 1, 1, 1: scales 2^-8, 2^-7, 2^-6, 2^-9, 1, 2^-8 ...
  const float amax[8] = {1.0f, 2.0f, 4.0f, 0.5f, 448.0f, 1.0f, 1.0f, 1.0f};
  std::vector<uint16_t> row(1024);
  for (int c = 0; c < 1024; ++c) row[c] = ref::float_to_bf16(c % 3 ? amax[c / 128] : 0.0f);
  const ref::Fp8Row cast = ref::cast_row_to_fp8(row, true, true);
  ASSERT_EQ(cast.packed_scales.size(), 2u);
  EXPECT_EQ(cast.packed_scales[0], 119u | (120u << 8) | (121u << 16) | (118u << 24));
  EXPECT_EQ(cast.packed_scales[1], 127u | (119u << 8) | (119u << 16) | (119u << 24));
  for (int g = 0; g < 8; ++g) {
    const uint32_t byte = (cast.packed_scales[g / 4] >> (8 * (g % 4))) & 0xffu;
    EXPECT_EQ(byte, (std::bit_cast<uint32_t>(cast.scales[g]) >> 23) & 0xffu);
    EXPECT_EQ(std::ldexp(1.0f, static_cast<int>(byte) - 127), cast.scales[g]);
  }
}

TEST(ReferenceFp8Cast, BadArgumentsThrow) {
  const std::vector<uint16_t> row384(384), row512(512), row100(100);
  expect_invalid_argument([&] { ref::cast_row_to_fp8(row100, false, false); }, "hidden");
  expect_invalid_argument([&] { ref::cast_row_to_fp8({}, false, false); }, "hidden");
  expect_invalid_argument([&] { ref::cast_row_to_fp8(row512, false, true); }, "use_ue8m0");
  expect_invalid_argument([&] { ref::cast_row_to_fp8(row384, true, true); }, "hidden");
  EXPECT_NO_THROW(ref::cast_row_to_fp8(row384, true, false));
}
