// Internode normal mode of the host reference: a four-rank case (two domains of two)
// written out by hand, then properties on random and skewed routings over domain
// sizes 1 to 8 and 2 to 32 domains, checked against get_dispatch_layout, the
// intranode reference, and a replay of the two-level path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "expect_invalid_argument.hpp"
#include "internode_cases.hpp"
#include "reference.hpp"

namespace ref = turnout::reference;

namespace {

using namespace turnout::internode_cases;

// Every property the tests check of one dispatch.
void check_dispatch(const Case& c, int num_channels) {
  const int R = c.num_ranks, D = c.nvl, N = c.num_domains(), C = num_channels;
  const auto out = ref::internode_dispatch(c.inputs, c.params(), {.num_nvl_ranks = D, .num_channels = C});
  const auto intranode = ref::normal_dispatch(c.inputs, c.params());
  ASSERT_EQ(out.size(), static_cast<size_t>(R));

  // (receiver, source, token) -> the mask the forwarder carried, replaying the two-level path.
  std::map<std::tuple<int, int, int>, uint32_t> delivered;
  for (int r = 0; r < R; ++r) {
    const ref::InternodeDispatchResult& d = out[r];
    const int domain = r / D, local = r % D;
    SCOPED_TRACE("rank " + std::to_string(r) + " of " + std::to_string(R) + ", D = " + std::to_string(D));

    // The user-visible outputs are intranode's.
    EXPECT_EQ(d.normal.recv_x, intranode[r].recv_x);
    EXPECT_EQ(d.normal.recv_topk_idx, intranode[r].recv_topk_idx);
    EXPECT_EQ(d.normal.num_recv_tokens_per_expert, intranode[r].num_recv_tokens_per_expert);
    EXPECT_EQ(d.is_token_in_rank, c.inputs[r].is_token_in_rank);

    // [6] is column r of rank_prefix_matrix; [4] steps by the peers' layouts.
    ASSERT_EQ(d.recv_gbl_rank_prefix_sum.size(), static_cast<size_t>(R));
    for (int src = 0; src < R; ++src)
      EXPECT_EQ(d.recv_gbl_rank_prefix_sum[src], d.normal.rank_prefix_matrix[static_cast<size_t>(src) * R + r]);
    ASSERT_EQ(d.recv_rdma_rank_prefix_sum.size(), static_cast<size_t>(N));
    int32_t above = 0;
    for (int s = 0; s < N; ++s) {
      EXPECT_EQ(d.recv_rdma_rank_prefix_sum[s] - above, c.layouts[s * D + local].num_tokens_per_rdma_rank[domain]);
      above = d.recv_rdma_rank_prefix_sum[s];
    }
    EXPECT_EQ(d.num_forward, above);

    // The forwarded tokens, in (source domain, token) order, carry their masks in this domain.
    ASSERT_EQ(d.forward_src_idx.size(), static_cast<size_t>(d.num_forward));
    for (int i = 0; i < d.num_forward; ++i) {
      const int s = d.forward_src_domain[i], t = d.forward_src_idx[i], src = s * D + local;
      if (i > 0) {
        const bool ordered =
            d.forward_src_domain[i - 1] < s || (d.forward_src_domain[i - 1] == s && d.forward_src_idx[i - 1] < t);
        ASSERT_TRUE(ordered) << "forward " << i;
      }
      ASSERT_NE(d.forward_nvl_mask[i], 0u);
      for (int j = 0; j < D; ++j) {
        const bool bit = d.forward_nvl_mask[i] >> j & 1;
        ASSERT_EQ(bit, in_rank(c, src, t, domain * D + j)) << "forward " << i << " local rank " << j;
        if (bit) ASSERT_TRUE(delivered.emplace(std::make_tuple(domain * D + j, src, t), d.forward_nvl_mask[i]).second);
      }
    }

    // recv_nvl_mask: the source token's ranks in this domain.
    ASSERT_EQ(d.recv_nvl_mask.size(), static_cast<size_t>(d.normal.num_recv));
    for (int row = 0; row < d.normal.num_recv; ++row) {
      uint32_t mask = 0;
      for (int j = 0; j < D; ++j)
        mask |= in_rank(c, d.normal.recv_src_rank[row], d.normal.recv_src_idx[row], domain * D + j) << j;
      EXPECT_EQ(d.recv_nvl_mask[row], mask) << "row " << row;
      EXPECT_TRUE(mask >> local & 1) << "row " << row;
    }

    if (C == 0) {
      EXPECT_TRUE(d.rdma_channel_prefix_matrix.empty() && d.send_nvl_head.empty() && d.send_rdma_head.empty());
      continue;
    }
    const ref::DispatchLayout& mine = c.layouts[r];
    const int T = c.inputs[r].num_tokens;
    for (int e = 0; e < N; ++e)
      EXPECT_EQ(d.rdma_channel_prefix_matrix[static_cast<size_t>(e) * C + C - 1], mine.num_tokens_per_rdma_rank[e]);
    for (int j = 0; j < R; ++j)
      EXPECT_EQ(d.gbl_channel_prefix_matrix[static_cast<size_t>(j) * C + C - 1], mine.num_tokens_per_rank[j]);
    // [8]: 0, 1, 2... down each (channel, domain) stream, -1 off it.
    std::vector<int32_t> stream(static_cast<size_t>(C) * N, 0);
    for (int t = 0; t < T; ++t) {
      const int channel = channel_of(t, T, C);
      for (int e = 0; e < N; ++e) {
        bool reaches = false;
        for (int j = 0; j < D; ++j) reaches |= in_rank(c, r, t, e * D + j);
        const int32_t head = d.send_rdma_head[static_cast<size_t>(t) * N + e];
        ASSERT_EQ(head, reaches ? stream[static_cast<size_t>(channel) * N + e]++ : -1) << "token " << t;
      }
    }
    for (int e = 0; e < N; ++e)
      for (int ch = 0; ch < C; ++ch) {
        const int32_t prefix = d.rdma_channel_prefix_matrix[static_cast<size_t>(e) * C + ch];
        const int32_t before = ch == 0 ? 0 : d.rdma_channel_prefix_matrix[static_cast<size_t>(e) * C + ch - 1];
        EXPECT_EQ(prefix - before, stream[static_cast<size_t>(ch) * N + e]);
      }
    // [3] ends where [4] steps; [5] places every row.
    for (int s = 0; s < N; ++s)
      EXPECT_EQ(d.recv_rdma_channel_prefix_matrix[static_cast<size_t>(s) * C + C - 1],
                d.recv_rdma_rank_prefix_sum[s] - (s == 0 ? 0 : d.recv_rdma_rank_prefix_sum[s - 1]));
    std::vector<int32_t> placed(static_cast<size_t>(R) * C, 0);
    for (int row = 0; row < d.normal.num_recv; ++row) {
      const int src = d.normal.recv_src_rank[row], t = d.normal.recv_src_idx[row];
      const size_t at = static_cast<size_t>(src) * C + channel_of(t, c.inputs[src].num_tokens, C);
      ASSERT_EQ(row, d.recv_gbl_channel_prefix_matrix[at] + placed[at]++) << "row " << row;
    }
    // [9]: each (channel, local rank) stream numbered 0, 1, 2... in forward order.
    std::vector<int32_t> nvl_stream(static_cast<size_t>(C) * D, 0);
    for (int i = 0; i < d.num_forward; ++i) {
      const int src = d.forward_src_domain[i] * D + local;
      const int channel = channel_of(d.forward_src_idx[i], c.inputs[src].num_tokens, C);
      for (int j = 0; j < D; ++j) {
        const int32_t head = d.send_nvl_head[static_cast<size_t>(i) * D + j];
        ASSERT_EQ(head, (d.forward_nvl_mask[i] >> j & 1) ? nvl_stream[static_cast<size_t>(channel) * D + j]++ : -1);
      }
    }
  }
  // The forwarders delivered every row once, and nothing else.
  size_t rows = 0;
  for (int r = 0; r < R; ++r) {
    rows += static_cast<size_t>(out[r].normal.num_recv);
    for (int row = 0; row < out[r].normal.num_recv; ++row)
      EXPECT_EQ(delivered.count({r, out[r].normal.recv_src_rank[row], out[r].normal.recv_src_idx[row]}), 1u);
  }
  EXPECT_EQ(delivered.size(), rows);
}

// Two-level combine against intranode's, exact and with remote partials rounded.
void check_combine(const Case& c) {
  const auto out = ref::internode_dispatch(c.inputs, c.params(), {.num_nvl_ranks = c.nvl});
  std::vector<ref::NormalDispatchResult> normal;
  for (const auto& d : out) normal.push_back(d.normal);
  const auto back = echo(out, c.hidden);
  const auto want = ref::normal_combine(back, normal, c.hidden, c.num_topk);
  const auto exact = ref::internode_combine(back, out, c.hidden, c.num_topk, false);
  const auto rounded = ref::internode_combine(back, out, c.hidden, c.num_topk, true);
  const size_t h = static_cast<size_t>(c.hidden);
  for (int s = 0; s < c.num_ranks; ++s) {
    SCOPED_TRACE("source rank " + std::to_string(s) + ", D = " + std::to_string(c.nvl));
    EXPECT_EQ(exact[s].combined_x, want[s].combined_x);
    EXPECT_EQ(exact[s].combined_topk_weights, want[s].combined_topk_weights);
    EXPECT_EQ(rounded[s].combined_topk_weights, want[s].combined_topk_weights);
    // One domain, or domains of one rank: no partial sum to round.
    if (c.nvl == c.num_ranks || c.nvl == 1) EXPECT_EQ(rounded[s].combined_x, want[s].combined_x);
    // Each rounding moves a partial by at most half a bf16 step, 2^-8 of it.
    const std::vector<uint16_t> x = bytes_to_bf16(c.inputs[s].x);
    for (int t = 0; t < c.inputs[s].num_tokens; ++t) {
      int reached = 0;
      for (int r = 0; r < c.num_ranks; ++r) reached += in_rank(c, s, t, r);
      for (size_t i = t * h; i < (t + 1) * h; ++i) {
        const double bound = reached * std::fabs(ref::bf16_to_float(x[i])) * std::ldexp(1.0, -8);
        ASSERT_LE(std::fabs(rounded[s].combined_x[i] - want[s].combined_x[i]), bound) << "token " << t;
      }
    }
  }
  const int only = c.num_ranks - 1;
  const auto one = ref::internode_combine(back, out, c.hidden, c.num_topk, true, only);
  EXPECT_EQ(one[only].combined_x, rounded[only].combined_x);
  EXPECT_TRUE(one[0].combined_x.empty());
}

}  // namespace

