// Shrink mode of the internode host reference: a call with masked ranks. The rows
// and sums must be intranode's on the routing with the masked ranks' tokens and
// experts removed (reduced here as the GPU tests reduce it), and must not depend on
// which rank forwards: the same reduced routing with every rank live (the masked
// ranks then forward nothing of their own but still forward others' columns) gives
// the same rows and bit-identical sums. The entries that name forwarders ([3], [4],
// [9] and the forward view) follow the substitution. At 4 ranks as 2 domains of 2,
// 8 as 2 of 4 and 4 of 2, 16 as 2 of 8.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <set>
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

const std::pair<int, int> kShapes[] = {{2, 2}, {2, 4}, {4, 2}, {2, 8}};  // (domains, D)

std::string names(const std::set<int>& masked) {
  std::string s = "masked {";
  for (int r : masked) s += " " + std::to_string(r);
  return s + " }";
}

ref::InternodeParams params_of(const Case& c, int num_channels, const std::set<int>& masked) {
  return {.num_nvl_ranks = c.nvl,
          .num_channels = num_channels,
          .live = ref::internode_live_set(c.num_ranks, std::vector<int>(masked.begin(), masked.end()))};
}

// Every rank's input as the GPU tests reduce it (tests/gpu/test_shrink_normal.py): a
// masked rank sends nothing; the slots of its experts become -1 and is_token_in_rank
// is recomputed from the remaining ids.
std::vector<ref::NormalDispatchInput> reduced_inputs(const Case& c, const std::set<int>& masked) {
  const int per_rank = c.num_experts / c.num_ranks;
  std::vector<ref::NormalDispatchInput> out(c.inputs.size());
  for (int r = 0; r < c.num_ranks; ++r) {
    if (masked.count(r)) continue;
    out[r] = c.inputs[r];
    for (int64_t& id : out[r].topk_idx)
      if (id >= 0 && masked.count(static_cast<int>(id / per_rank))) id = -1;
    out[r].is_token_in_rank =
        ref::get_dispatch_layout(out[r].topk_idx, out[r].num_tokens, c.num_topk, c.num_ranks, c.num_experts, c.nvl)
            .is_token_in_rank;
  }
  return out;
}

// The forwarder of column n in domain e, by its definition: the first live local
// index at or after n, wrapping; -1 if none.
int forwarder_of(const std::set<int>& masked, int nvl, int e, int n) {
  for (int k = 0; k < nvl; ++k)
    if (!masked.count(e * nvl + (n + k) % nvl)) return (n + k) % nvl;
  return -1;
}

bool reaches(const std::vector<ref::NormalDispatchInput>& in, int num_ranks, int src, int t, int dst) {
  return in[src].is_token_in_rank[static_cast<size_t>(t) * num_ranks + dst] != 0;
}

// (forwarding domain, source rank, token, mask): what a set of forwarders carries.
using Forwarded = std::set<std::tuple<int, int, int, uint32_t>>;

