// Low-latency dispatch and combine of the host reference, and the helper that puts GPU
// rows in canonical order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "expect_invalid_argument.hpp"
#include "reference.hpp"

namespace ref = turnout::reference;

namespace {

int64_t range_of(int64_t begin, int64_t count) {
  return (begin << 32) | count;
}

// R = 2, E = 4 (experts 0, 1 on rank 0; 2, 3 on rank 1), K = 2, H = 2, M = 4.
//   rank 0: t0 -> {0, 3}, t1 -> {1, 1}, t2 -> {-1, 2}
//   rank 1: t0 -> {2, 3}, t1 -> {3, 0}
// Token (r, t) carries the row {10r + t + 1, -(10r + t + 1)}.
std::vector<ref::LowLatencyDispatchInput> hand_inputs() {
  std::vector<ref::LowLatencyDispatchInput> in(2);
  in[0].num_tokens = 3;
  in[0].topk_idx = {0, 3, 1, 1, -1, 2};
  in[1].num_tokens = 2;
  in[1].topk_idx = {2, 3, 3, 0};
  for (int r = 0; r < 2; ++r)
    for (int t = 0; t < in[r].num_tokens; ++t) {
      const float v = static_cast<float>(10 * r + t + 1);
      in[r].x.push_back(ref::float_to_bf16(v));
      in[r].x.push_back(ref::float_to_bf16(-v));
    }
  return in;
}

ref::LowLatencyParams hand_params() {
  return {.num_max_dispatch_tokens_per_rank = 4, .hidden = 2, .num_experts = 4, .num_topk = 2};
}

std::vector<uint16_t> bf16_row(float v) {
  return {ref::float_to_bf16(v), ref::float_to_bf16(-v)};
}

// Random decode batch: x random bf16, -1 slots and duplicates, one rank with no tokens.
std::vector<ref::LowLatencyDispatchInput> random_inputs(std::mt19937& rng, const ref::LowLatencyParams& p,
                                                        int num_ranks) {
  std::uniform_int_distribution<int64_t> expert(0, p.num_experts - 1);
  std::uniform_int_distribution<int> percent(0, 99);
  std::uniform_int_distribution<int> tokens(1, p.num_max_dispatch_tokens_per_rank);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<ref::LowLatencyDispatchInput> in(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    in[r].num_tokens = r == num_ranks - 1 ? 0 : tokens(rng);
    if (r == 0) in[r].num_tokens = p.num_max_dispatch_tokens_per_rank;
    in[r].topk_idx.resize(static_cast<size_t>(in[r].num_tokens) * p.num_topk);
    for (int64_t& id : in[r].topk_idx) id = percent(rng) < 15 ? -1 : expert(rng);
    in[r].x.resize(static_cast<size_t>(in[r].num_tokens) * p.hidden);
    for (uint16_t& v : in[r].x) v = ref::float_to_bf16(normal(rng));
  }
  return in;
}

bool row_has(const std::vector<int64_t>& topk, int num_topk, int t, int64_t expert) {
  for (int k = 0; k < num_topk; ++k)
    if (topk[static_cast<size_t>(t) * num_topk + k] == expert) return true;
  return false;
}

}  // namespace

