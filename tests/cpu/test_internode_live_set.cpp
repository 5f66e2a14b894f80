// How the ranks of a shrink-mode dispatch across NVL domains agree on who
// takes part (src/kernels/internode/live_set.hpp), on a model of the counts
// step's two rounds: rank z's barrier arrival reaches rank q at
// start_z + skew[z][q], and q's view holds the ranks that arrived by its
// deadline start_q + T. Survivors must derive one live set whatever the
// arrival times (a rank that stops calling, late ranks, ranks masked before
// the call), and the edge the header documents (arrivals skewed by more than
// a timeout) is pinned as the one way they can disagree. Also the region's
// room for the views.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/internode/live_set.hpp"
#include "kernels/internode/region.hpp"

namespace ki = turnout::kernels::internode;

namespace {

constexpr double kT = 1.0;  // the shrink timeout
constexpr double kNever = 1e30;

struct Model {
  int num_ranks;
  std::vector<double> start;              // kNever: the rank stops calling
  std::vector<std::vector<double>> skew;  // [z][q]: extra delay of z's arrival at q
  std::set<int> masked;                   // masked before the call (on every rank)

  bool calls(int r) const { return start[r] < kNever && !masked.count(r); }
  bool arrived(int z, int q) const { return calls(z) && start[z] + skew[z][q] <= start[q] + kT; }
};

Model make_model(int num_ranks) {
  return {num_ranks,
          std::vector<double>(num_ranks, 0.0),
          std::vector<std::vector<double>>(num_ranks, std::vector<double>(num_ranks, 0.0)),
          {}};
}

std::vector<uint32_t> set_of(int num_ranks, const std::vector<bool>& in) {
  std::vector<uint32_t> words(ki::rank_set_words(num_ranks), 0);
  for (int r = 0; r < num_ranks; ++r)
    if (in[r]) words[r / 32] |= 1u << (r % 32);
  return words;
}

std::set<int> members(int num_ranks, const uint32_t* words) {
  std::set<int> out;
  for (int r = 0; r < num_ranks; ++r)
    if (ki::rank_in_set(words, r)) out.insert(r);
  return out;
}

// Every calling rank's view ([R][words], zeros for the others).
std::vector<uint32_t> all_views(const Model& m) {
  const int R = m.num_ranks, W = ki::rank_set_words(R);
  std::vector<uint32_t> views(static_cast<size_t>(R) * W, 0);
  for (int q = 0; q < R; ++q) {
    if (!m.calls(q)) continue;
    std::vector<bool> in(R);
    for (int z = 0; z < R; ++z) in[z] = z == q || m.arrived(z, q);
    const std::vector<uint32_t> v = set_of(R, in);
    for (int w = 0; w < W; ++w) views[static_cast<size_t>(q) * W + w] = v[w];
  }
  return views;
}

// Rank q's live set, as the kernel forms it from the views.
std::set<int> live_of(const Model& m, const std::vector<uint32_t>& views, int q) {
  const int R = m.num_ranks, W = ki::rank_set_words(R);
  const uint32_t* own = views.data() + static_cast<size_t>(q) * W;
  std::vector<uint32_t> live(W);
  for (int w = 0; w < W; ++w) live[w] = ki::agreed_live_word(own, views.data(), R, q, w);
  return members(R, live.data());
}

// Every caller that finds itself live holds the same set; every other caller
// is outside it; `expected` (if not empty) is that set.
std::set<int> check_agreement(const Model& m, const std::set<int>& expected = {}) {
  const std::vector<uint32_t> views = all_views(m);
  std::set<int> agreed;
  bool first = true;
  for (int q = 0; q < m.num_ranks; ++q) {
    if (!m.calls(q)) continue;
    const std::set<int> live = live_of(m, views, q);
    if (!live.count(q)) continue;
    if (first) agreed = live;
    first = false;
    EXPECT_EQ(live, agreed) << "rank " << q << " disagrees";
  }
  for (int q = 0; q < m.num_ranks; ++q) {
    if (!m.calls(q) || agreed.count(q)) continue;
    const std::set<int> live = live_of(m, views, q);
    EXPECT_FALSE(live.count(q)) << "rank " << q << " was left out but finds itself live";
    std::vector<bool> in(m.num_ranks);
    for (int r : live) in[r] = true;
    const int by = ki::left_out_by(set_of(m.num_ranks, in).data(), views.data(), m.num_ranks, q);
    EXPECT_GE(by, 0) << "rank " << q << " cannot name who left it out";
    if (by >= 0) {
      EXPECT_TRUE(agreed.count(by)) << "rank " << q << " names " << by << ", not a survivor";
    }
  }
  for (int r = 0; r < m.num_ranks; ++r) {
    if (!m.calls(r)) {
      EXPECT_FALSE(agreed.count(r)) << "rank " << r << " made no call but is live";
    }
  }
  if (!expected.empty()) {
    EXPECT_EQ(agreed, expected);
  }
  return agreed;
}

std::set<int> all_but(int num_ranks, const std::set<int>& out) {
  std::set<int> s;
  for (int r = 0; r < num_ranks; ++r)
    if (!out.count(r)) s.insert(r);
  return s;
}

}  // namespace

TEST(InternodeLiveSet, EveryRankCallingKeepsEveryRank) {
  for (int R : {2, 4, 8, 16, 64, 256}) {
    Model m = make_model(R);
    check_agreement(m, all_but(R, {}));
  }
}

TEST(InternodeLiveSet, ARankThatStopsIsLeftOutByEveryone) {
  for (int R : {4, 8, 16}) {
    for (int stopped = 0; stopped < R; ++stopped) {
      SCOPED_TRACE(std::to_string(R) + " ranks, rank " + std::to_string(stopped) + " stops");
      Model m = make_model(R);
      m.start[stopped] = kNever;
      check_agreement(m, all_but(R, {stopped}));
    }
  }
}