// Every property of a dispatch with `masked` ranks, and of its combine.
void check_shrunk(const Case& c, const std::set<int>& masked, int num_channels) {
  const int R = c.num_ranks, D = c.nvl, N = c.num_domains(), C = num_channels;
  SCOPED_TRACE(std::to_string(N) + " domains of " + std::to_string(D) + ", " + names(masked));
  const auto out = ref::internode_dispatch(c.inputs, c.params(), params_of(c, C, masked));
  const std::vector<ref::NormalDispatchInput> in = reduced_inputs(c, masked);
  const auto want = ref::normal_dispatch(in, c.params());
  // The same reduced routing with every rank live: masked ranks forward their columns.
  const auto plain = ref::internode_dispatch(in, c.params(), {.num_nvl_ranks = D, .num_channels = C});
  ASSERT_EQ(out.size(), static_cast<size_t>(R));

  Forwarded carried, carried_plain;
  std::map<std::tuple<int, int, int>, int> delivered;  // (receiver, source, token) -> times
  for (int r = 0; r < R; ++r) {
    const ref::InternodeDispatchResult& d = out[r];
    const int domain = r / D, local = r % D;
    SCOPED_TRACE("rank " + std::to_string(r));

    // Rows: intranode's on the reduced routing.
    EXPECT_EQ(d.normal.num_tokens, want[r].num_tokens);
    EXPECT_EQ(d.normal.recv_x, want[r].recv_x);
    EXPECT_EQ(d.normal.recv_x_scales, want[r].recv_x_scales);
    EXPECT_EQ(d.normal.recv_topk_idx, want[r].recv_topk_idx);
    EXPECT_EQ(d.normal.recv_topk_weights, want[r].recv_topk_weights);
    EXPECT_EQ(d.normal.recv_src_rank, want[r].recv_src_rank);
    EXPECT_EQ(d.normal.recv_src_idx, want[r].recv_src_idx);
    EXPECT_EQ(d.normal.num_recv_tokens_per_expert, want[r].num_recv_tokens_per_expert);
    EXPECT_EQ(d.normal.rank_prefix_matrix, want[r].rank_prefix_matrix);
    // The entries no forwarder enters: the reduced routing's, whoever forwards.
    EXPECT_EQ(d.is_token_in_rank, in[r].is_token_in_rank);
    EXPECT_EQ(d.rdma_channel_prefix_matrix, plain[r].rdma_channel_prefix_matrix);
    EXPECT_EQ(d.gbl_channel_prefix_matrix, plain[r].gbl_channel_prefix_matrix);
    EXPECT_EQ(d.recv_gbl_channel_prefix_matrix, plain[r].recv_gbl_channel_prefix_matrix);
    EXPECT_EQ(d.recv_gbl_rank_prefix_sum, plain[r].recv_gbl_rank_prefix_sum);
    EXPECT_EQ(d.recv_nvl_mask, plain[r].recv_nvl_mask);
    EXPECT_EQ(d.send_rdma_head, plain[r].send_rdma_head);
    EXPECT_EQ(d.live, params_of(c, C, masked).live);

    // The columns this rank serves, by the definition.
    std::vector<int> columns;
    for (int m = 0; m < D; ++m)
      if (forwarder_of(masked, D, domain, m) == local) columns.push_back(m);
    const int P = static_cast<int>(columns.size());
    ASSERT_EQ(d.num_parts, P);
    if (masked.count(r)) {
      EXPECT_EQ(P, 0);
      EXPECT_EQ(d.normal.num_recv, 0);
    }
    ASSERT_EQ(d.recv_rdma_rank_prefix_sum.size(), static_cast<size_t>(N * P));
    ASSERT_EQ(d.recv_rdma_channel_prefix_matrix.size(), static_cast<size_t>(N * P * C));
    ASSERT_EQ(d.send_nvl_head.size(), static_cast<size_t>(C > 0 ? d.num_forward * D : 0));
    ASSERT_EQ(d.forward_src_rank.size(), static_cast<size_t>(d.num_forward));

    // [4] steps by each (source domain, part)'s tokens reaching this domain; [3] is that
    // source's [1] row for this domain and ends where [4] steps.
    int32_t above = 0;
    for (int s = 0; s < N; ++s)
      for (int p = 0; p < P; ++p) {
        const int src = s * D + columns[p], row = s * P + p;
        int count = 0;
        for (int t = 0; t < in[src].num_tokens; ++t) {
          bool any = false;
          for (int j = 0; j < D; ++j) any |= reaches(in, R, src, t, domain * D + j);
          count += any;
        }
        EXPECT_EQ(d.recv_rdma_rank_prefix_sum[row] - above, count) << "source " << src;
        above = d.recv_rdma_rank_prefix_sum[row];
        for (int ch = 0; ch < C; ++ch)
          EXPECT_EQ(d.recv_rdma_channel_prefix_matrix[static_cast<size_t>(row) * C + ch],
                    plain[src].rdma_channel_prefix_matrix[static_cast<size_t>(domain) * C + ch])
              << "source " << src << " channel " << ch;
        if (C > 0) EXPECT_EQ(d.recv_rdma_channel_prefix_matrix[static_cast<size_t>(row) * C + C - 1], count);
      }
    EXPECT_EQ(d.num_forward, above);

    // The forward view: sources this rank forwards for, in (source rank, token) order,
    // each with its mask over this domain; [9] numbered per (channel, local rank).
    std::vector<int32_t> stream(static_cast<size_t>(C) * D, 0);
    for (int i = 0; i < d.num_forward; ++i) {
      const int src = d.forward_src_rank[i], t = d.forward_src_idx[i];
      ASSERT_EQ(forwarder_of(masked, D, domain, src % D), local) << "forward " << i << " from rank " << src;
      EXPECT_EQ(d.forward_src_domain[i], src / D);
      if (i > 0) {
        const int prev = d.forward_src_rank[i - 1];
        ASSERT_TRUE(prev < src || (prev == src && d.forward_src_idx[i - 1] < t)) << "forward " << i;
      }
      uint32_t mask = 0;
      for (int j = 0; j < D; ++j) mask |= static_cast<uint32_t>(reaches(in, R, src, t, domain * D + j)) << j;
      ASSERT_EQ(d.forward_nvl_mask[i], mask) << "forward " << i;
      ASSERT_NE(mask, 0u);
      for (int j = 0; j < D; ++j) {
        if (mask >> j & 1) ++delivered[{domain * D + j, src, t}];
        if (C == 0) continue;
        const int channel = channel_of(t, in[src].num_tokens, C);
        const int32_t head = d.send_nvl_head[static_cast<size_t>(i) * D + j];
        ASSERT_EQ(head, (mask >> j & 1) ? stream[static_cast<size_t>(channel) * D + j]++ : -1) << "forward " << i;
      }
      carried.insert({domain, src, t, mask});
    }
    for (int i = 0; i < plain[r].num_forward; ++i)
      carried_plain.insert(
          {domain, plain[r].forward_src_rank[i], plain[r].forward_src_idx[i], plain[r].forward_nvl_mask[i]});
  }
  // The same tokens cross, to the same ranks, only through other forwarders; every row
  // is delivered once.
  EXPECT_EQ(carried, carried_plain);
  size_t rows = 0;
  for (int r = 0; r < R; ++r) {
    rows += static_cast<size_t>(out[r].normal.num_recv);
    for (int row = 0; row < out[r].normal.num_recv; ++row)
      EXPECT_EQ((delivered[{r, out[r].normal.recv_src_rank[row], out[r].normal.recv_src_idx[row]}]), 1);
  }
  EXPECT_EQ(delivered.size(), rows);

  // Combine: intranode's sums on the reduced routing, exactly; rounded, the same bits
  // as with every rank live (other forwarders, same partials).
  const auto back = echo(out, c.hidden);
  const auto sums = ref::normal_combine(back, want, c.hidden, c.num_topk);
  const auto exact = ref::internode_combine(back, out, c.hidden, c.num_topk, false);
  const auto rounded = ref::internode_combine(back, out, c.hidden, c.num_topk, true);
  const auto rounded_plain = ref::internode_combine(back, plain, c.hidden, c.num_topk, true);
  for (int s = 0; s < R; ++s) {
    SCOPED_TRACE("source rank " + std::to_string(s));
    EXPECT_EQ(exact[s].combined_x, sums[s].combined_x);
    EXPECT_EQ(exact[s].combined_topk_weights, sums[s].combined_topk_weights);
    EXPECT_EQ(rounded[s].combined_x, rounded_plain[s].combined_x);
    EXPECT_EQ(rounded[s].combined_topk_weights, sums[s].combined_topk_weights);
    if (masked.count(s)) EXPECT_TRUE(exact[s].combined_x.empty());
  }
}

