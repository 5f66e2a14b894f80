// The reference's LogFMT-10 functions: bytes on the wire (ours and DeepEP's) on
// hand-made rows, ours never above DeepEP's on random rows, and the error bound's
// values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "expect_invalid_argument.hpp"
#include "reference.hpp"

namespace ref = turnout::reference;

namespace {

constexpr int64_t kCast = 164, kBf16 = 260;  // bytes of a group, meta included

std::vector<uint16_t> row_of(size_t hidden, float v) {
  return std::vector<uint16_t>(hidden, ref::float_to_bf16(v));
}

void set(std::vector<uint16_t>& row, size_t i, float v) {
  row[i] = ref::float_to_bf16(v);
}

double bound_at(const std::vector<uint16_t>& row, size_t i) {
  return ref::logfmt_error_bound(row)[i];
}

}  // namespace

TEST(ReferenceLogfmt, BytesOfHandMadeGroups) {
  // All zeros: we cast (exact); DeepEP needs amin < amax.
  EXPECT_EQ(ref::logfmt_row_bytes_ours(row_of(128, 0.0f)), kCast);
  EXPECT_EQ(ref::logfmt_row_bytes_deepep(row_of(128, 0.0f)), kBf16);
  // One magnitude, both signs: the same.
  auto one = row_of(128, 0.5f);
  set(one, 7, -0.5f);
  EXPECT_EQ(ref::logfmt_row_bytes_ours(one), kCast);
  EXPECT_EQ(ref::logfmt_row_bytes_deepep(one), kBf16);
  // A zero among them gives DeepEP amin = 0 < amax: both cast.
  set(one, 9, 0.0f);
  EXPECT_EQ(ref::logfmt_row_bytes_ours(one), kCast);
  EXPECT_EQ(ref::logfmt_row_bytes_deepep(one), kCast);
  // amax 1 is not below 1; nor are inf and NaN.
  for (float big : {1.0f, -1.0f, INFINITY, NAN}) {
    auto row = row_of(128, 0.25f);
    set(row, 100, big);
    EXPECT_EQ(ref::logfmt_row_bytes_ours(row), kBf16) << big;
    EXPECT_EQ(ref::logfmt_row_bytes_deepep(row), kBf16) << big;
  }
  // The largest bf16 below 1 casts.
  auto below = row_of(128, 0.25f);
  below[3] = 0x3F7F;
  EXPECT_EQ(ref::logfmt_row_bytes_ours(below), kCast);
  EXPECT_EQ(ref::logfmt_row_bytes_deepep(below), kCast);
}

TEST(ReferenceLogfmt, DeepEpDecidesPerChunk) {
  // H = 1024: one chunk of 8 groups; group 3 holds a 2: DeepEP sends all 8 as bf16.
  auto row = row_of(1024, 0.125f);
  set(row, 0, 0.5f);
  set(row, 3 * 128 + 5, 2.0f);
  for (size_t g = 0; g < 8; ++g) set(row, g * 128 + 1, 0.5f);  // amin < amax in every group
  EXPECT_EQ(ref::logfmt_row_bytes_ours(row), 7 * kCast + kBf16);
  EXPECT_EQ(ref::logfmt_row_bytes_deepep(row), 8 * kBf16);
  // H = 1536 (not a multiple of 1024): chunks of 512; group 5 spoils the middle one.
  auto wide = row_of(1536, 0.125f);
  for (size_t g = 0; g < 12; ++g) set(wide, g * 128, 0.5f);
  set(wide, 5 * 128 + 9, -3.0f);
  EXPECT_EQ(ref::logfmt_row_bytes_ours(wide), 11 * kCast + kBf16);
  EXPECT_EQ(ref::logfmt_row_bytes_deepep(wide), 8 * kCast + 4 * kBf16);
  // H = 384: one partial chunk of 3 groups.
  auto three = row_of(384, 0.125f);
  for (size_t g = 0; g < 3; ++g) set(three, g * 128, 0.5f);
  EXPECT_EQ(ref::logfmt_row_bytes_deepep(three), 3 * kCast);
  set(three, 300, 0.0f);
  EXPECT_EQ(ref::logfmt_row_bytes_deepep(three), 3 * kCast);
  set(three, 200, 1.5f);
  EXPECT_EQ(ref::logfmt_row_bytes_deepep(three), 3 * kBf16);
  EXPECT_EQ(ref::logfmt_row_bytes_ours(three), 2 * kCast + kBf16);
}