TEST(ReferenceLowLatency, DispatchTwoRanksByHand) {
  const auto out = ref::low_latency_dispatch(hand_inputs(), hand_params());
  ASSERT_EQ(out.size(), 2u);

  // Rank 0, expert 0: r0.t0 and r1.t1; expert 1: r0.t1 once (named twice).
  EXPECT_EQ(out[0].recv_count, (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(out[0].layout_range,
            (std::vector<int64_t>{range_of(0, 1), range_of(1, 1), range_of(0, 1), range_of(1, 0)}));
  EXPECT_EQ(out[0].experts[0].src_rank, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(out[0].experts[0].src_token, (std::vector<int32_t>{0, 1}));
  std::vector<uint16_t> rows = bf16_row(1);
  const std::vector<uint16_t> r1t1 = bf16_row(12);
  rows.insert(rows.end(), r1t1.begin(), r1t1.end());
  EXPECT_EQ(out[0].experts[0].x, rows);
  EXPECT_EQ(out[0].experts[1].src_token, (std::vector<int32_t>{1}));
  EXPECT_EQ(out[0].experts[1].x, bf16_row(2));
  EXPECT_TRUE(out[0].experts[0].x_fp8.empty());

  // Rank 1, expert 2: r0.t2, r1.t0; expert 3: r0.t0, r1.t0, r1.t1.
  EXPECT_EQ(out[1].recv_count, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(out[1].layout_range,
            (std::vector<int64_t>{range_of(0, 1), range_of(1, 1), range_of(0, 1), range_of(1, 2)}));
  EXPECT_EQ(out[1].experts[0].src_rank, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(out[1].experts[0].src_token, (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(out[1].experts[1].src_rank, (std::vector<int32_t>{0, 1, 1}));
  EXPECT_EQ(out[1].experts[1].src_token, (std::vector<int32_t>{0, 0, 1}));
}

TEST(ReferenceLowLatency, CombineTwoRanksByHand) {
  const std::vector<ref::LowLatencyDispatchInput> in = hand_inputs();
  const auto out = ref::low_latency_dispatch(in, hand_params());
  // Expert e returns its rows times (e + 1), so the sum shows which expert answered.
  std::vector<ref::LowLatencyCombineInput> back(2);
  for (int r = 0; r < 2; ++r) {
    back[r].expert_x.resize(2);
    for (int l = 0; l < 2; ++l) {
      const float factor = static_cast<float>(r * 2 + l + 1);
      for (uint16_t v : out[r].experts[l].x)
        back[r].expert_x[l].push_back(ref::float_to_bf16(ref::bf16_to_float(v) * factor));
    }
  }
  back[0].topk_idx = in[0].topk_idx;
  back[0].topk_weights = {0.5f, 0.25f, 0.125f, 0.375f, 0.75f, 0.0625f};
  back[1].topk_idx = in[1].topk_idx;
  back[1].topk_weights = {0.5f, 2.0f, 1.0f, 3.0f};
  const auto combined = ref::low_latency_combine(back, out, hand_params());
  // r0.t0 = (0.5 * 1 + 0.25 * 4) * 1; r0.t1 = (0.125 + 0.375) * 2 * 2 (one row, both
  // slots); r0.t2 = 0.0625 * 3 * 3 (the -1 slot is skipped).
  EXPECT_EQ(combined[0], (std::vector<double>{1.5, -1.5, 2.0, -2.0, 0.5625, -0.5625}));
  // r1.t0 = (0.5 * 3 + 2 * 4) * 11; r1.t1 = (1 * 4 + 3 * 1) * 12.
  EXPECT_EQ(combined[1], (std::vector<double>{104.5, -104.5, 84.0, -84.0}));
}

TEST(ReferenceLowLatency, Fp8RowsAreTheRowCast) {
  std::mt19937 rng(3);
  for (int mode = 0; mode < 3; ++mode) {
    ref::LowLatencyParams p = {.num_max_dispatch_tokens_per_rank = 8,
                               .hidden = 512,
                               .num_experts = 8,
                               .num_topk = 3,
                               .use_fp8 = true,
                               .round_scale = mode >= 1,
                               .use_ue8m0 = mode == 2};
    const auto in = random_inputs(rng, p, 4);
    const auto out = ref::low_latency_dispatch(in, p);
    for (int r = 0; r < 4; ++r)
      for (int l = 0; l < 2; ++l) {
        const ref::LowLatencyExpertRecv& rows = out[r].experts[l];
        const size_t n = rows.src_token.size();
        ASSERT_EQ(rows.x_fp8.size(), n * 512);
        ASSERT_EQ(rows.scales.size(), n * 4);
        ASSERT_EQ(rows.packed_scales.size(), mode == 2 ? n : 0u);
        EXPECT_TRUE(rows.x.empty());
        for (size_t i = 0; i < n; ++i) {
          const auto& src = in[rows.src_rank[i]];
          const std::span<const uint16_t> x =
              std::span(src.x).subspan(static_cast<size_t>(rows.src_token[i]) * 512, 512);
          const ref::Fp8Row cast = ref::cast_row_to_fp8(x, p.round_scale, p.use_ue8m0);
          ASSERT_TRUE(std::equal(cast.q.begin(), cast.q.end(), rows.x_fp8.begin() + i * 512));
          ASSERT_TRUE(std::equal(cast.scales.begin(), cast.scales.end(), rows.scales.begin() + i * 4));
          if (mode == 2) {
            ASSERT_EQ(cast.packed_scales[0], rows.packed_scales[i]);
          }
        }
      }
  }
}

TEST(ReferenceLowLatency, RandomCountsAndRangesAreConsistent) {
  std::mt19937 rng(17);
  const int num_ranks = 4;
  const ref::LowLatencyParams p = {
      .num_max_dispatch_tokens_per_rank = 32, .hidden = 8, .num_experts = 16, .num_topk = 6};
  const int experts_per_rank = 4;
  for (int trial = 0; trial < 5; ++trial) {
    const auto in = random_inputs(rng, p, num_ranks);
    const auto out = ref::low_latency_dispatch(in, p);
    std::vector<ref::DispatchLayout> layouts;
    for (int s = 0; s < num_ranks; ++s)
      layouts.push_back(
          ref::get_dispatch_layout(in[s].topk_idx, in[s].num_tokens, p.num_topk, num_ranks, p.num_experts, num_ranks));
    for (int r = 0; r < num_ranks; ++r)
      for (int l = 0; l < experts_per_rank; ++l) {
        const int64_t expert = r * experts_per_rank + l;
        const ref::LowLatencyExpertRecv& rows = out[r].experts[l];
        // recv_count = the senders' distinct per-expert counts from the layout.
        int32_t expected = 0;
        for (int s = 0; s < num_ranks; ++s) expected += layouts[s].num_tokens_per_expert[expert];
        EXPECT_EQ(out[r].recv_count[l], expected);
        ASSERT_EQ(rows.src_token.size(), static_cast<size_t>(expected));
        ASSERT_EQ(rows.x.size(), static_cast<size_t>(expected) * p.hidden);
        // Ranges tile the rows in source-rank order; each group holds exactly the tokens
        // of that source naming this expert, ascending, with their data.
        int64_t next_begin = 0;
        for (int s = 0; s < num_ranks; ++s) {
          const int64_t range = out[r].layout_range[static_cast<size_t>(l) * num_ranks + s];
          const int64_t begin = range >> 32, count = range & 0xffffffff;
          EXPECT_EQ(begin, next_begin);
          std::vector<int32_t> want;
          for (int t = 0; t < in[s].num_tokens; ++t)
            if (row_has(in[s].topk_idx, p.num_topk, t, expert)) want.push_back(t);
          ASSERT_EQ(count, static_cast<int64_t>(want.size()));
          for (int64_t i = 0; i < count; ++i) {
            EXPECT_EQ(rows.src_rank[begin + i], s);
            EXPECT_EQ(rows.src_token[begin + i], want[i]);
            ASSERT_TRUE(std::equal(rows.x.begin() + (begin + i) * p.hidden, rows.x.begin() + (begin + i + 1) * p.hidden,
                                   in[s].x.begin() + static_cast<size_t>(want[i]) * p.hidden));
          }
          next_begin = begin + count;
        }
        EXPECT_EQ(next_begin, out[r].recv_count[l]);
      }
    EXPECT_EQ(layouts[num_ranks - 1].num_tokens_per_rank, (std::vector<int32_t>(num_ranks, 0)));
  }
}

TEST(ReferenceLowLatency, CombineOfOnesGivesSumOfValidWeights) {
  std::mt19937 rng(23);
  const int num_ranks = 4;
  const ref::LowLatencyParams p = {
      .num_max_dispatch_tokens_per_rank = 16, .hidden = 4, .num_experts = 8, .num_topk = 4};
  const auto in = random_inputs(rng, p, num_ranks);
  const auto out = ref::low_latency_dispatch(in, p);
  std::uniform_real_distribution<float> weight(0.0f, 1.0f);
  std::vector<ref::LowLatencyCombineInput> back(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    for (int l = 0; l < 2; ++l)
      back[r].expert_x.emplace_back(out[r].experts[l].src_token.size() * p.hidden, ref::float_to_bf16(1.0f));
    back[r].topk_idx = in[r].topk_idx;
    for (size_t i = 0; i < in[r].topk_idx.size(); ++i) back[r].topk_weights.push_back(weight(rng));
  }
  const auto combined = ref::low_latency_combine(back, out, p);
  for (int s = 0; s < num_ranks; ++s) {
    ASSERT_EQ(combined[s].size(), static_cast<size_t>(in[s].num_tokens) * p.hidden);
    for (int t = 0; t < in[s].num_tokens; ++t) {
      double expected = 0.0;
      for (int k = 0; k < p.num_topk; ++k) {
        const size_t slot = static_cast<size_t>(t) * p.num_topk + k;
        if (in[s].topk_idx[slot] >= 0) expected += back[s].topk_weights[slot];
      }
      for (int c = 0; c < p.hidden; ++c) ASSERT_EQ(combined[s][static_cast<size_t>(t) * p.hidden + c], expected);
    }
  }
}

TEST(ReferenceLowLatency, CanonicalOrderUndoesGpuShuffles) {
  // Expert rows as a GPU might write them: groups placed rank 2, 0, 1; tokens shuffled.
  const std::vector<int32_t> src_info = {7, 3, 5, /*rank 0*/ 4, 1, /*rank 1*/ 9, -99};
  const std::vector<int64_t> ranges = {range_of(3, 2), range_of(5, 1), range_of(0, 3)};
  const std::vector<int32_t> perm = ref::low_latency_canonical_order(src_info, ranges, 6);
  EXPECT_EQ(perm, (std::vector<int32_t>{4, 3, 5, 1, 2, 0}));

  // Canonical rows come back unchanged.
  const auto out = ref::low_latency_dispatch(hand_inputs(), hand_params());
  const auto& rows = out[1].experts[1];
  const std::vector<int32_t> identity = ref::low_latency_canonical_order(
      rows.src_token, std::span(out[1].layout_range).subspan(2, 2), out[1].recv_count[1]);
  EXPECT_EQ(identity, (std::vector<int32_t>{0, 1, 2}));

  expect_invalid_argument([&] { ref::low_latency_canonical_order(src_info, ranges, 5); }, "layout_range");
  expect_invalid_argument(
      [&] { ref::low_latency_canonical_order(src_info, std::vector<int64_t>{range_of(0, 3), range_of(2, 3)}, 6); },
      "overlaps");
  expect_invalid_argument(
      [&] { ref::low_latency_canonical_order(src_info, std::vector<int64_t>{range_of(0, 3), range_of(4, 2)}, 6); },
      "cover");
  expect_invalid_argument(
      [&] { ref::low_latency_canonical_order(std::vector<int32_t>{1, 1}, std::vector<int64_t>{range_of(0, 2)}, 2); },
      "twice");
  expect_invalid_argument([&] { ref::low_latency_canonical_order(src_info, ranges, 8); }, "recv_count");
}

TEST(ReferenceLowLatency, BadInputThrows) {
  const auto params = hand_params();
  auto with_params = [](auto edit) {
    ref::LowLatencyParams p = hand_params();
    edit(p);
    return p;
  };
  auto too_many = hand_inputs();
  too_many[1].num_tokens = 5;
  too_many[1].x.resize(10);
  too_many[1].topk_idx.resize(10, -1);
  expect_invalid_argument([&] { ref::low_latency_dispatch(too_many, params); }, "ranks[1].num_tokens");
  auto bad_id = hand_inputs();
  bad_id[0].topk_idx[3] = 4;
  expect_invalid_argument([&] { ref::low_latency_dispatch(bad_id, params); }, "ranks[0].topk_idx");
  auto short_x = hand_inputs();
  short_x[0].x.pop_back();
  expect_invalid_argument([&] { ref::low_latency_dispatch(short_x, params); }, "ranks[0].x:");
  expect_invalid_argument(
      [&] { ref::low_latency_dispatch(hand_inputs(), with_params([](auto& p) { p.use_fp8 = true; })); }, "hidden");
  expect_invalid_argument(
      [&] { ref::low_latency_dispatch(hand_inputs(), with_params([](auto& p) { p.use_ue8m0 = true; })); }, "use_ue8m0");
  expect_invalid_argument(
      [&] { ref::low_latency_dispatch(hand_inputs(), with_params([](auto& p) { p.num_experts = 3; })); },
      "num_experts");

  // Combine: a token must have been dispatched to each expert it names.
  const auto out = ref::low_latency_dispatch(hand_inputs(), params);
  std::vector<ref::LowLatencyCombineInput> back(2);
  for (int r = 0; r < 2; ++r) {
    for (int l = 0; l < 2; ++l) back[r].expert_x.push_back(out[r].experts[l].x);
    back[r].topk_idx = hand_inputs()[r].topk_idx;
    back[r].topk_weights.assign(back[r].topk_idx.size(), 1.0f);
  }
  EXPECT_NO_THROW(ref::low_latency_combine(back, out, params));
  auto rerouted = back;
  rerouted[0].topk_idx[4] = 1;  // r0.t2 never went to expert 1
  expect_invalid_argument([&] { ref::low_latency_combine(rerouted, out, params); }, "not dispatched");
  auto short_weights = back;
  short_weights[1].topk_weights.pop_back();
  expect_invalid_argument([&] { ref::low_latency_combine(short_weights, out, params); }, "ranks[1].topk_weights");
  auto short_expert = back;
  short_expert[1].expert_x[1].pop_back();
  expect_invalid_argument([&] { ref::low_latency_combine(short_expert, out, params); }, "ranks[1].expert_x");
}