// A combine that `lost` (live at dispatch) sits out: its rows and weights leave every
// sum, which is the combine with them zeroed, exactly and rounded.
void check_lost_before_combine(const Case& c, const std::set<int>& masked, int lost) {
  SCOPED_TRACE(names(masked) + ", rank " + std::to_string(lost) + " lost before combine");
  const auto out = ref::internode_dispatch(c.inputs, c.params(), params_of(c, 2, masked));
  std::set<int> gone = masked;
  gone.insert(lost);
  const std::vector<uint32_t> live = ref::internode_live_set(c.num_ranks, std::vector<int>(gone.begin(), gone.end()));
  auto back = echo(out, c.hidden);
  std::vector<ref::NormalDispatchResult> normal;
  for (const auto& d : out) normal.push_back(d.normal);
  auto zeroed = back;
  std::fill(zeroed[lost].x.begin(), zeroed[lost].x.end(), bf(0.0f));
  std::fill(zeroed[lost].topk_weights.begin(), zeroed[lost].topk_weights.end(), 0.0f);
  const auto want = ref::normal_combine(zeroed, normal, c.hidden, c.num_topk);
  const auto want_rounded = ref::internode_combine(zeroed, out, c.hidden, c.num_topk, true);
  // What the lost rank passes does not count.
  back[lost].x.assign(3, bf(1000.0f));
  const auto exact = ref::internode_combine(back, out, c.hidden, c.num_topk, false, -1, live);
  const auto rounded = ref::internode_combine(back, out, c.hidden, c.num_topk, true, -1, live);
  for (int s = 0; s < c.num_ranks; ++s) {
    SCOPED_TRACE("source rank " + std::to_string(s));
    if (gone.count(s)) {
      EXPECT_TRUE(exact[s].combined_x.empty());
      continue;
    }
    EXPECT_EQ(exact[s].combined_x, want[s].combined_x);
    EXPECT_EQ(exact[s].combined_topk_weights, want[s].combined_topk_weights);
    EXPECT_EQ(rounded[s].combined_x, want_rounded[s].combined_x);
  }
}