TEST(ReferenceInternodeDispatch, FourRanksTwoDomainsByHand) {
  const auto out = ref::internode_dispatch(hand_inputs(), kHandParams, {.num_nvl_ranks = 2, .num_channels = 2});
  ASSERT_EQ(out.size(), 4u);

  // Rows by source rank, then token: the values 10 r + t name them.
  EXPECT_EQ(out[0].normal.recv_x, (std::vector<uint8_t>{0, 12, 21}));
  EXPECT_EQ(out[1].normal.recv_x, (std::vector<uint8_t>{2, 12, 20}));
  EXPECT_EQ(out[2].normal.recv_x, (std::vector<uint8_t>{1, 10, 22}));
  EXPECT_EQ(out[3].normal.recv_x, (std::vector<uint8_t>{0, 10, 21}));
  EXPECT_EQ(out[3].normal.recv_x_scales, (std::vector<float>{0.0f, 100.0f, 201.0f}));
  // Rank 3's experts are 6 and 7: r0.t0 names 6 in slot 1, r1.t0 7 in slot 0, r2.t1 6 in slot 0.
  EXPECT_EQ(out[3].normal.recv_topk_idx, (std::vector<int64_t>{-1, 0, 1, -1, 0, -1}));
  EXPECT_EQ(out[3].normal.recv_topk_weights, (std::vector<float>{0.0f, 0.25f, 1.5f, 0.0f, 3.5f, 0.0f}));
  EXPECT_EQ(out[3].normal.num_recv_tokens_per_expert, (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(out[3].normal.num_tokens, 0);

  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(out[r].recv_gbl_rank_prefix_sum, (std::vector<int32_t>{1, 2, 3, 3})) << r;
    EXPECT_EQ(out[r].is_token_in_rank, hand_inputs()[r].is_token_in_rank) << r;
  }
  // Bits of the receiving domain's local ranks each row's token reached.
  EXPECT_EQ(out[0].recv_nvl_mask, (std::vector<uint32_t>{1, 3, 1}));
  EXPECT_EQ(out[1].recv_nvl_mask, (std::vector<uint32_t>{2, 3, 2}));
  EXPECT_EQ(out[2].recv_nvl_mask, (std::vector<uint32_t>{1, 3, 1}));
  EXPECT_EQ(out[3].recv_nvl_mask, (std::vector<uint32_t>{2, 3, 2}));

  // Rank 0 forwards from ranks 0 (domain 0) and 2 (domain 1) what reaches domain 0.
  EXPECT_EQ(out[0].num_forward, 4);
  EXPECT_EQ(out[0].recv_rdma_rank_prefix_sum, (std::vector<int32_t>{2, 4}));
  EXPECT_EQ(out[0].forward_src_domain, (std::vector<int32_t>{0, 0, 1, 1}));
  EXPECT_EQ(out[0].forward_src_idx, (std::vector<int32_t>{0, 2, 0, 1}));
  EXPECT_EQ(out[0].forward_nvl_mask, (std::vector<uint32_t>{1, 2, 2, 1}));
  // Rank 1 forwards r1.t2 to both ranks of domain 0; rank 3 sent nothing.
  EXPECT_EQ(out[1].recv_rdma_rank_prefix_sum, (std::vector<int32_t>{1, 1}));
  EXPECT_EQ(out[1].forward_src_idx, (std::vector<int32_t>{2}));
  EXPECT_EQ(out[1].forward_nvl_mask, (std::vector<uint32_t>{3}));
  EXPECT_EQ(out[2].recv_rdma_rank_prefix_sum, (std::vector<int32_t>{2, 4}));
  EXPECT_EQ(out[2].forward_src_domain, (std::vector<int32_t>{0, 0, 1, 1}));
  EXPECT_EQ(out[2].forward_src_idx, (std::vector<int32_t>{0, 1, 1, 2}));
  EXPECT_EQ(out[2].forward_nvl_mask, (std::vector<uint32_t>{2, 1, 2, 1}));
  EXPECT_EQ(out[3].recv_rdma_rank_prefix_sum, (std::vector<int32_t>{1, 1}));
  EXPECT_EQ(out[3].forward_nvl_mask, (std::vector<uint32_t>{3}));

  // Channels of 3 tokens: c0 = {t0}, c1 = {t1, t2}.
  EXPECT_EQ(out[0].rdma_channel_prefix_matrix, (std::vector<int32_t>{1, 2, 1, 2}));
  EXPECT_EQ(out[1].rdma_channel_prefix_matrix, (std::vector<int32_t>{0, 1, 1, 1}));
  EXPECT_EQ(out[2].rdma_channel_prefix_matrix, (std::vector<int32_t>{1, 2, 0, 2}));
  EXPECT_EQ(out[3].rdma_channel_prefix_matrix, (std::vector<int32_t>(4, 0)));
  EXPECT_EQ(out[0].gbl_channel_prefix_matrix, (std::vector<int32_t>{1, 1, 0, 1, 0, 1, 1, 1}));
  EXPECT_EQ(out[1].gbl_channel_prefix_matrix, (std::vector<int32_t>{0, 1, 0, 1, 1, 1, 1, 1}));
  EXPECT_EQ(out[2].gbl_channel_prefix_matrix, (std::vector<int32_t>{0, 1, 1, 1, 0, 1, 0, 1}));
  EXPECT_EQ(out[0].send_rdma_head, (std::vector<int32_t>{0, 0, -1, 0, 0, -1}));
  EXPECT_EQ(out[1].send_rdma_head, (std::vector<int32_t>{-1, 0, -1, -1, 0, -1}));
  EXPECT_EQ(out[2].send_rdma_head, (std::vector<int32_t>{0, -1, 0, 0, -1, 1}));
  EXPECT_TRUE(out[3].send_rdma_head.empty());
  EXPECT_EQ(out[0].recv_rdma_channel_prefix_matrix, (std::vector<int32_t>{1, 2, 1, 2}));
  EXPECT_EQ(out[1].recv_rdma_channel_prefix_matrix, (std::vector<int32_t>{0, 1, 0, 0}));
  EXPECT_EQ(out[2].recv_rdma_channel_prefix_matrix, (std::vector<int32_t>{1, 2, 0, 2}));
  EXPECT_EQ(out[3].recv_rdma_channel_prefix_matrix, (std::vector<int32_t>{1, 1, 0, 0}));
  EXPECT_EQ(out[0].recv_gbl_channel_prefix_matrix, (std::vector<int32_t>{0, 1, 1, 1, 2, 2, 3, 3}));
  EXPECT_EQ(out[1].recv_gbl_channel_prefix_matrix, (std::vector<int32_t>{0, 0, 1, 1, 2, 3, 3, 3}));
  EXPECT_EQ(out[2].recv_gbl_channel_prefix_matrix, (std::vector<int32_t>{0, 0, 1, 2, 2, 2, 3, 3}));
  EXPECT_EQ(out[3].recv_gbl_channel_prefix_matrix, (std::vector<int32_t>{0, 1, 1, 2, 2, 2, 3, 3}));
  EXPECT_EQ(out[0].send_nvl_head, (std::vector<int32_t>{0, -1, -1, 0, -1, 0, 0, -1}));
  EXPECT_EQ(out[1].send_nvl_head, (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(out[2].send_nvl_head, (std::vector<int32_t>{-1, 0, 0, -1, -1, 0, 1, -1}));
  EXPECT_EQ(out[3].send_nvl_head, (std::vector<int32_t>{0, 0}));

  // One channel: rank 0's streams to its local ranks run across both source domains.
  const auto one = ref::internode_dispatch(hand_inputs(), kHandParams, {.num_nvl_ranks = 2, .num_channels = 1});
  EXPECT_EQ(one[0].send_nvl_head, (std::vector<int32_t>{0, -1, -1, 0, -1, 1, 1, -1}));
  EXPECT_EQ(one[0].rdma_channel_prefix_matrix, (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(one[0].recv_gbl_channel_prefix_matrix, (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(ReferenceInternodeDispatch, HandLayoutPerDomain) {
  const auto in = hand_inputs();
  const ref::DispatchLayout l0 = ref::get_dispatch_layout(in[0].topk_idx, 3, 2, 4, 8, 2);
  EXPECT_EQ(l0.num_tokens_per_rank, (std::vector<int32_t>{1, 1, 1, 1}));
  EXPECT_EQ(l0.num_tokens_per_rdma_rank, (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(l0.num_tokens_per_expert, (std::vector<int32_t>{0, 1, 0, 1, 1, 1, 1, 0}));
  // r1.t0 reaches both ranks of domain 1 and counts once there; r1.t1 reaches nothing.
  const ref::DispatchLayout l1 = ref::get_dispatch_layout(in[1].topk_idx, 3, 2, 4, 8, 2);
  EXPECT_EQ(l1.num_tokens_per_rank, (std::vector<int32_t>{1, 1, 1, 1}));
  EXPECT_EQ(l1.num_tokens_per_rdma_rank, (std::vector<int32_t>{1, 1}));
  // r2.t0 names expert 2 twice: once for the expert and once for rank 1.
  const ref::DispatchLayout l2 = ref::get_dispatch_layout(in[2].topk_idx, 3, 2, 4, 8, 2);
  EXPECT_EQ(l2.num_tokens_per_rank, (std::vector<int32_t>{1, 1, 1, 1}));
  EXPECT_EQ(l2.num_tokens_per_rdma_rank, (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(l2.num_tokens_per_expert, (std::vector<int32_t>{1, 0, 1, 0, 0, 1, 1, 0}));
}

TEST(ReferenceInternodeCombine, FourRanksTwoDomainsByHand) {
  const auto out = ref::internode_dispatch(hand_inputs(), kHandParams, {.num_nvl_ranks = 2});
  // hidden = 1. Powers of two name the rows, except two pairs: r1.t0 comes back from
  // ranks 2 and 3 (domain 1, remote to rank 1) as 1 and 2^-9, r1.t2 from ranks 0 and 1
  // (domain 0, rank 1's own) as the same two values.
  const float tiny = std::ldexp(1.0f, -9);
  std::vector<ref::NormalCombineInput> back(4);
  back[0].x = {bf(1), bf(1), bf(4)};          // rows r0.t0, r1.t2, r2.t1
  back[1].x = {bf(8), bf(tiny), bf(32)};      // r0.t2, r1.t2, r2.t0
  back[2].x = {bf(64), bf(1), bf(256)};       // r0.t1, r1.t0, r2.t2
  back[3].x = {bf(512), bf(tiny), bf(2048)};  // r0.t0, r1.t0, r2.t1
  for (int r = 0; r < 4; ++r) back[r].topk_weights = out[r].normal.recv_topk_weights;

  const auto exact = ref::internode_combine(back, out, 1, 2, false);
  EXPECT_EQ(exact[0].combined_x, (std::vector<double>{513, 64, 8}));
  EXPECT_EQ(exact[1].combined_x, (std::vector<double>{1 + tiny, 0, 1 + tiny}));
  EXPECT_EQ(exact[2].combined_x, (std::vector<double>{32, 2052, 256}));
  EXPECT_TRUE(exact[3].combined_x.empty());
  // Each slot's weight comes back from its expert's rank alone; -1 slots give 0.
  EXPECT_EQ(exact[0].combined_topk_weights, (std::vector<double>{0.5, 0.25, 1.5, 1.25, 0, 2.25}));
  EXPECT_EQ(exact[1].combined_topk_weights, (std::vector<double>{1.5, 1.25, 0, 0, 3.5, 3.25}));
  EXPECT_EQ(exact[2].combined_topk_weights, (std::vector<double>{2.5, 2.25, 3.5, 3.25, 4.5, 0}));

  // Rounded: domain 1's partial of r1.t0 crosses as bf16 (1 + 2^-9 -> 1); domain 0's of
  // r1.t2 stays exact on rank 1. Weights never round.
  const auto rounded = ref::internode_combine(back, out, 1, 2, true);
  EXPECT_EQ(rounded[1].combined_x, (std::vector<double>{1, 0, 1 + tiny}));
  EXPECT_EQ(rounded[0].combined_x, exact[0].combined_x);
  EXPECT_EQ(rounded[2].combined_x, exact[2].combined_x);
  EXPECT_EQ(rounded[1].combined_topk_weights, exact[1].combined_topk_weights);

  // Biases once per token, the token that reached nothing included.
  back[1].bias0 = {bf(0.5f), bf(0.5f), bf(0.5f)};
  back[1].bias1 = {bf(2), bf(-1), bf(0)};
  const auto biased = ref::internode_combine(back, out, 1, 2, true, 1);
  EXPECT_EQ(biased[1].combined_x, (std::vector<double>{3.5, -0.5, 1.5 + tiny}));
  EXPECT_TRUE(biased[0].combined_x.empty());
}

TEST(ReferenceInternodeWire, FourRanksTwoDomainsByHand) {
  // H = 128 bf16 rows, K = 2: turnout 256 + 2 x 16 + 16 = 304 bytes a token, DeepEP
  // align16(256 + 8 + 16) = 288; back 256 + 16 = 272 either way.
  EXPECT_EQ(ref::turnout_dispatch_token_bytes(256, 0, 2), 304);
  EXPECT_EQ(ref::deepep_dispatch_token_bytes(256, 0, 2), 288);
  EXPECT_EQ(ref::turnout_combine_token_bytes(128, 2), 272);
  EXPECT_EQ(ref::deepep_combine_token_bytes(128, 2), 272);
  // FP8 at H = 7168, K = 8: both protocols take 7472 bytes a token.
  EXPECT_EQ(ref::turnout_dispatch_token_bytes(7168, 56, 8), 7472);
  EXPECT_EQ(ref::deepep_dispatch_token_bytes(7168, 56, 8), 7472);

  const ref::InternodeWireParams p = {
      .row_bytes = 256, .num_topk = 2, .hidden = 128, .num_nvl_ranks = 2, .num_channels = 1, .chunk_tokens = 64};
  const auto w = ref::internode_wire(hand_inputs(), p);
  // Across domains: r0.t0 -> rank 3, r0.t1 -> rank 2; r1.t0 -> ranks 2 and 3;
  // r2.t0 -> rank 1, r2.t1 -> rank 0.
  const int64_t domain_pairs[] = {2, 1, 2, 0}, rank_pairs[] = {2, 2, 2, 0};
  // Dispatch puts: one stream to the other domain; per rank one stream per rank reached.
  const int64_t per_rank_puts[] = {2, 2, 2, 0};
  // Combine: what each rank forwarded from the other domain goes back (rank 0: r2.t0
  // and r2.t1; rank 2: r0.t0, r0.t1; rank 3: r1.t0); per rank, the rows received from it.
  const int64_t forwarded[] = {2, 0, 2, 1}, rows_from_remote[] = {1, 1, 2, 2};
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(w[r].token_domain_pairs, domain_pairs[r]);
    EXPECT_EQ(w[r].token_rank_pairs, rank_pairs[r]);
    EXPECT_EQ(w[r].dispatch_turnout.bytes, domain_pairs[r] * 304);
    EXPECT_EQ(w[r].dispatch_deepep.bytes, domain_pairs[r] * 288);
    EXPECT_EQ(w[r].dispatch_per_rank.bytes, rank_pairs[r] * 304);
    EXPECT_EQ(w[r].dispatch_turnout.messages, domain_pairs[r] > 0 ? 1 : 0);
    EXPECT_EQ(w[r].dispatch_deepep.messages, domain_pairs[r] > 0 ? 1 : 0);
    EXPECT_EQ(w[r].dispatch_per_rank.messages, per_rank_puts[r]);
    EXPECT_EQ(w[r].combine_turnout.bytes, forwarded[r] * 272);
    EXPECT_EQ(w[r].combine_deepep.bytes, forwarded[r] * 272);
    EXPECT_EQ(w[r].combine_per_rank.bytes, rows_from_remote[r] * 272);
    EXPECT_EQ(w[r].combine_turnout.messages, forwarded[r] > 0 ? 1 : 0);
  }
  // One token a put: a put per token.
  auto small = p;
  small.chunk_tokens = 1;
  const auto w1 = ref::internode_wire(hand_inputs(), small);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(w1[r].dispatch_turnout.messages, domain_pairs[r]);
    EXPECT_EQ(w1[r].dispatch_per_rank.messages, rank_pairs[r]);
    EXPECT_EQ(w1[r].combine_per_rank.messages, rows_from_remote[r]);
  }
}

TEST(ReferenceInternode, EmptyDomainSendsAndReceivesNothing) {
  // Three domains of two; domain 1 (ranks 2, 3) has no tokens and no experts routed to.
  const Case c = make_case(5, 3, 2, Routing::kEmptyDomain);
  const auto out = ref::internode_dispatch(c.inputs, c.params(), {.num_nvl_ranks = 2, .num_channels = 3});
  for (int r = 2; r < 4; ++r) {
    EXPECT_EQ(out[r].normal.num_recv, 0);
    EXPECT_EQ(out[r].num_forward, 0);
    EXPECT_EQ(out[r].recv_rdma_rank_prefix_sum, (std::vector<int32_t>(3, 0)));
    EXPECT_EQ(out[r].recv_rdma_channel_prefix_matrix, (std::vector<int32_t>(9, 0)));
    EXPECT_TRUE(out[r].send_nvl_head.empty());
  }
  for (int r = 0; r < 6; ++r)
    for (int ch = 0; ch < 3; ++ch) EXPECT_EQ(out[r].rdma_channel_prefix_matrix[3 + ch], 0) << "rank " << r;
  check_dispatch(c, 3);
  check_combine(c);
  const auto w = ref::internode_wire(c.inputs, {.row_bytes = 16, .hidden = 8, .num_nvl_ranks = 2});
  for (int r = 2; r < 4; ++r) {
    EXPECT_EQ(w[r].dispatch_turnout.bytes + w[r].combine_turnout.bytes + w[r].combine_per_rank.bytes, 0);
  }
}

TEST(ReferenceInternode, OneDomainIsIntranode) {
  // D = R: one forwarder per rank (itself), no network, combine exact even when rounded.
  for (int num_ranks : {2, 4, 8}) {
    const Case c = make_case(40 + num_ranks, 1, num_ranks, Routing::kUniform);
    const auto out = ref::internode_dispatch(c.inputs, c.params(8), {.num_nvl_ranks = num_ranks, .num_channels = 4});
    const auto intranode = ref::normal_dispatch(c.inputs, c.params(8));
    for (int r = 0; r < num_ranks; ++r) {
      EXPECT_EQ(out[r].normal.recv_x, intranode[r].recv_x);
      EXPECT_EQ(out[r].normal.recv_x_scales, intranode[r].recv_x_scales);
      EXPECT_EQ(out[r].normal.recv_topk_weights, intranode[r].recv_topk_weights);
      EXPECT_EQ(out[r].normal.recv_src_idx, intranode[r].recv_src_idx);
      EXPECT_EQ(out[r].normal.num_recv_tokens_per_expert, intranode[r].num_recv_tokens_per_expert);
      EXPECT_EQ(out[r].normal.rank_prefix_matrix, intranode[r].rank_prefix_matrix);
      // The single domain's forwarder of rank r is r: its own tokens that go anywhere.
      EXPECT_EQ(out[r].recv_rdma_rank_prefix_sum, (std::vector<int32_t>{c.layouts[r].num_tokens_per_rdma_rank[0]}));
      for (int i = 0; i < out[r].num_forward; ++i) EXPECT_EQ(out[r].forward_src_domain[i], 0);
    }
    check_dispatch(c, 4);
    check_combine(c);
    for (const ref::InternodeWire& w :
         ref::internode_wire(c.inputs, {.row_bytes = 16, .hidden = 8, .num_nvl_ranks = num_ranks})) {
      EXPECT_EQ(w.token_domain_pairs + w.token_rank_pairs, 0);
      EXPECT_EQ(w.dispatch_turnout.bytes + w.dispatch_deepep.bytes + w.combine_per_rank.bytes, 0);
    }
  }
}

TEST(ReferenceInternode, RandomRoutingsAcrossDomainShapes) {
  // Domain sizes 1, 2, 4, 8 with 2 to 32 domains; several routings each.
  const std::pair<int, int> shapes[] = {{1, 2}, {1, 5}, {1, 32}, {2, 2}, {2, 3}, {2, 16}, {4, 2},
                                        {4, 4}, {4, 8}, {8, 2},  {8, 3}, {8, 4}, {8, 32}};
  uint32_t seed = 100;
  for (const auto& [nvl, domains] : shapes) {
    for (Routing routing : {Routing::kUniform, Routing::kSkewed, Routing::kOneRank, Routing::kLocalDomain}) {
      const int max_tokens = nvl * domains > 64 ? 6 : 24;
      const Case c = make_case(++seed, domains, nvl, routing, max_tokens, nvl * domains > 64 ? 8 : 4);
      SCOPED_TRACE("D = " + std::to_string(nvl) + ", domains = " + std::to_string(domains) + ", routing " +
                   std::to_string(static_cast<int>(routing)));
      check_dispatch(c, 3);
      if (::testing::Test::HasFatalFailure()) return;
      check_combine(c);
    }
  }
}

TEST(ReferenceInternode, TopkOf32AndMaxTokens) {
  // Top-k 32 over 4 domains of 8; then 4096 tokens a rank over 2 domains of 8, in
  // more channels than some ranks have tokens for.
  const Case wide = make_case(7, 4, 8, Routing::kUniform, 20, 32);
  check_dispatch(wide, 5);
  check_combine(wide);
  const Case big = make_case(8, 2, 8, Routing::kSkewed, 4096, 8);
  check_dispatch(big, 24);
  check_combine(big);
  Case few = make_case(9, 2, 2, Routing::kUniform, 3);
  check_dispatch(few, 12);
}

TEST(ReferenceInternodeWire, RandomRoutingsBalance) {
  for (const auto& [nvl, domains] :
       {std::pair{1, 4}, std::pair{2, 8}, std::pair{4, 4}, std::pair{8, 4}, std::pair{8, 16}}) {
    const Case c = make_case(300 + nvl * domains, domains, nvl, Routing::kUniform, 40, 8);
    const ref::InternodeWireParams p = {.row_bytes = 7168,
                                        .num_scales = 56,
                                        .num_topk = 8,
                                        .hidden = 7168,
                                        .num_nvl_ranks = nvl,
                                        .num_channels = 4,
                                        .chunk_tokens = 3};
    const auto w = ref::internode_wire(c.inputs, p);
    const int64_t ours = ref::turnout_dispatch_token_bytes(7168, 56, 8);
    int64_t sent_domain = 0, sent_rank = 0, back_domain = 0, back_rank = 0;
    for (int r = 0; r < c.num_ranks; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r) + ", D = " + std::to_string(nvl));
      EXPECT_LE(w[r].token_domain_pairs, w[r].token_rank_pairs);
      EXPECT_EQ(w[r].dispatch_turnout.bytes, w[r].token_domain_pairs * ours);
      EXPECT_EQ(w[r].dispatch_deepep.bytes, w[r].token_domain_pairs * ref::deepep_dispatch_token_bytes(7168, 56, 8));
      EXPECT_EQ(w[r].dispatch_per_rank.bytes, w[r].token_rank_pairs * ours);
      // Puts of at most 3 tokens: at least a third of the tokens, at most one per token.
      EXPECT_GE(w[r].dispatch_turnout.messages * 3, w[r].token_domain_pairs);
      EXPECT_LE(w[r].dispatch_turnout.messages, w[r].token_domain_pairs);
      if (nvl == 1) {
        EXPECT_EQ(w[r].dispatch_per_rank.bytes, w[r].dispatch_turnout.bytes);
        EXPECT_EQ(w[r].dispatch_per_rank.messages, w[r].dispatch_turnout.messages);
        EXPECT_EQ(w[r].combine_per_rank.messages, w[r].combine_turnout.messages);
      }
      sent_domain += w[r].token_domain_pairs;
      sent_rank += w[r].token_rank_pairs;
      back_domain += w[r].combine_turnout.bytes / ref::turnout_combine_token_bytes(7168, 8);
      back_rank += w[r].combine_per_rank.bytes / ref::turnout_combine_token_bytes(7168, 8);
      EXPECT_EQ(w[r].combine_deepep.bytes / ref::deepep_combine_token_bytes(7168, 8),
                w[r].combine_turnout.bytes / ref::turnout_combine_token_bytes(7168, 8));
    }
    // What crosses in dispatch crosses back in combine, per copy.
    EXPECT_EQ(back_domain, sent_domain);
    EXPECT_EQ(back_rank, sent_rank);
  }
}

TEST(ReferenceInternode, BadInputThrows) {
  const auto in = hand_inputs();
  expect_invalid_argument([&] { ref::internode_dispatch(in, kHandParams, {.num_nvl_ranks = 3}); }, "num_nvl_ranks");
  expect_invalid_argument([&] { ref::internode_dispatch(in, kHandParams, {.num_nvl_ranks = 0}); }, "num_nvl_ranks");
  expect_invalid_argument([&] { ref::internode_dispatch(in, kHandParams, {.num_nvl_ranks = 2, .num_channels = -1}); },
                          "num_channels");
  auto bad = in;
  bad[2].topk_idx[1] = 8;
  expect_invalid_argument([&] { ref::internode_dispatch(bad, kHandParams, {.num_nvl_ranks = 2}); },
                          "ranks[2].topk_idx");
  std::vector<ref::NormalDispatchInput> many(64);
  expect_invalid_argument([&] { ref::internode_dispatch(many, {.row_bytes = 1}, {.num_nvl_ranks = 64}); },
                          "num_nvl_ranks");

  const auto out = ref::internode_dispatch(in, kHandParams, {.num_nvl_ranks = 2});
  std::vector<ref::NormalCombineInput> back(4);
  for (int r = 0; r < 4; ++r) back[r].x.assign(3, 0);
  EXPECT_NO_THROW(ref::internode_combine(back, out, 1, 0, true));
  expect_invalid_argument([&] { ref::internode_combine(back, out, 2, 0, true); }, "ranks[0].x:");
  expect_invalid_argument([&] { ref::internode_combine(back, out, 1, 2, true); }, "ranks[0].topk_weights");
  expect_invalid_argument([&] { ref::internode_combine(back, std::span(out).first(2), 1, 0, true); }, "dispatch");
  expect_invalid_argument([&] { ref::internode_combine(back, out, 1, 0, true, 4); }, "only_rank");
  auto torn = out;
  torn[1].recv_gbl_rank_prefix_sum.pop_back();
  expect_invalid_argument([&] { ref::internode_combine(back, torn, 1, 0, true); }, "dispatch[1]");
  back[1].bias1.assign(2, 0);
  expect_invalid_argument([&] { ref::internode_combine(back, out, 1, 0, true); }, "ranks[1].bias1");

  const ref::InternodeWireParams p = {.row_bytes = 16, .hidden = 8, .num_nvl_ranks = 2};
  EXPECT_NO_THROW(ref::internode_wire(in, p));
  expect_invalid_argument([&] { ref::internode_wire(in, {.row_bytes = 16, .hidden = 8, .num_nvl_ranks = 3}); },
                          "num_nvl_ranks");
  expect_invalid_argument(
      [&] { ref::internode_wire(in, {.row_bytes = 16, .hidden = 8, .num_nvl_ranks = 2, .chunk_tokens = 0}); },
      "chunk_tokens");
  expect_invalid_argument(
      [&] { ref::internode_wire(in, {.row_bytes = 16, .hidden = 8, .num_nvl_ranks = 2, .num_channels = 0}); },
      "num_channels");
  expect_invalid_argument([&] { ref::internode_wire(in, {.row_bytes = 0, .hidden = 8, .num_nvl_ranks = 2}); },
                          "row_bytes");
  auto short_routing = in;
  short_routing[0].is_token_in_rank.pop_back();
  expect_invalid_argument([&] { ref::internode_wire(short_routing, p); }, "ranks[0].is_token_in_rank");
}
