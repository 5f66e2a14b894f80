// Normal dispatch and combine of the host reference: a two-rank case written out by hand,
// then properties on random routings checked against get_dispatch_layout.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "expect_invalid_argument.hpp"
#include "reference.hpp"

namespace ref = turnout::reference;

namespace {

std::vector<uint8_t> bf16_bytes(const std::vector<uint16_t>& values) {
  std::vector<uint8_t> bytes(values.size() * 2);
  std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

std::vector<uint16_t> bytes_to_bf16(const std::vector<uint8_t>& bytes) {
  std::vector<uint16_t> values(bytes.size() / 2);
  std::memcpy(values.data(), bytes.data(), values.size() * 2);
  return values;
}

// The two-rank case: E = 4 (experts 0, 1 on rank 0; 2, 3 on rank 1), K = 2, one byte
// row per token, one scale per token.
//   rank 0: t0 -> {0, 3}, t1 -> {1, 1}, t2 -> {-1, 2}, t3 -> {-1, -1}
//   rank 1: t0 -> {2, 3}, t1 -> {3, 0}
std::vector<ref::NormalDispatchInput> hand_inputs() {
  std::vector<ref::NormalDispatchInput> in(2);
  in[0].num_tokens = 4;
  in[0].x = {10, 11, 12, 13};
  in[0].x_scales = {0.0f, 1.0f, 2.0f, 3.0f};
  in[0].topk_idx = {0, 3, 1, 1, -1, 2, -1, -1};
  in[0].topk_weights = {0.5f, 0.25f, 0.125f, 0.375f, 0.9f, 0.1f, 0.2f, 0.3f};
  in[0].is_token_in_rank = {1, 1, 1, 0, 0, 1, 0, 0};
  in[1].num_tokens = 2;
  in[1].x = {20, 21};
  in[1].x_scales = {100.0f, 101.0f};
  in[1].topk_idx = {2, 3, 3, 0};
  in[1].topk_weights = {0.6f, 0.4f, 0.7f, 0.3f};
  in[1].is_token_in_rank = {0, 1, 1, 1};
  return in;
}

ref::NormalDispatchParams hand_params(int expert_alignment) {
  return {.row_bytes = 1, .num_scales = 1, .num_topk = 2, .num_experts = 4, .expert_alignment = expert_alignment};
}

struct RandomCase {
  int num_ranks = 0;
  int num_experts = 0;
  int num_topk = 0;
  int hidden = 0;
  std::vector<std::vector<int64_t>> topk;  // per rank
  std::vector<ref::DispatchLayout> layouts;
  std::vector<ref::NormalDispatchInput> inputs;
};

// Random routing with -1 slots and duplicates; rank 1 sends nothing; x is random bf16.
RandomCase make_random_case(uint32_t seed, int num_ranks, int num_experts, int num_topk, int hidden) {
  std::mt19937 rng(seed);
  RandomCase c;
  c.num_ranks = num_ranks;
  c.num_experts = num_experts;
  c.num_topk = num_topk;
  c.hidden = hidden;
  std::uniform_int_distribution<int64_t> expert(0, num_experts - 1);
  std::uniform_int_distribution<int> percent(0, 99);
  std::uniform_int_distribution<int> tokens(0, 40);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int r = 0; r < num_ranks; ++r) {
    const int num_tokens = r == 1 ? 0 : tokens(rng);
    std::vector<int64_t> topk(static_cast<size_t>(num_tokens) * num_topk);
    for (int64_t& id : topk) id = percent(rng) < 20 ? -1 : expert(rng);
    ref::DispatchLayout layout = ref::get_dispatch_layout(topk, num_tokens, num_topk, num_ranks, num_experts, 1);
    ref::NormalDispatchInput in;
    in.num_tokens = num_tokens;
    std::vector<uint16_t> x(static_cast<size_t>(num_tokens) * hidden);
    for (uint16_t& v : x) v = ref::float_to_bf16(normal(rng));
    in.x = bf16_bytes(x);
    for (int i = 0; i < num_tokens * (hidden / 128 > 0 ? hidden / 128 : 1); ++i) in.x_scales.push_back(normal(rng));
    in.topk_idx = topk;
    for (size_t i = 0; i < topk.size(); ++i) in.topk_weights.push_back(std::fabs(normal(rng)));
    in.is_token_in_rank = layout.is_token_in_rank;
    c.topk.push_back(topk);
    c.layouts.push_back(std::move(layout));
    c.inputs.push_back(std::move(in));
  }
  return c;
}

ref::NormalDispatchParams random_params(const RandomCase& c, int expert_alignment) {
  return {.row_bytes = 2 * c.hidden,
          .num_scales = c.hidden / 128 > 0 ? c.hidden / 128 : 1,
          .num_topk = c.num_topk,
          .num_experts = c.num_experts,
          .expert_alignment = expert_alignment};
}

}  // namespace

