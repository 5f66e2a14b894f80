// LogFMT-10 of low-latency combine (use_logfmt): what a row costs on the wire, in
// this format and in DeepEP's, and the per-value error bound that
// src/kernels/low_latency/logfmt.cuh proves. Written from the format's
// definition in double, apart from the kernels' code.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "reference.hpp"

namespace turnout::reference {

namespace {

constexpr size_t kGroup = 128;
constexpr int64_t kCastBytes = 160;
constexpr int64_t kBf16Bytes = 256;
constexpr int64_t kMetaBytes = 4;
constexpr uint16_t kOneBits = 0x3F80;  // bf16 1.0

void check_row(std::span<const uint16_t> x) {
  if (x.size() % kGroup != 0)
    throw std::invalid_argument("x: logfmt needs a row of a multiple of 128 channels, got " + std::to_string(x.size()));
}

uint16_t magnitude_bits(uint16_t bits) {
  return bits & 0x7FFF;
}

// amax < 1, NaN and inf excluded: magnitude bits order like magnitudes.
bool group_below_one(std::span<const uint16_t> group) {
  return std::all_of(group.begin(), group.end(), [](uint16_t b) { return magnitude_bits(b) < kOneBits; });
}

}  // namespace

int64_t logfmt_row_bytes_ours(std::span<const uint16_t> x) {
  check_row(x);
  int64_t bytes = 0;
  for (size_t g = 0; g < x.size(); g += kGroup)
    bytes += (group_below_one(x.subspan(g, kGroup)) ? kCastBytes : kBf16Bytes) + kMetaBytes;
  return bytes;
}

int64_t logfmt_row_bytes_deepep(std::span<const uint16_t> x) {
  check_row(x);
  const size_t chunk = x.size() % 1024 == 0 ? 1024 : 512;
  int64_t bytes = 0;
  for (size_t c = 0; c < x.size(); c += chunk) {
    const size_t end = std::min(c + chunk, x.size());
    bool cast = true;
    for (size_t g = c; g < end; g += kGroup) {
      const auto group = x.subspan(g, kGroup);
      uint16_t amax = 0, amin = 0xFFFF;
      for (uint16_t b : group) {
        amax = std::max(amax, magnitude_bits(b));
        amin = std::min(amin, magnitude_bits(b));
      }
      cast = cast && group_below_one(group) && amin < amax;
    }
    bytes += static_cast<int64_t>((end - c) / kGroup) * ((cast ? kCastBytes : kBf16Bytes) + kMetaBytes);
  }
  return bytes;
}

std::vector<double> logfmt_error_bound(std::span<const uint16_t> x) {
  check_row(x);
  std::vector<double> bound(x.size(), 0.0);
  const double rounding = std::ldexp(1.0, -18), subnormal = std::ldexp(1.0, -150);
  for (size_t g = 0; g < x.size(); g += kGroup) {
    const auto group = x.subspan(g, kGroup);
    if (!group_below_one(group)) continue;
    double amax = 0.0, amin = INFINITY;
    for (uint16_t b : group) {
      const double m = std::fabs(bf16_to_float(b));
      amax = std::max(amax, m);
      if (m > 0.0) amin = std::min(amin, m);
    }
    if (amax == 0.0 || amin == amax) continue;  // zeros, or one magnitude: exact
    const double lowest = std::max(amin, std::ldexp(amax, -32));
    const double s = std::log2(amax / lowest) / 510.0;
    for (size_t c = 0; c < kGroup; ++c) {
      const double m = std::fabs(bf16_to_float(group[c]));
      if (m == 0.0) continue;
      // Below a' the proven min(m, a' - m), loosened to min(m, a' / 2): a row a bf16 ulp off moves it by 2^-7 at most.
      bound[g + c] = (m >= lowest ? m * ((std::exp2(s) - 1.0) / 2.0 + rounding) : std::min(m, lowest / 2)) + subnormal;
    }
  }
  return bound;
}

}  // namespace turnout::reference
