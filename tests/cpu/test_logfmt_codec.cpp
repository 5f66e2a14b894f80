// LogFMT-10's scalar core (src/kernels/low_latency/logfmt_codec.hpp), the very
// code the kernels run, here on the host: every value decodes within the
// reference's bound, the encoder takes the nearest level, groups of one or two
// magnitudes and zeros cross exactly, the packing keeps every field, and the
// cast decision costs the bytes the reference counts. The warp-level staging
// and reductions around it need a GPU (tests/gpu/test_low_latency_logfmt.py).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/low_latency/logfmt_codec.hpp"
#include "reference.hpp"

namespace ll = turnout::kernels::low_latency;
namespace ref = turnout::reference;

namespace {

// The meta word of one group as the sender builds it: largest magnitude bits,
// smallest nonzero ones (0 if none).
uint32_t meta_of(const uint16_t* group) {
  uint32_t amax = 0, amin = 0xFFFF;
  for (int i = 0; i < 128; ++i) {
    const uint32_t m = group[i] & 0x7FFFu;
    amax = std::max(amax, m);
    if (m != 0) amin = std::min(amin, m);
  }
  return ll::logfmt_meta(amax, amin == 0xFFFF ? 0 : amin);
}

struct RoundTrip {
  std::vector<float> decoded;
  int64_t bytes = 0;
};

// A row through the format: each group's 8 lanes of 16 fields packed, unpacked
// and decoded as the receiver does.
RoundTrip round_trip(const std::vector<uint16_t>& row) {
  RoundTrip out;
  out.decoded.resize(row.size());
  for (size_t g = 0; g < row.size(); g += 128) {
    const uint32_t meta = meta_of(&row[g]);
    out.bytes += ll::kLogfmtMetaBytes;
    if (!ll::logfmt_is_cast(meta)) {
      for (size_t c = g; c < g + 128; ++c) out.decoded[c] = ref::bf16_to_float(row[c]);
      out.bytes += ll::kLogfmtBf16Bytes;
      continue;
    }
    out.bytes += ll::kLogfmtCastBytes;
    const ll::LogfmtGroup sender = ll::logfmt_group(meta), receiver = ll::logfmt_group(meta);
    for (size_t lane = g; lane < g + 128; lane += 16) {
      uint32_t field[16], words[5], back[16];
      for (int j = 0; j < 16; ++j) field[j] = ll::logfmt_encode(sender, row[lane + j]);
      ll::logfmt_pack16(field, words);
      ll::logfmt_unpack16(words, back);
      for (int j = 0; j < 16; ++j) out.decoded[lane + j] = ll::logfmt_decode(receiver, back[j]);
    }
  }
  return out;
}

// Rows of many kinds: normal at a scale, zeros, outliers, constant, a magnitude
// per group, values near bf16's smallest.
std::vector<uint16_t> random_row(std::mt19937& rng, size_t hidden, float scale, int variant) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> pick(0, 1 << 20);
  std::vector<uint16_t> row(hidden);
  for (auto& b : row) b = ref::float_to_bf16(scale * normal(rng));
  if (variant == 1)
    for (size_t i = 0; i < hidden; i += 1 + pick(rng) % 40) row[i] = pick(rng) % 2 ? 0x8000 : 0;
  if (variant == 2)
    for (int k = 0; k < 4; ++k) row[pick(rng) % hidden] = ref::float_to_bf16(k % 2 ? 50.0f : -50.0f);
  if (variant == 3) row.assign(hidden, ref::float_to_bf16(scale));
  if (variant == 4)
    for (size_t i = 0; i < hidden; ++i)
      row[i] = ref::float_to_bf16(std::ldexp(normal(rng) * scale, -static_cast<int>((i / 128) * 3 % 45)));
  if (variant == 5)  // a few values far below the rest: amin clipped at amax / 2^32
    for (int k = 0; k < 6; ++k) row[pick(rng) % hidden] = ref::float_to_bf16(std::ldexp(scale, -35 - 2 * k));
  return row;
}

}  // namespace

TEST(LogfmtCodec, RowSlotSizes) {
  EXPECT_EQ(ll::logfmt_meta_offset(7168), 14336);
  EXPECT_EQ(ll::logfmt_row_bytes(7168), 14336 + 224);
  EXPECT_EQ(ll::logfmt_row_bytes(128), 272);  // 256 + 4, to 16
  EXPECT_EQ(ll::logfmt_row_bytes(1408), 2816 + 48);
  EXPECT_EQ(ll::logfmt_row_bytes(8), 32);  // a bf16-only hidden: 16 + 4, to 16
}