TEST(InternodeLiveSet, RanksMaskedBeforeTheCallStayOut) {
  Model m = make_model(8);
  m.masked = {2, 5};
  m.start[6] = kNever;
  check_agreement(m, all_but(8, {2, 5, 6}));
}

TEST(InternodeLiveSet, ALateRankSeenBySomeIsLeftOutByAllAndKnowsIt) {
  // Rank 3 comes after ranks 0 and 1 gave up (their deadline is 1.0) but
  // before rank 2's (it started at 0.5): rank 2 saw it, 0 and 1 did not.
  Model m = make_model(4);
  m.start = {0.0, 0.0, 0.5, 1.2};
  const std::set<int> agreed = check_agreement(m, {0, 1, 2});
  EXPECT_EQ(agreed.count(3), 0u);
}

TEST(InternodeLiveSet, ALateRankSeenByTheFirstWaiterIsSeenByAllAndKept) {
  // Rank 3 comes 0.9 timeouts after the first waiter (rank 0) started.
  Model m = make_model(4);
  m.start = {0.0, 0.5, 0.3, 0.9};
  check_agreement(m, {0, 1, 2, 3});
}

TEST(InternodeLiveSet, RandomArrivalsAgreeWhileEachRankArrivesEverywhereAtNearlyOnce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    const int R = 2 + static_cast<int>(rng() % 40);
    Model m = make_model(R);
    // Odd trials: each arrival lands up to a thousandth of a timeout late.
    const bool jittered = trial % 2 == 1;
    std::uniform_real_distribution<double> start(0.0, 3 * kT), jitter(0.0, kT / 1000);
    for (int r = 0; r < R; ++r) {
      m.start[r] = rng() % 8 == 0 ? kNever : start(rng);
      if (rng() % 16 == 0) m.masked.insert(r);
      for (int q = 0; q < R; ++q) m.skew[r][q] = jittered ? jitter(rng) : 0.0;
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    const std::set<int> agreed = check_agreement(m);
    if (jittered) continue;
    // Arrivals at one instant: the live set is the view of the rank that started to wait first.
    int first = -1;
    for (int r = 0; r < R; ++r)
      if (m.calls(r) && (first < 0 || m.start[r] < m.start[first])) first = r;
    if (first < 0) continue;
    std::set<int> view{first};
    for (int z = 0; z < R; ++z)
      if (m.arrived(z, first)) view.insert(z);
    EXPECT_EQ(agreed, view);
  }
}

TEST(InternodeLiveSet, ArrivalsSkewedByMoreThanATimeoutCanSplitTheSurvivors) {
  // The documented edge: rank 3's arrival reaches rank 2 ten timeouts late.
  // Rank 2 came late for rank 0 (so only rank 1 reads its view) and its view
  // lacks rank 3, which 0 and 1 saw: 1 drops 3, 0 keeps it.
  Model m = make_model(4);
  m.start = {0.0, 0.5, 1.2, 0.0};
  m.skew[3][2] = 10 * kT;
  const std::vector<uint32_t> views = all_views(m);
  EXPECT_EQ(live_of(m, views, 0), (std::set<int>{0, 1, 3}));
  EXPECT_EQ(live_of(m, views, 1), (std::set<int>{0, 1}));
}

TEST(InternodeLiveSet, TheViewsEndTheCountsAreaAtOffsetsOfTheRanksOnly) {
  for (int N : {2, 4, 16, 32}) {
    for (int D : {1, 2, 4, 8}) {
      if (N + D > 32) continue;
      SCOPED_TRACE(std::to_string(N) + " domains of " + std::to_string(D));
      const ki::Shape plain = ki::make_shape(N, D, 24, 128, 256, 32, 7200, false);
      const ki::Shape shrink = ki::make_shape(N, D, 24, 128, 256, 32, 7200, true);
      const ki::NetRegion a = ki::make_net_region(plain), b = ki::make_net_region(shrink);
      EXPECT_EQ(a.recv_rings, ki::kNetMetaBytes) << "no room taken without shrink mode";
      EXPECT_EQ(b.recv_rings, ki::kNetMetaBytes);
      EXPECT_GE(b.view_epoch(), b.outbox + N * b.message_bytes) << "a call of this shape is not refused";
      EXPECT_GE(b.viewed(), b.view_epoch() + 4);
      EXPECT_GE(b.view(0), b.viewed() + 4 * N * D);
      EXPECT_GE(b.view_out(), b.view(N * D - 1) + 4 * b.view_words());
      EXPECT_EQ(b.views_end(), ki::kNetMetaBytes);
      EXPECT_EQ(b.view_epoch() % 128, 0);
      EXPECT_EQ(b.view_out() % 16, 0) << "a put reads it";
      // The counters only grow across calls: a call of another channel or
      // expert count (a combine, a dispatch of other experts or SMs) finds
      // them where the last one left them (shrink_masked: 64 experts, then 32).
      for (int sms : {2, 8, 24, 48}) {
        for (int L : {0, 1, 8, 32}) {
          const ki::NetRegion c = ki::make_net_region(ki::make_shape(N, D, sms, 128, 256, L, 7200, true));
          EXPECT_EQ(c.view_epoch(), b.view_epoch());
          EXPECT_EQ(c.viewed(), b.viewed());
          EXPECT_EQ(c.view(N * D - 1), b.view(N * D - 1));
          EXPECT_EQ(c.view_out(), b.view_out());
        }
      }
    }
  }
}