TEST(ReferenceNormalDispatch, TwoRanksByHand) {
  const std::vector<ref::NormalDispatchInput> in = hand_inputs();
  const std::vector<ref::NormalDispatchResult> out = ref::normal_dispatch(in, hand_params(1));
  ASSERT_EQ(out.size(), 2u);

  // Rank 0 gets r0.t0, r0.t1, r1.t1.
  const ref::NormalDispatchResult& r0 = out[0];
  EXPECT_EQ(r0.num_tokens, 4);
  EXPECT_EQ(r0.num_recv, 3);
  EXPECT_EQ(r0.recv_x, (std::vector<uint8_t>{10, 11, 21}));
  EXPECT_EQ(r0.recv_x_scales, (std::vector<float>{0.0f, 1.0f, 101.0f}));
  EXPECT_EQ(r0.recv_src_rank, (std::vector<int32_t>{0, 0, 1}));
  EXPECT_EQ(r0.recv_src_idx, (std::vector<int32_t>{0, 1, 1}));
  EXPECT_EQ(r0.recv_topk_idx, (std::vector<int64_t>{0, -1, 1, 1, -1, 0}));
  EXPECT_EQ(r0.recv_topk_weights, (std::vector<float>{0.5f, 0.0f, 0.125f, 0.375f, 0.0f, 0.3f}));
  // Expert 0: r0.t0 and r1.t1; expert 1: r0.t1 once although it names expert 1 twice.
  EXPECT_EQ(r0.num_recv_tokens_per_expert, (std::vector<int32_t>{2, 1}));

  // Rank 1 gets r0.t0, r0.t2, r1.t0, r1.t1.
  const ref::NormalDispatchResult& r1 = out[1];
  EXPECT_EQ(r1.num_tokens, 2);
  EXPECT_EQ(r1.num_recv, 4);
  EXPECT_EQ(r1.recv_x, (std::vector<uint8_t>{10, 12, 20, 21}));
  EXPECT_EQ(r1.recv_x_scales, (std::vector<float>{0.0f, 2.0f, 100.0f, 101.0f}));
  EXPECT_EQ(r1.recv_src_rank, (std::vector<int32_t>{0, 0, 1, 1}));
  EXPECT_EQ(r1.recv_src_idx, (std::vector<int32_t>{0, 2, 0, 1}));
  EXPECT_EQ(r1.recv_topk_idx, (std::vector<int64_t>{-1, 1, -1, 0, 0, 1, 1, -1}));
  EXPECT_EQ(r1.recv_topk_weights, (std::vector<float>{0.0f, 0.25f, 0.0f, 0.1f, 0.6f, 0.4f, 0.7f, 0.0f}));
  EXPECT_EQ(r1.num_recv_tokens_per_expert, (std::vector<int32_t>{2, 3}));

  // From rank 0: 2 to rank 0, 2 to rank 1; from rank 1: 1 to rank 0, 2 to rank 1.
  const std::vector<int32_t> prefix = {2, 2, 3, 4};
  EXPECT_EQ(r0.rank_prefix_matrix, prefix);
  EXPECT_EQ(r1.rank_prefix_matrix, prefix);
}