// The same combine with LostPartials::kDropped (the GPU's shrink-mode combine): `lost`
// also takes the partial sums it forwarded with it. That is the combine, every
// dispatch rank live, of rows where `lost`'s rows are zeros and so are the rows, in
// its domain, of every token it forwarded there from another domain. Returns how many
// (token, domain) partials were dropped, so a caller can tell the two modes apart.
int check_lost_partials_dropped(const Case& c, const std::set<int>& masked, int lost) {
  SCOPED_TRACE(names(masked) + ", rank " + std::to_string(lost) + " lost before combine, its partials dropped");
  const int D = c.nvl, e = lost / D;
  const auto out = ref::internode_dispatch(c.inputs, c.params(), params_of(c, 2, masked));
  std::set<int> gone = masked;
  gone.insert(lost);
  const std::vector<uint32_t> live = ref::internode_live_set(c.num_ranks, std::vector<int>(gone.begin(), gone.end()));
  auto back = echo(out, c.hidden);
  std::vector<ref::NormalDispatchResult> normal;
  for (const auto& d : out) normal.push_back(d.normal);
  auto zeroed = back;
  std::set<std::pair<int, int>> dropped;  // (source, token) whose domain-e partial `lost` forwarded
  for (int dst = e * D; dst < (e + 1) * D; ++dst) {
    const ref::NormalDispatchResult& rows = out[dst].normal;
    for (int row = 0; row < rows.num_recv; ++row) {
      const int src = rows.recv_src_rank[row];
      const bool through_lost = src / D != e && forwarder_of(masked, D, e, src % D) == lost % D;
      if (dst != lost && !through_lost) continue;
      if (through_lost) dropped.insert({src, rows.recv_src_idx[row]});
      const size_t h = static_cast<size_t>(c.hidden), k = static_cast<size_t>(c.num_topk);
      std::fill_n(zeroed[dst].x.begin() + static_cast<std::ptrdiff_t>(row * h), h, bf(0.0f));
      std::fill_n(zeroed[dst].topk_weights.begin() + static_cast<std::ptrdiff_t>(row * k), k, 0.0f);
    }
  }
  const auto want = ref::normal_combine(zeroed, normal, c.hidden, c.num_topk);
  const auto want_rounded = ref::internode_combine(zeroed, out, c.hidden, c.num_topk, true);
  back[lost].x.assign(3, bf(1000.0f));
  const auto drop = ref::LostPartials::kDropped;
  const auto exact = ref::internode_combine(back, out, c.hidden, c.num_topk, false, -1, live, drop);
  const auto rounded = ref::internode_combine(back, out, c.hidden, c.num_topk, true, -1, live, drop);
  for (int s = 0; s < c.num_ranks; ++s) {
    SCOPED_TRACE("source rank " + std::to_string(s));
    if (gone.count(s)) {
      EXPECT_TRUE(exact[s].combined_x.empty());
      continue;
    }
    EXPECT_EQ(exact[s].combined_x, want[s].combined_x);
    EXPECT_EQ(exact[s].combined_topk_weights, want[s].combined_topk_weights);
    EXPECT_EQ(rounded[s].combined_x, want_rounded[s].combined_x);
    EXPECT_EQ(rounded[s].combined_topk_weights, want[s].combined_topk_weights);
  }
  return static_cast<int>(dropped.size());
}

}  // namespace