TEST(LogfmtCodec, DecodesWithinTheBoundAndCostsTheReferenceBytes) {
  std::mt19937 rng(11);
  double worst = 0.0;  // largest error / bound seen
  for (size_t hidden : {128, 1408, 7168}) {
    for (float scale : {1e-36f, 1e-20f, 1e-3f, 0.01f, 0.03f, 0.1f, 0.3f, 1.0f, 2.0f, 4.0f}) {
      for (int variant = 0; variant < 6; ++variant) {
        const auto row = random_row(rng, hidden, scale, variant);
        const RoundTrip got = round_trip(row);
        ASSERT_EQ(got.bytes, ref::logfmt_row_bytes_ours(row)) << hidden << " " << scale << " " << variant;
        const auto bound = ref::logfmt_error_bound(row);
        for (size_t i = 0; i < hidden; ++i) {
          const double v = ref::bf16_to_float(row[i]), err = std::fabs(double(got.decoded[i]) - v);
          ASSERT_LE(err, bound[i]) << "hidden " << hidden << " scale " << scale << " variant " << variant << " channel "
                                   << i << ": " << v << " decoded " << got.decoded[i];
          if (bound[i] > 0) worst = std::max(worst, err / bound[i]);
        }
      }
    }
  }
  // The bound is not loose by much: some value comes near it.
  EXPECT_GT(worst, 0.9);
}

TEST(LogfmtCodec, EncoderTakesTheNearestLevel) {
  std::mt19937 rng(5);
  const int variants[] = {0, 1, 3, 4, 5};  // 2 has outliers >= 1: a bf16 group
  for (int trial = 0; trial < 200; ++trial) {
    const auto row = random_row(rng, 128, 0.05f, variants[trial % 5]);
    const uint32_t meta = meta_of(row.data());
    ASSERT_TRUE(ll::logfmt_is_cast(meta));
    const ll::LogfmtGroup g = ll::logfmt_group(meta);
    for (int i = 0; i < 128; i += 3) {
      const int code = static_cast<int>(ll::logfmt_encode(g, row[i]) & 0x1FF);
      const float m = std::fabs(ref::bf16_to_float(row[i])) * g.scale;
      // Brute force over every level: none nearer, and a tie goes to the lower code.
      for (int c = 0; c <= ll::kLogfmtTopCode; ++c) {
        const float d = std::fabs(ll::logfmt_level(g, c) - m), best = std::fabs(ll::logfmt_level(g, code) - m);
        ASSERT_TRUE(d > best || (d == best && c >= code)) << "value " << m << " code " << code << " level " << c;
      }
    }
  }
}

TEST(LogfmtCodec, LevelsRiseFromAminToAmax) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits(1, 0x3F7F);
  for (int trial = 0; trial < 300; ++trial) {
    uint32_t a = bits(rng), b = bits(rng);
    if (trial % 3 == 0) b = std::min<uint32_t>(a + 1, 0x3F7F);  // neighbours in bf16: the finest spacing
    const ll::LogfmtGroup g = ll::logfmt_group(ll::logfmt_meta(std::max(a, b), std::min(a, b)));
    EXPECT_EQ(ll::logfmt_level(g, 0), 0.0f);
    EXPECT_EQ(ll::logfmt_level(g, ll::kLogfmtTopCode) * g.unscale, ref::bf16_to_float(std::max(a, b)));
    for (int c = 1; c < ll::kLogfmtTopCode && a != b; ++c)
      ASSERT_LT(ll::logfmt_level(g, c), ll::logfmt_level(g, c + 1)) << std::hex << a << " " << b << " level " << c;
  }
}

TEST(LogfmtCodec, ZerosAndGroupsOfOneOrTwoMagnitudesAreExact) {
  for (float a : {0.75f, 3e-39f, 1e-20f, 0.99f}) {
    for (float b : {a, a / 3, a * 1e-9f}) {  // 1e-9 > 2^-32: not clipped
      std::vector<uint16_t> row(128, 0);
      for (int i = 0; i < 128; ++i) row[i] = ref::float_to_bf16(i % 4 == 0 ? a : i % 4 == 1 ? -b : i % 4 == 2 ? b : 0);
      row[3] = 0x8000;  // -0
      const RoundTrip got = round_trip(row);
      ASSERT_EQ(got.bytes, ll::kLogfmtCastBytes + ll::kLogfmtMetaBytes);
      for (int i = 0; i < 128; ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(got.decoded[i]), static_cast<uint32_t>(row[i]) << 16)
            << a << " " << b << " channel " << i;
    }
  }
  std::vector<uint16_t> zeros(128, 0);
  const RoundTrip got = round_trip(zeros);
  for (float v : got.decoded) EXPECT_EQ(std::bit_cast<uint32_t>(v), 0u);
}

TEST(LogfmtCodec, PackingKeepsEveryField) {
  std::mt19937 rng(2);
  std::uniform_int_distribution<uint32_t> field_of(0, 1023);
  for (int trial = 0; trial < 100; ++trial) {
    uint32_t field[16], words[5], back[16];
    for (auto& f : field) f = field_of(rng);
    ll::logfmt_pack16(field, words);
    ll::logfmt_unpack16(words, back);
    for (int i = 0; i < 16; ++i) ASSERT_EQ(back[i], field[i]);
    // The layout the header states: byte i of words 0..3 is field i's low 8 bits.
    for (int i = 0; i < 16; ++i) ASSERT_EQ(words[i / 4] >> (8 * (i % 4)) & 0xFF, field[i] & 0xFF);
  }
}