TEST(ReferenceNormalDispatch, ExpertAlignmentRoundsUp) {
  const std::vector<ref::NormalDispatchInput> in = hand_inputs();
  const auto by2 = ref::normal_dispatch(in, hand_params(2));
  EXPECT_EQ(by2[0].num_recv_tokens_per_expert, (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(by2[1].num_recv_tokens_per_expert, (std::vector<int32_t>{2, 4}));
  const auto by128 = ref::normal_dispatch(in, hand_params(128));
  EXPECT_EQ(by128[0].num_recv_tokens_per_expert, (std::vector<int32_t>{128, 128}));
  EXPECT_EQ(by128[1].num_recv_tokens_per_expert, (std::vector<int32_t>{128, 128}));
  // Alignment changes only the counts, not the rows.
  EXPECT_EQ(by128[1].recv_x, by2[1].recv_x);
}

TEST(ReferenceNormalDispatch, WithoutTopkOrScales) {
  std::vector<ref::NormalDispatchInput> in = hand_inputs();
  for (ref::NormalDispatchInput& r : in) {
    r.topk_idx.clear();
    r.topk_weights.clear();
    r.x_scales.clear();
  }
  const auto out = ref::normal_dispatch(in, {.row_bytes = 1});
  EXPECT_EQ(out[1].recv_x, (std::vector<uint8_t>{10, 12, 20, 21}));
  EXPECT_TRUE(out[1].recv_topk_idx.empty());
  EXPECT_TRUE(out[1].recv_topk_weights.empty());
  EXPECT_TRUE(out[1].recv_x_scales.empty());
  EXPECT_TRUE(out[1].num_recv_tokens_per_expert.empty());
  EXPECT_EQ(out[1].rank_prefix_matrix, (std::vector<int32_t>{2, 2, 3, 4}));
}

TEST(ReferenceNormalCombine, TwoRanksByHand) {
  const std::vector<ref::NormalDispatchInput> in = hand_inputs();
  const auto dispatched = ref::normal_dispatch(in, hand_params(1));
  // hidden = 1; received rows carry powers of two so every sum names its terms.
  std::vector<ref::NormalCombineInput> back(2);
  back[0].x = {ref::float_to_bf16(1.0f), ref::float_to_bf16(2.0f), ref::float_to_bf16(4.0f)};
  back[1].x = {ref::float_to_bf16(8.0f), ref::float_to_bf16(16.0f), ref::float_to_bf16(32.0f),
               ref::float_to_bf16(64.0f)};
  back[0].topk_weights = dispatched[0].recv_topk_weights;
  back[1].topk_weights = dispatched[1].recv_topk_weights;

  const auto plain = ref::normal_combine(back, dispatched, 1, 2);
  // r0.t0 = 1 (rank 0) + 8 (rank 1); r0.t1 = 2; r0.t2 = 16; r0.t3 reached no rank.
  EXPECT_EQ(plain[0].combined_x, (std::vector<double>{9.0, 2.0, 16.0, 0.0}));
  // r1.t0 = 32; r1.t1 = 4 (rank 0) + 64 (rank 1).
  EXPECT_EQ(plain[1].combined_x, (std::vector<double>{32.0, 68.0}));
  // Each slot's weight comes back from the one rank holding its expert; -1 slots give 0.
  const std::vector<double> w0 = {0.5f, 0.25f, 0.125f, 0.375f, 0.0f, 0.1f, 0.0f, 0.0f};
  const std::vector<double> w1 = {0.6f, 0.4f, 0.7f, 0.3f};
  EXPECT_EQ(plain[0].combined_topk_weights, w0);
  EXPECT_EQ(plain[1].combined_topk_weights, w1);

  // Biases are added once per token, also to the token that reached no rank.
  back[0].bias0 = std::vector<uint16_t>(4, ref::float_to_bf16(0.5f));
  back[0].bias1 = std::vector<uint16_t>(4, ref::float_to_bf16(0.25f));
  back[1].bias1 = {ref::float_to_bf16(1.0f), ref::float_to_bf16(-1.0f)};
  back[0].topk_weights.clear();
  back[1].topk_weights.clear();
  const auto biased = ref::normal_combine(back, dispatched, 1, 0);
  EXPECT_EQ(biased[0].combined_x, (std::vector<double>{9.75, 2.75, 16.75, 0.75}));
  EXPECT_EQ(biased[1].combined_x, (std::vector<double>{33.0, 67.0}));
  EXPECT_TRUE(biased[0].combined_topk_weights.empty());
}

TEST(ReferenceNormal, RowsForOneRankKeepEverythingElse) {
  const RandomCase c = make_random_case(3, 4, 16, 4, 256);
  const auto all = ref::normal_dispatch(c.inputs, random_params(c, 8));
  for (int only = 0; only < c.num_ranks; ++only) {
    ref::NormalDispatchParams params = random_params(c, 8);
    params.rows_for_rank = only;
    const auto some = ref::normal_dispatch(c.inputs, params);
    for (int dst = 0; dst < c.num_ranks; ++dst) {
      ASSERT_GT(all[dst].num_recv, 0);
      EXPECT_EQ(some[dst].num_recv, all[dst].num_recv);
      EXPECT_EQ(some[dst].recv_src_rank, all[dst].recv_src_rank);
      EXPECT_EQ(some[dst].recv_src_idx, all[dst].recv_src_idx);
      EXPECT_EQ(some[dst].recv_topk_idx, all[dst].recv_topk_idx);
      EXPECT_EQ(some[dst].recv_topk_weights, all[dst].recv_topk_weights);
      EXPECT_EQ(some[dst].num_recv_tokens_per_expert, all[dst].num_recv_tokens_per_expert);
      EXPECT_EQ(some[dst].rank_prefix_matrix, all[dst].rank_prefix_matrix);
      if (dst == only) {
        EXPECT_EQ(some[dst].recv_x, all[dst].recv_x);
      } else {
        EXPECT_TRUE(some[dst].recv_x.empty());
      }
    }
  }
  ref::NormalDispatchParams bad = random_params(c, 1);
  for (int rank : {-2, c.num_ranks}) {
    bad.rows_for_rank = rank;
    EXPECT_THROW(ref::normal_dispatch(c.inputs, bad), std::invalid_argument);
  }
}

TEST(ReferenceNormal, RandomDispatchMatchesLayout) {
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    const RandomCase c = make_random_case(seed, 4, 16, 4, 256);
    const int experts_per_rank = c.num_experts / c.num_ranks;
    const auto out = ref::normal_dispatch(c.inputs, random_params(c, 1));
    const auto aligned = ref::normal_dispatch(c.inputs, random_params(c, 8));
    const size_t row_bytes = 2 * static_cast<size_t>(c.hidden);
    for (int dst = 0; dst < c.num_ranks; ++dst) {
      const ref::NormalDispatchResult& d = out[dst];
      // Receive size = what the senders' layouts say they send to dst.
      int expected_recv = 0;
      for (int src = 0; src < c.num_ranks; ++src) expected_recv += c.layouts[src].num_tokens_per_rank[dst];
      EXPECT_EQ(d.num_recv, expected_recv);
      ASSERT_EQ(d.recv_x.size(), static_cast<size_t>(d.num_recv) * row_bytes);

      // Prefix matrix: rows step by each sender's count, the last row is num_recv.
      int32_t above = 0;
      for (int src = 0; src < c.num_ranks; ++src) {
        const int32_t here = d.rank_prefix_matrix[src * c.num_ranks + dst];
        EXPECT_GE(here, above);
        EXPECT_EQ(here - above, c.layouts[src].num_tokens_per_rank[dst]);
        above = here;
      }
      EXPECT_EQ(above, d.num_recv);
      EXPECT_EQ(d.rank_prefix_matrix, out[0].rank_prefix_matrix);

      // Rows in (source rank, source token) order carrying the source's bytes.
      for (int row = 0; row < d.num_recv; ++row) {
        const int src = d.recv_src_rank[row];
        const int tok = d.recv_src_idx[row];
        if (row > 0) {
          const bool ordered =
              d.recv_src_rank[row - 1] < src || (d.recv_src_rank[row - 1] == src && d.recv_src_idx[row - 1] < tok);
          ASSERT_TRUE(ordered) << "row " << row;
        }
        ASSERT_TRUE(c.inputs[src].is_token_in_rank[static_cast<size_t>(tok) * c.num_ranks + dst]);
        ASSERT_EQ(std::memcmp(&d.recv_x[row * row_bytes], &c.inputs[src].x[tok * row_bytes], row_bytes), 0);
        for (int k = 0; k < c.num_topk; ++k) {
          const int64_t global = c.topk[src][static_cast<size_t>(tok) * c.num_topk + k];
          const int64_t local = d.recv_topk_idx[static_cast<size_t>(row) * c.num_topk + k];
          const float weight = d.recv_topk_weights[static_cast<size_t>(row) * c.num_topk + k];
          if (global >= 0 && global / experts_per_rank == dst) {
            EXPECT_EQ(local, global - dst * experts_per_rank);
            EXPECT_EQ(weight, c.inputs[src].topk_weights[static_cast<size_t>(tok) * c.num_topk + k]);
          } else {
            EXPECT_EQ(local, -1);
            EXPECT_EQ(weight, 0.0f);
          }
        }
      }

      // Per-expert counts equal the senders' layout counts, then round up to 8.
      for (int l = 0; l < experts_per_rank; ++l) {
        int32_t expected = 0;
        for (int src = 0; src < c.num_ranks; ++src)
          expected += c.layouts[src].num_tokens_per_expert[dst * experts_per_rank + l];
        EXPECT_EQ(d.num_recv_tokens_per_expert[l], expected);
        EXPECT_EQ(aligned[dst].num_recv_tokens_per_expert[l], (expected + 7) / 8 * 8);
      }
    }
  }
}

TEST(ReferenceNormal, OneRanksCombineEqualsItsPartOfTheWhole) {
  const RandomCase c = make_random_case(21, 4, 16, 4, 128);
  const auto out = ref::normal_dispatch(c.inputs, random_params(c, 1));
  std::vector<ref::NormalCombineInput> back(c.num_ranks);
  for (int r = 0; r < c.num_ranks; ++r) {
    back[r].x = bytes_to_bf16(out[r].recv_x);
    back[r].topk_weights = out[r].recv_topk_weights;
    back[r].bias0.assign(static_cast<size_t>(out[r].num_tokens) * c.hidden, ref::float_to_bf16(0.5f + r));
  }
  const auto all = ref::normal_combine(back, out, c.hidden, c.num_topk);
  for (int only = 0; only < c.num_ranks; ++only) {
    const auto one = ref::normal_combine(back, out, c.hidden, c.num_topk, only);
    for (int s = 0; s < c.num_ranks; ++s) {
      if (s == only) {
        EXPECT_EQ(one[s].combined_x, all[s].combined_x) << "rank " << s;
        EXPECT_EQ(one[s].combined_topk_weights, all[s].combined_topk_weights) << "rank " << s;
        EXPECT_EQ(one[s].combined_x.size(), static_cast<size_t>(out[s].num_tokens) * c.hidden) << "rank " << s;
      } else {
        EXPECT_TRUE(one[s].combined_x.empty() && one[s].combined_topk_weights.empty()) << "rank " << s;
      }
    }
  }
  EXPECT_THROW(ref::normal_combine(back, out, c.hidden, c.num_topk, c.num_ranks), std::invalid_argument);
  EXPECT_THROW(ref::normal_combine(back, out, c.hidden, c.num_topk, -2), std::invalid_argument);
}

TEST(ReferenceNormal, RandomRoundTripSumsOncePerReachedRank) {
  for (uint32_t seed = 11; seed <= 14; ++seed) {
    const RandomCase c = make_random_case(seed, 4, 16, 4, 128);
    const auto out = ref::normal_dispatch(c.inputs, random_params(c, 1));
    const size_t h = static_cast<size_t>(c.hidden);

    // Every rank returns its received rows unchanged; a second run returns all ones.
    std::vector<ref::NormalCombineInput> same(c.num_ranks), ones(c.num_ranks);
    for (int r = 0; r < c.num_ranks; ++r) {
      same[r].x = bytes_to_bf16(out[r].recv_x);
      same[r].topk_weights = out[r].recv_topk_weights;
      ones[r].x.assign(static_cast<size_t>(out[r].num_recv) * h, ref::float_to_bf16(1.0f));
    }
    const auto combined = ref::normal_combine(same, out, c.hidden, c.num_topk);
    const auto counted = ref::normal_combine(ones, out, c.hidden, 0);

    for (int s = 0; s < c.num_ranks; ++s) {
      const std::vector<uint16_t> x = bytes_to_bf16(c.inputs[s].x);
      ASSERT_EQ(combined[s].combined_x.size(), x.size());
      for (int t = 0; t < c.inputs[s].num_tokens; ++t) {
        int reached = 0;
        for (int r = 0; r < c.num_ranks; ++r)
          reached += c.inputs[s].is_token_in_rank[static_cast<size_t>(t) * c.num_ranks + r];
        for (size_t i = t * h; i < (t + 1) * h; ++i) {
          ASSERT_EQ(counted[s].combined_x[i], static_cast<double>(reached));
          ASSERT_EQ(combined[s].combined_x[i], reached * static_cast<double>(ref::bf16_to_float(x[i])));
          // One receiver: the round trip gives back the very same bf16 bits.
          if (reached == 1) {
            ASSERT_EQ(ref::double_to_bf16(combined[s].combined_x[i]), x[i]);
          }
        }
        for (int k = 0; k < c.num_topk; ++k) {
          const size_t slot = static_cast<size_t>(t) * c.num_topk + k;
          const double expected = c.topk[s][slot] < 0 ? 0.0 : c.inputs[s].topk_weights[slot];
          ASSERT_EQ(combined[s].combined_topk_weights[slot], expected);
        }
      }
    }
    EXPECT_TRUE(combined[1].combined_x.empty());  // the rank with no tokens
  }
}

TEST(ReferenceNormal, AllTokensToOneExpert) {
  std::vector<ref::NormalDispatchInput> in(4);
  for (int r = 0; r < 4; ++r) {
    in[r].num_tokens = 5;
    in[r].x.assign(5, static_cast<uint8_t>(r));
    in[r].topk_idx.assign(10, -1);
    for (int t = 0; t < 5; ++t) in[r].topk_idx[t * 2] = 6;  // expert 6 lives on rank 3
    in[r].topk_weights.assign(10, 1.0f);
    in[r].is_token_in_rank = ref::get_dispatch_layout(in[r].topk_idx, 5, 2, 4, 8, 4).is_token_in_rank;
  }
  const auto out = ref::normal_dispatch(in, {.row_bytes = 1, .num_topk = 2, .num_experts = 8});
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(out[r].num_recv, 0);
    EXPECT_EQ(out[r].num_recv_tokens_per_expert, (std::vector<int32_t>{0, 0}));
  }
  EXPECT_EQ(out[3].num_recv, 20);
  EXPECT_EQ(out[3].num_recv_tokens_per_expert, (std::vector<int32_t>{20, 0}));
  EXPECT_EQ(out[3].rank_prefix_matrix, (std::vector<int32_t>{0, 0, 0, 5, 0, 0, 0, 10, 0, 0, 0, 15, 0, 0, 0, 20}));
}