TEST(ReferenceInternodeShrink, EveryRankLiveIsTheCallWithoutALiveSet) {
  for (const auto& [domains, nvl] : kShapes) {
    const Case c = make_case(500 + domains * nvl, domains, nvl, Routing::kUniform);
    const auto none = ref::internode_dispatch(c.inputs, c.params(), {.num_nvl_ranks = nvl, .num_channels = 3});
    const auto all = ref::internode_dispatch(c.inputs, c.params(), params_of(c, 3, {}));
    for (int r = 0; r < c.num_ranks; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      EXPECT_EQ(all[r].normal.recv_x, none[r].normal.recv_x);
      EXPECT_EQ(all[r].recv_rdma_channel_prefix_matrix, none[r].recv_rdma_channel_prefix_matrix);
      EXPECT_EQ(all[r].recv_rdma_rank_prefix_sum, none[r].recv_rdma_rank_prefix_sum);
      EXPECT_EQ(all[r].send_nvl_head, none[r].send_nvl_head);
      EXPECT_EQ(all[r].send_rdma_head, none[r].send_rdma_head);
      EXPECT_EQ(all[r].forward_src_rank, none[r].forward_src_rank);
      EXPECT_EQ(all[r].num_parts, 1);
      EXPECT_EQ(none[r].num_parts, 1);
      EXPECT_EQ(all[r].live, none[r].live);
      // DeepEP's shapes: [3] [N, C], [4] [N], forwarding from its own column.
      EXPECT_EQ(all[r].recv_rdma_rank_prefix_sum.size(), static_cast<size_t>(domains));
      for (int i = 0; i < all[r].num_forward; ++i) EXPECT_EQ(all[r].forward_src_rank[i] % nvl, r % nvl);
    }
    const auto back = echo(all, c.hidden);
    const auto a = ref::internode_combine(back, all, c.hidden, c.num_topk, true);
    const auto b = ref::internode_combine(back, none, c.hidden, c.num_topk, true, -1, all[0].live);
    for (int r = 0; r < c.num_ranks; ++r) EXPECT_EQ(a[r].combined_x, b[r].combined_x);
  }
}