TEST(ReferenceLogfmt, BadRowsAreRefused) {
  const std::vector<uint16_t> row(200, 0);
  expect_invalid_argument([&] { ref::logfmt_row_bytes_ours(row); }, "x");
  expect_invalid_argument([&] { ref::logfmt_row_bytes_deepep(row); }, "x");
  expect_invalid_argument([&] { ref::logfmt_error_bound(row); }, "x");
}

TEST(ReferenceLogfmt, OursNeverAboveDeepEpOnRandomRows) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> pick(0, 1 << 20);
  int fewer = 0;
  for (size_t hidden : {128, 512, 1408, 2048, 7168}) {
    for (float scale : {1e-30f, 1e-3f, 0.01f, 0.03f, 0.1f, 0.3f, 1.0f, 4.0f}) {
      for (int variant = 0; variant < 5; ++variant) {
        std::vector<uint16_t> row(hidden);
        for (auto& b : row) b = ref::float_to_bf16(scale * normal(rng));
        if (variant == 1)  // zeros sprinkled in
          for (size_t i = 0; i < hidden; i += 1 + pick(rng) % 50) row[i] = 0;
        if (variant == 2)  // a few large outliers
          for (int k = 0; k < 4; ++k) set(row, pick(rng) % hidden, k % 2 ? 50.0f : -50.0f);
        if (variant == 3) row = row_of(hidden, scale);  // constant
        if (variant == 4)                               // groups of their own magnitudes
          for (size_t i = 0; i < hidden; ++i)
            set(row, i, std::ldexp(normal(rng), -static_cast<int>((i / 128) % 20)) * scale);
        const int64_t ours = ref::logfmt_row_bytes_ours(row), deepep = ref::logfmt_row_bytes_deepep(row);
        ASSERT_LE(ours, deepep) << "hidden " << hidden << " scale " << scale << " variant " << variant;
        ASSERT_GE(ours, static_cast<int64_t>(hidden / 128) * kCast);
        fewer += ours < deepep;
      }
    }
  }
  EXPECT_GT(fewer, 0);  // the rows above do tell the formats apart
}

TEST(ReferenceLogfmt, BoundValues) {
  // amax 0.5, amin 0.25: s = 1 / 510.
  auto row = row_of(256, 0.0f);
  set(row, 0, 0.5f);
  set(row, 1, -0.25f);
  set(row, 2, 0.375f);
  const double s = 1.0 / 510, rel = (std::exp2(s) - 1) / 2 + std::ldexp(1.0, -18), tiny = std::ldexp(1.0, -150);
  EXPECT_DOUBLE_EQ(bound_at(row, 0), 0.5 * rel + tiny);
  EXPECT_DOUBLE_EQ(bound_at(row, 1), 0.25 * rel + tiny);
  EXPECT_DOUBLE_EQ(bound_at(row, 2), 0.375 * rel + tiny);
  EXPECT_EQ(bound_at(row, 3), 0.0);    // a zero
  EXPECT_EQ(bound_at(row, 200), 0.0);  // an all-zero group
  // Clipped: amin 2^-40 < amax / 2^32 = 2^-33, so a' = 2^-33 and s = 32 / 510.
  set(row, 128, 0.5f);
  set(row, 129, std::ldexp(1.0f, -40));
  set(row, 130, std::ldexp(1.0f, -33) * 0.75f);
  set(row, 131, std::ldexp(1.0f, -20));
  const double rel32 = (std::exp2(32.0 / 510) - 1) / 2 + std::ldexp(1.0, -18);
  EXPECT_DOUBLE_EQ(bound_at(row, 128), 0.5 * rel32 + tiny);
  EXPECT_DOUBLE_EQ(bound_at(row, 129), std::ldexp(1.0, -40) + tiny);
  EXPECT_DOUBLE_EQ(bound_at(row, 130), std::ldexp(0.5, -33) + tiny);
  EXPECT_DOUBLE_EQ(bound_at(row, 131), std::ldexp(1.0, -20) * rel32 + tiny);
  EXPECT_LT(rel32, 0.023);
  // One magnitude (signs and zeros aside) and bf16 groups cross exactly.
  auto exact = row_of(256, 0.0f);
  set(exact, 0, 0.75f);
  set(exact, 1, -0.75f);
  set(exact, 128, 0.5f);
  set(exact, 129, 1.0f);
  for (double b : ref::logfmt_error_bound(exact)) EXPECT_EQ(b, 0.0);
}