TEST(ReferenceNormal, BadInputThrows) {
  const auto params = hand_params(1);
  auto with = [](auto edit) {
    std::vector<ref::NormalDispatchInput> in = hand_inputs();
    edit(in);
    return in;
  };
  expect_invalid_argument([&] { ref::normal_dispatch(with([](auto& in) { in[1].topk_idx[0] = 4; }), params); },
                          "ranks[1].topk_idx");
  expect_invalid_argument([&] { ref::normal_dispatch(with([](auto& in) { in[0].is_token_in_rank[2] = 2; }), params); },
                          "ranks[0].is_token_in_rank");
  expect_invalid_argument([&] { ref::normal_dispatch(with([](auto& in) { in[0].x.pop_back(); }), params); },
                          "ranks[0].x:");
  expect_invalid_argument([&] { ref::normal_dispatch(with([](auto& in) { in[1].topk_weights.pop_back(); }), params); },
                          "ranks[1].topk_weights");
  expect_invalid_argument([&] { ref::normal_dispatch(with([](auto& in) { in[1].x_scales.clear(); }), params); },
                          "ranks[1].x_scales");
  expect_invalid_argument(
      [&] { ref::normal_dispatch(with([](auto& in) { in[0].is_token_in_rank.pop_back(); }), params); },
      "ranks[0].is_token_in_rank");
  expect_invalid_argument([&] { ref::normal_dispatch(hand_inputs(), hand_params(0)); }, "expert_alignment");
  expect_invalid_argument(
      [&] {
        auto p = hand_params(1);
        p.num_experts = 5;
        ref::normal_dispatch(hand_inputs(), p);
      },
      "num_experts");
  expect_invalid_argument([&] { ref::normal_dispatch({}, params); }, "ranks");

  const auto dispatched = ref::normal_dispatch(hand_inputs(), params);
  std::vector<ref::NormalCombineInput> back(2);
  back[0].x.assign(3, 0);
  back[1].x.assign(4, 0);
  EXPECT_NO_THROW(ref::normal_combine(back, dispatched, 1, 0));
  expect_invalid_argument([&] { ref::normal_combine(back, dispatched, 2, 0); }, "ranks[0].x:");
  expect_invalid_argument([&] { ref::normal_combine(back, dispatched, 1, 2); }, "ranks[0].topk_weights");
  expect_invalid_argument([&] { ref::normal_combine(back, std::span(dispatched).first(1), 1, 0); }, "dispatch");
  back[1].bias0.assign(3, 0);
  expect_invalid_argument([&] { ref::normal_combine(back, dispatched, 1, 0); }, "ranks[1].bias0");
}