TEST(ReferenceInternodeShrink, FourRanksRankThreeMaskedByHand) {
  // hand_inputs with rank 3 (domain 1, column 1) masked: rank 0's t0 now reaches rank 0
  // alone and rank 1's t0 rank 2 alone. Rank 2 forwards both columns into domain 1:
  // parts {0, 1}, sources in rank order 0, 1, 2, 3.
  const auto out = ref::internode_dispatch(
      hand_inputs(), kHandParams, {.num_nvl_ranks = 2, .num_channels = 2, .live = ref::internode_live_set(4, {3})});
  EXPECT_EQ(out[2].num_parts, 2);
  EXPECT_EQ(out[3].num_parts, 0);
  EXPECT_EQ(out[2].forward_src_rank, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(out[2].forward_src_domain, (std::vector<int32_t>{0, 0, 1}));
  EXPECT_EQ(out[2].forward_src_idx, (std::vector<int32_t>{1, 0, 2}));
  EXPECT_EQ(out[2].forward_nvl_mask, (std::vector<uint32_t>{1, 1, 1}));
  EXPECT_EQ(out[2].recv_rdma_rank_prefix_sum, (std::vector<int32_t>{1, 2, 3, 3}));
  // Channels c0 = {t0}, c1 = {t1, t2}: rows for sources 0, 1, 2, 3.
  EXPECT_EQ(out[2].recv_rdma_channel_prefix_matrix, (std::vector<int32_t>{0, 1, 1, 1, 0, 1, 0, 0}));
  // To local rank 0: r0.t1 (c1, first), r1.t0 (c0, first), r2.t2 (c1, second).
  EXPECT_EQ(out[2].send_nvl_head, (std::vector<int32_t>{0, -1, 0, -1, 1, -1}));
  EXPECT_EQ(out[2].normal.recv_x, (std::vector<uint8_t>{1, 10, 22}));
  // Rank 3 forwards, sends and receives nothing.
  EXPECT_EQ(out[3].num_forward, 0);
  EXPECT_TRUE(out[3].recv_rdma_rank_prefix_sum.empty());
  EXPECT_TRUE(out[3].send_nvl_head.empty());
  EXPECT_EQ(out[3].normal.num_recv, 0);
  // Domain 0 forwards as before.
  EXPECT_EQ(out[0].forward_src_idx, (std::vector<int32_t>{0, 2, 0, 1}));
  EXPECT_EQ(out[0].forward_nvl_mask, (std::vector<uint32_t>{1, 2, 2, 1}));
  EXPECT_EQ(out[1].recv_rdma_rank_prefix_sum, (std::vector<int32_t>{1, 1}));
  // [8] of rank 0: t0 no longer reaches domain 1.
  EXPECT_EQ(out[0].send_rdma_head, (std::vector<int32_t>{0, -1, -1, 0, 0, -1}));
  EXPECT_EQ(out[0].normal.recv_x, (std::vector<uint8_t>{0, 12, 21}));
  EXPECT_EQ(out[0].recv_nvl_mask, (std::vector<uint32_t>{1, 3, 1}));
  // Rank 3's expert slots (ids 6, 7) are gone from every row.
  for (int r = 0; r < 3; ++r)
    for (size_t i = 0; i < out[r].is_token_in_rank.size(); i += 4) EXPECT_EQ(out[r].is_token_in_rank[i + 3], 0);

  // Combine, hidden 1: r0.t0 comes back from rank 0 alone; r1.t0 from rank 2 alone.
  std::vector<ref::NormalCombineInput> back(4);
  back[0].x = {bf(1), bf(1), bf(4)};       // rows r0.t0, r1.t2, r2.t1
  back[1].x = {bf(8), bf(16), bf(32)};     // r0.t2, r1.t2, r2.t0
  back[2].x = {bf(64), bf(128), bf(256)};  // r0.t1, r1.t0, r2.t2
  for (int r = 0; r < 3; ++r) back[r].topk_weights = out[r].normal.recv_topk_weights;
  const auto sums = ref::internode_combine(back, out, 1, 2, true);
  EXPECT_EQ(sums[0].combined_x, (std::vector<double>{1, 64, 8}));
  EXPECT_EQ(sums[1].combined_x, (std::vector<double>{128, 0, 17}));
  EXPECT_EQ(sums[2].combined_x, (std::vector<double>{32, 4, 256}));
  EXPECT_TRUE(sums[3].combined_x.empty());
  // The slot of expert 6 (rank 3) returns no weight.
  EXPECT_EQ(sums[0].combined_topk_weights, (std::vector<double>{0.5, 0, 1.5, 1.25, 0, 2.25}));
}

TEST(ReferenceInternodeShrink, OneMaskedRankInEveryPosition) {
  // Every rank in turn: a forwarder of each column, in each domain; uniform and skewed.
  uint32_t seed = 600;
  for (const auto& [domains, nvl] : kShapes)
    for (Routing routing : {Routing::kUniform, Routing::kSkewed}) {
      const Case c = make_case(++seed, domains, nvl, routing);
      for (int masked = 0; masked < c.num_ranks; ++masked) {
        check_shrunk(c, {masked}, 3);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
}

TEST(ReferenceInternodeShrink, SeveralMaskedRanks) {
  uint32_t seed = 700;
  for (const auto& [domains, nvl] : kShapes) {
    const Case c = make_case(++seed, domains, nvl, Routing::kUniform);
    std::vector<std::set<int>> sets;
    std::set<int> domain1, all_but_one, one_each;
    for (int m = 0; m < nvl; ++m) domain1.insert(nvl + m);
    for (int m = 0; m < nvl; ++m)
      if (m != nvl / 2) all_but_one.insert(m);  // domain 0's only live rank: column nvl / 2
    for (int e = 0; e < domains; ++e) one_each.insert(e * nvl + (e + 1) % nvl);
    sets.push_back(domain1);      // a whole domain: nothing reaches it
    sets.push_back(all_but_one);  // a domain's only live rank forwards every column
    sets.push_back(one_each);     // a masked rank in every domain
    if (nvl >= 4) {
      sets.push_back({nvl + 1, nvl + 2});        // two adjacent: one substitute of three parts
      sets.push_back({nvl + nvl - 1, nvl + 0});  // two that wrap
      sets.push_back({0, 2});                    // two substitutes
    } else {
      sets.push_back({0, nvl});  // column 0 of both domains
    }
    for (const std::set<int>& masked : sets) {
      check_shrunk(c, masked, 3);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  // No channels: the channel entries stay empty.
  const Case c = make_case(720, 2, 4, Routing::kSkewed);
  check_shrunk(c, {5}, 0);
}

TEST(ReferenceInternodeShrink, ManyTokensAndTopk32) {
  const Case big = make_case(730, 2, 8, Routing::kSkewed, 512, 8);
  check_shrunk(big, {3, 12}, 24);
  const Case wide = make_case(731, 4, 2, Routing::kUniform, 20, 16);
  check_shrunk(wide, {2, 7}, 5);
}

TEST(ReferenceInternodeShrink, RankLostBeforeCombine) {
  for (const auto& [domains, nvl] : kShapes) {
    const Case c = make_case(800 + domains * nvl, domains, nvl, Routing::kUniform);
    // A forwarder of column 0 in domain 1, with nothing masked at dispatch and with a
    // substitute already in place elsewhere.
    check_lost_before_combine(c, {}, nvl);
    check_lost_before_combine(c, {0}, nvl + nvl - 1);
    check_lost_before_combine(c, {}, c.num_ranks - 1);
  }
}

TEST(ReferenceInternodeShrink, RankLostBeforeCombineTakesItsForwardedPartials) {
  for (const auto& [domains, nvl] : kShapes) {
    // 80 tokens on every rank but rank 1 (which has none).
    const Case c = make_case(850 + domains * nvl, domains, nvl, Routing::kUniform, 80);
    // Rank 1: the forwarder of column 1 into domain 0 (the GPU job's stopped rank);
    // then one that also substitutes for a masked column 0 of domain 1, and the
    // forwarder of column 0 into the last domain.
    EXPECT_GT(check_lost_partials_dropped(c, {}, 1), 0);
    EXPECT_GT(check_lost_partials_dropped(c, {nvl + nvl - 2}, nvl + nvl - 1), 0);
    EXPECT_GT(check_lost_partials_dropped(c, {}, c.num_ranks - nvl), 0);
  }
  // Domains of one rank: the lost rank forwards only what went to itself.
  const Case ones = make_case(870, 4, 1, Routing::kUniform, 80);
  check_lost_partials_dropped(ones, {}, 1);
  check_lost_partials_dropped(ones, {2}, 1);
}

TEST(ReferenceInternodeShrink, DroppedPartialsDifferFromSummedOnes) {
  const Case c = make_case(880, 2, 2, Routing::kUniform, 80);
  const auto out = ref::internode_dispatch(c.inputs, c.params(), params_of(c, 2, {}));
  const auto back = echo(out, c.hidden);
  const std::vector<uint32_t> live = ref::internode_live_set(c.num_ranks, {1});
  const auto summed = ref::internode_combine(back, out, c.hidden, c.num_topk, true, 3, live);
  const auto dropped =
      ref::internode_combine(back, out, c.hidden, c.num_topk, true, 3, live, ref::LostPartials::kDropped);
  // Rank 3 = (1, 1) reaches domain 0 through rank 1: its tokens there lose rank 0's rows too.
  EXPECT_NE(summed[3].combined_x, dropped[3].combined_x);
  EXPECT_NE(summed[3].combined_topk_weights, dropped[3].combined_topk_weights);
  // Rank 2 = (1, 0) reaches domain 0 through rank 0, which stays: nothing more is lost.
  const auto summed2 = ref::internode_combine(back, out, c.hidden, c.num_topk, true, 2, live);
  const auto dropped2 =
      ref::internode_combine(back, out, c.hidden, c.num_topk, true, 2, live, ref::LostPartials::kDropped);
  EXPECT_EQ(summed2[2].combined_x, dropped2[2].combined_x);
}

TEST(ReferenceInternodeShrink, WireFollowsTheForwarders) {
  for (const auto& [domains, nvl] : kShapes) {
    const Case c = make_case(900 + domains * nvl, domains, nvl, Routing::kUniform, 40, 8);
    for (const std::set<int>& masked : {std::set<int>{nvl}, std::set<int>{nvl - 1, nvl}, std::set<int>{0, 1}}) {
      SCOPED_TRACE(std::to_string(domains) + " domains of " + std::to_string(nvl) + ", " + names(masked));
      ref::InternodeWireParams p = {
          .row_bytes = 256, .num_topk = 8, .hidden = 128, .num_nvl_ranks = nvl, .num_channels = 3, .chunk_tokens = 2};
      // Every rank live on the reduced routing: the masked ranks still forward.
      const auto plain = ref::internode_wire(reduced_inputs(c, masked), p);
      p.live = ref::internode_live_set(c.num_ranks, std::vector<int>(masked.begin(), masked.end()));
      const auto w = ref::internode_wire(c.inputs, p);
      int64_t sent = 0, back = 0;
      for (int r = 0; r < c.num_ranks; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        // What a rank sends does not depend on who forwards it.
        EXPECT_EQ(w[r].token_domain_pairs, plain[r].token_domain_pairs);
        EXPECT_EQ(w[r].token_rank_pairs, plain[r].token_rank_pairs);
        EXPECT_EQ(w[r].dispatch_turnout.bytes, plain[r].dispatch_turnout.bytes);
        EXPECT_EQ(w[r].dispatch_turnout.messages, plain[r].dispatch_turnout.messages);
        EXPECT_EQ(w[r].combine_per_rank.bytes, plain[r].combine_per_rank.bytes);
        // A forwarder carries back what the columns it serves carried.
        int64_t bytes = 0, messages = 0;
        const int e = r / nvl;
        for (int m = 0; m < nvl; ++m)
          if (forwarder_of(masked, nvl, e, m) == r % nvl) {
            bytes += plain[e * nvl + m].combine_turnout.bytes;
            messages += plain[e * nvl + m].combine_turnout.messages;
          }
        EXPECT_EQ(w[r].combine_turnout.bytes, bytes);
        EXPECT_EQ(w[r].combine_turnout.messages, messages);
        if (masked.count(r))
          EXPECT_EQ(w[r].dispatch_turnout.bytes + w[r].combine_turnout.bytes + w[r].combine_per_rank.bytes, 0);
        sent += w[r].token_domain_pairs;
        back += w[r].combine_turnout.bytes / ref::turnout_combine_token_bytes(128, 8);
      }
      EXPECT_EQ(back, sent);
    }
  }
}

TEST(ReferenceInternodeShrink, ForwarderPlanAsTheModuleGivesIt) {
  const auto plan = ref::internode_forwarders(ref::internode_live_set(8, {5, 6}), 8, 4);
  EXPECT_EQ(plan.forwarder, (std::vector<int32_t>{0, 1, 2, 3, 0, 3, 3, 3}));
  EXPECT_EQ(plan.part, (std::vector<int32_t>{0, 0, 0, 0, 0, 0, 1, 2}));
  EXPECT_EQ(plan.num_parts, (std::vector<int32_t>{1, 1, 1, 1, 1, 0, 0, 3}));
  const auto empty_domain = ref::internode_forwarders(ref::internode_live_set(4, {0, 1}), 4, 2);
  EXPECT_EQ(empty_domain.forwarder, (std::vector<int32_t>{-1, -1, 0, 1}));
  EXPECT_EQ(empty_domain.part, (std::vector<int32_t>{-1, -1, 0, 0}));
  const auto all = ref::internode_forwarders({}, 4, 2);
  EXPECT_EQ(all.forwarder, (std::vector<int32_t>{0, 1, 0, 1}));
}

TEST(ReferenceInternodeShrink, BadLiveSetsThrow) {
  const auto in = hand_inputs();
  expect_invalid_argument([&] { ref::internode_dispatch(in, kHandParams, {.num_nvl_ranks = 2, .live = {0xfu, 0u}}); },
                          "live: expected 1 words");
  expect_invalid_argument([&] { ref::internode_dispatch(in, kHandParams, {.num_nvl_ranks = 2, .live = {0x1fu}}); },
                          "live: bits set past rank 3");
  expect_invalid_argument([&] { ref::internode_live_set(4, {4}); }, "masked: rank 4");
  expect_invalid_argument([&] { ref::internode_forwarders({}, 4, 3); }, "num_nvl_ranks");
  // A masked rank's input is not read: even a bad one.
  auto bad = in;
  bad[3].topk_idx = {99};
  EXPECT_NO_THROW(
      ref::internode_dispatch(bad, kHandParams, {.num_nvl_ranks = 2, .live = ref::internode_live_set(4, {3})}));
  expect_invalid_argument([&] { ref::internode_dispatch(bad, kHandParams, {.num_nvl_ranks = 2}); }, "ranks[3]");
  // A combine cannot bring back a rank its dispatch masked.
  const auto out =
      ref::internode_dispatch(in, kHandParams, {.num_nvl_ranks = 2, .live = ref::internode_live_set(4, {3})});
  std::vector<ref::NormalCombineInput> back(4);
  for (int r = 0; r < 4; ++r) back[r].x.assign(static_cast<size_t>(out[r].normal.num_recv), 0);
  EXPECT_NO_THROW(ref::internode_combine(back, out, 1, 0, true));
  expect_invalid_argument([&] { ref::internode_combine(back, out, 1, 0, true, -1, ref::internode_live_set(4)); },
                          "live: rank 3 was masked in the dispatch");
  auto mixed = out;
  mixed[1].live = ref::internode_live_set(4);
  expect_invalid_argument([&] { ref::internode_combine(back, mixed, 1, 0, true); }, "dispatch[1]");
  ref::InternodeWireParams p = {.row_bytes = 16, .hidden = 8, .num_nvl_ranks = 2, .live = {0u, 0u}};
  expect_invalid_argument([&] { ref::internode_wire(in, p); }, "live");
}
