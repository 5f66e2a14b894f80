// The reference's own e4m3 and bf16 conversions against CUDA's host implementations in
// cuda_fp8.h / cuda_bf16.h (what the kernels call), so the oracle and the GPU round alike.
#if __has_include(<cuda_fp8.h>)
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#define TURNOUT_HAVE_CUDA_FP8 1
#endif

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>

#include "reference.hpp"

namespace ref = turnout::reference;

#ifdef TURNOUT_HAVE_CUDA_FP8

namespace {

uint8_t cuda_e4m3(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

uint16_t cuda_bf16(float x) {
  const __nv_bfloat16_raw raw = __float2bfloat16_rn(x);
  return raw.x;
}

}  // namespace

TEST(ReferenceVsCuda, E4m3EncodeOnStridedSweepOfAllFloats) {
  // A prime stride visits every exponent and many mantissa patterns of both signs.
  uint64_t checked = 0;
  for (uint64_t bits = 0; bits < (1ull << 32); bits += 127) {
    const float x = std::bit_cast<float>(static_cast<uint32_t>(bits));
    ASSERT_EQ(ref::float_to_e4m3(x), cuda_e4m3(x)) << std::hexfloat << x;
    ++checked;
  }
  EXPECT_GT(checked, 33000000u);
}

TEST(ReferenceVsCuda, E4m3EncodeAroundEveryMidpoint) {
  // Ties and their float neighbours are where rounding modes differ.
  for (int code = 0; code < 0x7e; ++code) {
    const float lo = ref::e4m3_to_float(static_cast<uint8_t>(code));
    const float hi = ref::e4m3_to_float(static_cast<uint8_t>(code + 1));
    const float mid = lo + (hi - lo) / 2;
    const float probes[] = {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), hi};
    for (float p : probes) {
      ASSERT_EQ(ref::float_to_e4m3(p), cuda_e4m3(p)) << std::hexfloat << p;
      ASSERT_EQ(ref::float_to_e4m3(-p), cuda_e4m3(-p)) << std::hexfloat << -p;
    }
  }
  for (float p : {448.0f, 464.0f, 465.0f, 480.0f, 1e30f, INFINITY, -INFINITY, -1e-30f, -0.0f, NAN, -NAN,
                  std::bit_cast<float>(0x7f800001u), std::bit_cast<float>(0xff800001u)})
    ASSERT_EQ(ref::float_to_e4m3(p), cuda_e4m3(p)) << p;
}

TEST(ReferenceVsCuda, E4m3EncodeRandomNearRange) {
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> log_magnitude(-14.0f, 10.0f);
  for (int i = 0; i < 2000000; ++i) {
    const float x = std::exp2(log_magnitude(rng)) * ((rng() & 1) ? -1.0f : 1.0f);
    ASSERT_EQ(ref::float_to_e4m3(x), cuda_e4m3(x)) << std::hexfloat << x;
  }
}

TEST(ReferenceVsCuda, E4m3DecodeEveryCode) {
  for (int code = 0; code < 256; ++code) {
    __nv_fp8_e4m3 v;
    v.__x = static_cast<__nv_fp8_storage_t>(code);
    const float cuda = static_cast<float>(v);
    const float mine = ref::e4m3_to_float(static_cast<uint8_t>(code));
    if (std::isnan(cuda)) {
      EXPECT_TRUE(std::isnan(mine)) << code;
    } else {
      EXPECT_EQ(mine, cuda) << code;
    }
  }
}

TEST(ReferenceVsCuda, Bf16EncodeRandomFloats) {
  std::mt19937 rng(100);
  for (int i = 0; i < 4000000; ++i) {
    const float x = std::bit_cast<float>(static_cast<uint32_t>(rng()));
    if (std::isnan(x)) continue;
    ASSERT_EQ(ref::float_to_bf16(x), cuda_bf16(x)) << std::hexfloat << x;
  }
}

#else

TEST(ReferenceVsCuda, Skipped) {
  GTEST_SKIP() << "cuda_fp8.h not on the include path";
}

#endif
