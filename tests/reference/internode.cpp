// Internode normal mode for all ranks at once: dispatch's handle and forwarders'
// view beside normal_dispatch's rows, the two-level combine, and the network
// traffic of both against DeepEP's protocol and a per-rank one; with masked ranks
// (shrink mode), on the reduced routing, through substitute forwarders.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/internode/forwarders.hpp"
#include "reference.hpp"

namespace turnout::reference {

namespace {

namespace fw = turnout::kernels::internode;

constexpr int kMaxMaskRanks = 32;

void expect_size(size_t got, size_t expected, size_t rank, const char* field) {
  if (got != expected)
    throw std::invalid_argument("ranks[" + std::to_string(rank) + "]." + field + ": expected " +
                                std::to_string(expected) + " elements, got " + std::to_string(got));
}

void check_domain_size(size_t num_ranks, int num_nvl_ranks) {
  if (num_ranks == 0) throw std::invalid_argument("ranks: need at least one rank");
  if (num_nvl_ranks <= 0 || num_nvl_ranks > kMaxMaskRanks || num_ranks % num_nvl_ranks != 0)
    throw std::invalid_argument("num_nvl_ranks: must divide num_ranks (" + std::to_string(num_ranks) +
                                ") and be in [1, " + std::to_string(kMaxMaskRanks) + "], got " +
                                std::to_string(num_nvl_ranks));
}

// turnout's split: channel c holds [T c / C, T (c + 1) / C).
int channel_begin(int num_tokens, int channel, int num_channels) {
  return static_cast<int>(static_cast<int64_t>(num_tokens) * channel / num_channels);
}

// DeepEP's split (get_channel_task_range): pieces of ceil(T / C) tokens.
int deepep_channel_begin(int num_tokens, int channel, int num_channels) {
  const int per_channel = (num_tokens + num_channels - 1) / num_channels;
  return static_cast<int>(std::min<int64_t>(static_cast<int64_t>(per_channel) * channel, num_tokens));
}

int64_t align16(int64_t bytes) {
  return (bytes + 15) / 16 * 16;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

bool all_live(std::span<const uint32_t> live, int num_ranks) {
  for (int r = 0; r < num_ranks; ++r)
    if (!fw::rank_in_set(live.data(), r)) return false;
  return true;
}

// The live set `arg` names, checked: every rank when it is empty.
std::vector<uint32_t> checked_live(std::span<const uint32_t> live, int num_ranks, const char* arg) {
  const size_t words = static_cast<size_t>(fw::rank_set_words(num_ranks));
  if (live.empty()) return internode_live_set(num_ranks);
  if (live.size() != words)
    throw std::invalid_argument(std::string(arg) + ": expected " + std::to_string(words) +
                                " words (a bit per rank of " + std::to_string(num_ranks) + "), got " +
                                std::to_string(live.size()));
  for (size_t w = 0; w < words; ++w) {
    const int in_word = std::min(32, num_ranks - static_cast<int>(32 * w));
    const uint32_t beyond = in_word == 32 ? 0u : ~((1u << in_word) - 1);
    if (live[w] & beyond)
      throw std::invalid_argument(std::string(arg) + ": bits set past rank " + std::to_string(num_ranks - 1) +
                                  " in word " + std::to_string(w));
  }
  return {live.begin(), live.end()};
}

// Every rank's input as a call with ranks outside `live` masked sees it: a masked rank
// sends nothing (its input is dropped unchecked), and no token goes to a masked rank:
// its column of is_token_in_rank is cleared and, with top-k, the slots naming its
// experts become -1. Inputs too malformed to reduce stay as they are for
// normal_dispatch (or internode_wire) to refuse.
std::vector<NormalDispatchInput> reduce_inputs(std::span<const NormalDispatchInput> ranks,
                                               const NormalDispatchParams& params, std::span<const uint32_t> live) {
  const int num_ranks = static_cast<int>(ranks.size());
  std::vector<NormalDispatchInput> out(ranks.size());
  const bool experts_split = params.num_topk > 0 && params.num_experts > 0 && params.num_experts % num_ranks == 0;
  const int64_t per_rank = experts_split ? params.num_experts / num_ranks : 0;
  for (int r = 0; r < num_ranks; ++r) {
    if (!fw::rank_in_set(live.data(), r)) continue;
    NormalDispatchInput& in = out[r] = ranks[r];
    const size_t tokens = in.num_tokens > 0 ? static_cast<size_t>(in.num_tokens) : 0;
    if (in.is_token_in_rank.size() == tokens * num_ranks)
      for (size_t t = 0; t < tokens; ++t)
        for (int dst = 0; dst < num_ranks; ++dst)
          if (!fw::rank_in_set(live.data(), dst)) in.is_token_in_rank[t * num_ranks + dst] = 0;
    if (experts_split)
      for (int64_t& id : in.topk_idx)
        if (id >= 0 && id < params.num_experts && !fw::rank_in_set(live.data(), static_cast<int>(id / per_rank)))
          id = -1;
  }
  return out;
}

// Reads one rank's routing: which ranks and domains each token reaches.
struct Routing {
  const NormalDispatchInput& in;
  int num_ranks;
  int num_nvl_ranks;

  bool to_rank(int t, int dst) const { return in.is_token_in_rank[static_cast<size_t>(t) * num_ranks + dst] != 0; }
  // Bit j: the token goes to local rank j of `domain`.
  uint32_t domain_mask(int t, int domain) const {
    uint32_t mask = 0;
    for (int j = 0; j < num_nvl_ranks; ++j)
      if (to_rank(t, domain * num_nvl_ranks + j)) mask |= 1u << j;
    return mask;
  }
  // Tokens of [t0, t1) that go to rank `dst`.
  int count_to_rank(int t0, int t1, int dst) const {
    int n = 0;
    for (int t = t0; t < t1; ++t) n += to_rank(t, dst);
    return n;
  }
  // Tokens of [t0, t1) that reach any rank of `domain`.
  int count_to_domain(int t0, int t1, int domain) const {
    int n = 0;
    for (int t = t0; t < t1; ++t) n += domain_mask(t, domain) != 0;
    return n;
  }
};

// The sender's channel entries ([1], [2], [8]) of one rank.
struct SendChannels {
  std::vector<int32_t> rdma_prefix;  // [N, C]
  std::vector<int32_t> gbl_prefix;   // [R, C]
  std::vector<int32_t> rdma_head;    // [T, N]
};

SendChannels send_channels(const Routing& routing, int num_channels) {
  const int num_ranks = routing.num_ranks;
  const int num_domains = num_ranks / routing.num_nvl_ranks;
  const int num_tokens = routing.in.num_tokens;
  SendChannels s;
  s.rdma_prefix.assign(static_cast<size_t>(num_domains) * num_channels, 0);
  s.gbl_prefix.assign(static_cast<size_t>(num_ranks) * num_channels, 0);
  s.rdma_head.assign(static_cast<size_t>(num_tokens) * num_domains, -1);
  std::vector<int32_t> domain_total(num_domains, 0), rank_total(num_ranks, 0);
  for (int c = 0; c < num_channels; ++c) {
    const int t0 = channel_begin(num_tokens, c, num_channels), t1 = channel_begin(num_tokens, c + 1, num_channels);
    for (int d = 0; d < num_domains; ++d) {
      int place = 0;
      for (int t = t0; t < t1; ++t)
        if (routing.domain_mask(t, d) != 0) s.rdma_head[static_cast<size_t>(t) * num_domains + d] = place++;
      domain_total[d] += place;
      s.rdma_prefix[static_cast<size_t>(d) * num_channels + c] = domain_total[d];
    }
    for (int j = 0; j < num_ranks; ++j) {
      rank_total[j] += routing.count_to_rank(t0, t1, j);
      s.gbl_prefix[static_cast<size_t>(j) * num_channels + c] = rank_total[j];
    }
  }
  return s;
}

// Row of (src, token) on a receiver, from its handle: a binary search in the
// source's row range, whose source indices ascend.
int find_row(const InternodeDispatchResult& d, int src, int token) {
  const int lo = src == 0 ? 0 : d.recv_gbl_rank_prefix_sum[src - 1];
  const int hi = d.recv_gbl_rank_prefix_sum[src];
  const auto begin = d.normal.recv_src_idx.begin();
  const auto it = std::lower_bound(begin + lo, begin + hi, token);
  if (it == begin + hi || *it != token) return -1;
  return static_cast<int>(it - begin);
}

}  // namespace

std::vector<uint32_t> internode_live_set(int num_ranks, const std::vector<int>& masked) {
  if (num_ranks <= 0) throw std::invalid_argument("num_ranks: must be positive, got " + std::to_string(num_ranks));
  std::vector<uint32_t> words(static_cast<size_t>(fw::rank_set_words(num_ranks)), 0);
  for (int r = 0; r < num_ranks; ++r) words[r >> 5] |= 1u << (r & 31);
  for (int r : masked) {
    if (r < 0 || r >= num_ranks)
      throw std::invalid_argument("masked: rank " + std::to_string(r) + " is not in [0, " + std::to_string(num_ranks) +
                                  ")");
    words[r >> 5] &= ~(1u << (r & 31));
  }
  return words;
}

InternodeForwarders internode_forwarders(std::span<const uint32_t> live, int num_ranks, int num_nvl_ranks) {
  if (num_ranks <= 0) throw std::invalid_argument("num_ranks: must be positive, got " + std::to_string(num_ranks));
  check_domain_size(static_cast<size_t>(num_ranks), num_nvl_ranks);
  const std::vector<uint32_t> set = checked_live(live, num_ranks, "live");
  const int num_domains = num_ranks / num_nvl_ranks;
  const fw::Forwarders plan{set.data(), num_domains, num_nvl_ranks};
  InternodeForwarders out;
  for (int e = 0; e < num_domains; ++e)
    for (int n = 0; n < num_nvl_ranks; ++n) {
      out.forwarder.push_back(plan.forwarder(e, n));
      out.part.push_back(plan.part(e, n));
      out.num_parts.push_back(plan.num_parts(e, n));
    }
  return out;
}

std::vector<InternodeDispatchResult> internode_dispatch(std::span<const NormalDispatchInput> all_ranks,
                                                        const NormalDispatchParams& params,
                                                        const InternodeParams& internode) {
  check_domain_size(all_ranks.size(), internode.num_nvl_ranks);
  if (internode.num_channels < 0)
    throw std::invalid_argument("num_channels: must be >= 0, got " + std::to_string(internode.num_channels));
  const int num_ranks = static_cast<int>(all_ranks.size());
  const std::vector<uint32_t> live = checked_live(internode.live, num_ranks, "live");
  // The routing the call moves: the inputs as given when every rank is live.
  std::vector<NormalDispatchInput> reduced;
  if (!all_live(live, num_ranks)) reduced = reduce_inputs(all_ranks, params, live);
  const std::span<const NormalDispatchInput> ranks = reduced.empty() ? all_ranks : std::span(reduced);
  // Checks every live rank's input too.
  std::vector<NormalDispatchResult> normal = normal_dispatch(ranks, params);

  const int nvl = internode.num_nvl_ranks;
  const int num_domains = num_ranks / nvl;
  const int num_channels = internode.num_channels;
  const fw::Forwarders plan{live.data(), num_domains, nvl};
  std::vector<Routing> routing;
  for (const NormalDispatchInput& in : ranks) routing.push_back({in, num_ranks, nvl});
  std::vector<SendChannels> sent(num_ranks);
  if (num_channels > 0)
    for (int r = 0; r < num_ranks; ++r) sent[r] = send_channels(routing[r], num_channels);

  std::vector<InternodeDispatchResult> results(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    InternodeDispatchResult& out = results[r];
    const int domain = r / nvl, local = r % nvl;
    out.normal = std::move(normal[r]);
    out.num_nvl_ranks = nvl;
    out.num_channels = num_channels;
    out.live = live;
    out.is_token_in_rank = ranks[r].is_token_in_rank;

    // Counted from the sources' routing, not read off rank_prefix_matrix: tests compare the two.
    out.recv_gbl_rank_prefix_sum.resize(num_ranks);
    int32_t received = 0;
    for (int src = 0; src < num_ranks; ++src) {
      received += routing[src].count_to_rank(0, ranks[src].num_tokens, r);
      out.recv_gbl_rank_prefix_sum[src] = received;
    }
    for (int row = 0; row < out.normal.num_recv; ++row)
      out.recv_nvl_mask.push_back(
          routing[out.normal.recv_src_rank[row]].domain_mask(out.normal.recv_src_idx[row], domain));

    // The forwarder's view: the sources (s, m) of the columns m it serves, in rank
    // order (domain, then part), tokens in order.
    const uint32_t served = plan.served(domain, local);
    out.num_parts = plan.num_parts(domain, local);
    for (int s = 0; s < num_domains; ++s)
      for (int m = 0; m < nvl; ++m) {
        if (!(served >> m & 1)) continue;
        const Routing& peer = routing[s * nvl + m];
        for (int t = 0; t < peer.in.num_tokens; ++t) {
          const uint32_t mask = peer.domain_mask(t, domain);
          if (mask == 0) continue;
          out.forward_src_domain.push_back(s);
          out.forward_src_rank.push_back(s * nvl + m);
          out.forward_src_idx.push_back(t);
          out.forward_nvl_mask.push_back(mask);
        }
        out.recv_rdma_rank_prefix_sum.push_back(static_cast<int32_t>(out.forward_src_idx.size()));
      }
    out.num_forward = static_cast<int>(out.forward_src_idx.size());

    if (num_channels == 0) continue;
    out.rdma_channel_prefix_matrix = sent[r].rdma_prefix;
    out.gbl_channel_prefix_matrix = sent[r].gbl_prefix;
    out.send_rdma_head = sent[r].rdma_head;
    for (int s = 0; s < num_domains; ++s)
      for (int m = 0; m < nvl; ++m) {
        if (!(served >> m & 1)) continue;
        const std::vector<int32_t>& prefix = sent[s * nvl + m].rdma_prefix;
        const auto row = prefix.begin() + static_cast<ptrdiff_t>(domain) * num_channels;
        out.recv_rdma_channel_prefix_matrix.insert(out.recv_rdma_channel_prefix_matrix.end(), row, row + num_channels);
      }
    out.recv_gbl_channel_prefix_matrix.resize(static_cast<size_t>(num_ranks) * num_channels);
    for (int src = 0; src < num_ranks; ++src)
      for (int c = 0; c < num_channels; ++c) {
        const int32_t rank_start = src == 0 ? 0 : out.recv_gbl_rank_prefix_sum[src - 1];
        const int32_t channel_start = c == 0 ? 0 : sent[src].gbl_prefix[static_cast<size_t>(r) * num_channels + c - 1];
        out.recv_gbl_channel_prefix_matrix[static_cast<size_t>(src) * num_channels + c] = rank_start + channel_start;
      }
    // Each (channel, local rank) stream counts its tokens in forward order.
    out.send_nvl_head.assign(static_cast<size_t>(out.num_forward) * nvl, -1);
    std::vector<int32_t> stream_length(static_cast<size_t>(num_channels) * nvl, 0);
    for (int i = 0; i < out.num_forward; ++i) {
      const int peer_tokens = ranks[out.forward_src_rank[i]].num_tokens;
      int channel = 0;
      while (channel_begin(peer_tokens, channel + 1, num_channels) <= out.forward_src_idx[i]) ++channel;
      for (int j = 0; j < nvl; ++j)
        if (out.forward_nvl_mask[i] >> j & 1)
          out.send_nvl_head[static_cast<size_t>(i) * nvl + j] = stream_length[static_cast<size_t>(channel) * nvl + j]++;
    }
  }
  return results;
}

std::vector<NormalCombineResult> internode_combine(std::span<const NormalCombineInput> ranks,
                                                   std::span<const InternodeDispatchResult> dispatch, int hidden,
                                                   int num_topk, bool round_remote_partials, int only_rank,
                                                   std::span<const uint32_t> live, LostPartials lost) {
  if (ranks.empty()) throw std::invalid_argument("ranks: need at least one rank");
  const int num_ranks = static_cast<int>(ranks.size());
  if (only_rank < -1 || only_rank >= num_ranks)
    throw std::invalid_argument("only_rank: must be -1 or a rank in [0, " + std::to_string(num_ranks) + "), got " +
                                std::to_string(only_rank));
  if (dispatch.size() != ranks.size())
    throw std::invalid_argument("dispatch: expected one result per rank (" + std::to_string(num_ranks) + "), got " +
                                std::to_string(dispatch.size()));
  if (hidden <= 0) throw std::invalid_argument("hidden: must be positive, got " + std::to_string(hidden));
  if (num_topk < 0) throw std::invalid_argument("num_topk: must be >= 0, got " + std::to_string(num_topk));
  const int nvl = dispatch[0].num_nvl_ranks;
  check_domain_size(ranks.size(), nvl);
  const std::vector<uint32_t> dispatch_live = checked_live(dispatch[0].live, num_ranks, "dispatch[0].live");
  const std::vector<uint32_t> here = live.empty() ? dispatch_live : checked_live(live, num_ranks, "live");
  for (int r = 0; r < num_ranks; ++r)
    if (fw::rank_in_set(here.data(), r) && !fw::rank_in_set(dispatch_live.data(), r))
      throw std::invalid_argument("live: rank " + std::to_string(r) +
                                  " was masked in the dispatch, so it cannot take part in its combine");
  const auto live_here = [&](int r) { return fw::rank_in_set(here.data(), r); };
  const size_t h = static_cast<size_t>(hidden);
  const size_t k_count = static_cast<size_t>(num_topk);
  for (int r = 0; r < num_ranks; ++r) {
    const InternodeDispatchResult& d = dispatch[r];
    const size_t num_recv = static_cast<size_t>(d.normal.num_recv);
    const size_t num_forward = static_cast<size_t>(d.num_forward);
    if (d.num_nvl_ranks != nvl || d.live != dispatch[0].live ||
        d.recv_gbl_rank_prefix_sum.size() != static_cast<size_t>(num_ranks) ||
        d.recv_gbl_rank_prefix_sum.back() != d.normal.num_recv || d.normal.recv_src_idx.size() != num_recv ||
        d.forward_src_idx.size() != num_forward || d.forward_src_rank.size() != num_forward ||
        d.forward_nvl_mask.size() != num_forward)
      throw std::invalid_argument("dispatch[" + std::to_string(r) + "]: not one internode_dispatch of these ranks");
    if (!live_here(r)) continue;
    expect_size(ranks[r].x.size(), num_recv * h, r, "x");
    expect_size(ranks[r].topk_weights.size(), num_recv * k_count, r, "topk_weights");
    const size_t own_tokens = static_cast<size_t>(d.normal.num_tokens);
    if (!ranks[r].bias0.empty()) expect_size(ranks[r].bias0.size(), own_tokens * h, r, "bias0");
    if (!ranks[r].bias1.empty()) expect_size(ranks[r].bias1.size(), own_tokens * h, r, "bias1");
  }

  const auto wanted = [&](int s) { return (only_rank < 0 || s == only_rank) && live_here(s); };
  std::vector<NormalCombineResult> results(num_ranks);
  for (int s = 0; s < num_ranks; ++s) {
    if (!wanted(s)) continue;
    results[s].combined_x.assign(static_cast<size_t>(dispatch[s].normal.num_tokens) * h, 0.0);
    results[s].combined_topk_weights.assign(static_cast<size_t>(dispatch[s].normal.num_tokens) * k_count, 0.0);
  }
  // Forwarders in rank order, so each source gets its domains' partial sums in domain
  // order: a source has one forwarder per domain its tokens reach. With kSummed a
  // forwarder that is not live here still stands for whichever rank sums its columns:
  // the partial of a (token, domain) is the same whoever sums it. With kDropped its
  // partials are lost (the only sources it forwards for in its own domain are itself
  // and masked ranks, none of them wanted).
  std::vector<double> partial_x(h), partial_w(k_count);
  for (int f = 0; f < num_ranks; ++f) {
    if (lost == LostPartials::kDropped && !live_here(f)) continue;
    const InternodeDispatchResult& fwd = dispatch[f];
    const int domain = f / nvl;
    for (int i = 0; i < fwd.num_forward; ++i) {
      const int src = fwd.forward_src_rank[i];
      const int src_domain = src / nvl;
      const int token = fwd.forward_src_idx[i];
      if (!wanted(src)) continue;
      std::fill(partial_x.begin(), partial_x.end(), 0.0);
      std::fill(partial_w.begin(), partial_w.end(), 0.0);
      for (int j = 0; j < nvl; ++j) {
        if (!(fwd.forward_nvl_mask[i] >> j & 1)) continue;
        const int dst = domain * nvl + j;
        if (!live_here(dst)) continue;
        const int row = find_row(dispatch[dst], src, token);
        if (row < 0)
          throw std::invalid_argument("dispatch[" + std::to_string(dst) + "]: holds no row of source (" +
                                      std::to_string(src) + ", " + std::to_string(token) + ") that rank " +
                                      std::to_string(f) + " forwarded to it");
        const size_t at = static_cast<size_t>(row);
        for (size_t c = 0; c < h; ++c) partial_x[c] += bf16_to_float(ranks[dst].x[at * h + c]);
        for (size_t k = 0; k < k_count; ++k) partial_w[k] += ranks[dst].topk_weights[at * k_count + k];
      }
      if (round_remote_partials && src_domain != domain)
        for (double& v : partial_x) v = bf16_to_float(double_to_bf16(v));
      double* out_x = &results[src].combined_x[static_cast<size_t>(token) * h];
      for (size_t c = 0; c < h; ++c) out_x[c] += partial_x[c];
      double* out_w = results[src].combined_topk_weights.data() + static_cast<size_t>(token) * k_count;
      for (size_t k = 0; k < k_count; ++k) out_w[k] += partial_w[k];
    }
  }
  for (int s = 0; s < num_ranks; ++s) {
    if (!wanted(s)) continue;
    std::vector<double>& out = results[s].combined_x;
    for (size_t i = 0; i < ranks[s].bias0.size(); ++i) out[i] += bf16_to_float(ranks[s].bias0[i]);
    for (size_t i = 0; i < ranks[s].bias1.size(); ++i) out[i] += bf16_to_float(ranks[s].bias1[i]);
  }
  return results;
}

int64_t turnout_dispatch_token_bytes(int64_t row_bytes, int num_scales, int num_topk) {
  return align16(row_bytes) + align16(4 * int64_t{num_scales}) + 2 * align16(4 * int64_t{num_topk}) + 16;
}

int64_t turnout_combine_token_bytes(int hidden, int num_topk) {
  return align16(2 * int64_t{hidden}) + align16(4 * int64_t{num_topk});
}

int64_t deepep_dispatch_token_bytes(int64_t row_bytes, int num_scales, int num_topk) {
  return align16(row_bytes + 8 + 4 * int64_t{num_scales} + 8 * int64_t{num_topk});
}

int64_t deepep_combine_token_bytes(int hidden, int num_topk) {
  return align16(2 * int64_t{hidden} + 8 + 4 * int64_t{num_topk});
}

std::vector<InternodeWire> internode_wire(std::span<const NormalDispatchInput> all_ranks,
                                          const InternodeWireParams& params) {
  check_domain_size(all_ranks.size(), params.num_nvl_ranks);
  if (params.row_bytes <= 0)
    throw std::invalid_argument("row_bytes: must be positive, got " + std::to_string(params.row_bytes));
  if (params.num_scales < 0 || params.num_topk < 0)
    throw std::invalid_argument("num_scales, num_topk: must be >= 0, got " + std::to_string(params.num_scales) + ", " +
                                std::to_string(params.num_topk));
  if (params.hidden <= 0) throw std::invalid_argument("hidden: must be positive, got " + std::to_string(params.hidden));
  if (params.num_channels <= 0)
    throw std::invalid_argument("num_channels: must be positive, got " + std::to_string(params.num_channels));
  if (params.chunk_tokens <= 0)
    throw std::invalid_argument("chunk_tokens: must be positive, got " + std::to_string(params.chunk_tokens));
  const int num_ranks = static_cast<int>(all_ranks.size());
  const std::vector<uint32_t> live = checked_live(params.live, num_ranks, "live");
  std::vector<NormalDispatchInput> reduced;
  if (!all_live(live, num_ranks)) reduced = reduce_inputs(all_ranks, {}, live);
  const std::span<const NormalDispatchInput> ranks = reduced.empty() ? all_ranks : std::span(reduced);
  const int nvl = params.num_nvl_ranks;
  const int num_domains = num_ranks / nvl;
  const int num_channels = params.num_channels;
  const fw::Forwarders plan{live.data(), num_domains, nvl};
  for (int r = 0; r < num_ranks; ++r) {
    if (ranks[r].num_tokens < 0)
      throw std::invalid_argument("ranks[" + std::to_string(r) + "].num_tokens: must be >= 0, got " +
                                  std::to_string(ranks[r].num_tokens));
    expect_size(ranks[r].is_token_in_rank.size(), static_cast<size_t>(ranks[r].num_tokens) * num_ranks, r,
                "is_token_in_rank");
  }
  std::vector<Routing> routing;
  for (const NormalDispatchInput& in : ranks) routing.push_back({in, num_ranks, nvl});

  const int64_t ours_dispatch = turnout_dispatch_token_bytes(params.row_bytes, params.num_scales, params.num_topk);
  const int64_t ours_combine = turnout_combine_token_bytes(params.hidden, params.num_topk);
  const int64_t deepep_dispatch = deepep_dispatch_token_bytes(params.row_bytes, params.num_scales, params.num_topk);
  const int64_t deepep_combine = deepep_combine_token_bytes(params.hidden, params.num_topk);
  // One stream of `tokens` of `bytes` each, sent in puts of at most chunk_tokens.
  const auto add = [&](WireCount& w, int64_t tokens, int64_t bytes) {
    w.bytes += tokens * bytes;
    w.messages += ceil_div(tokens, params.chunk_tokens);
  };

  std::vector<InternodeWire> results(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    InternodeWire& w = results[r];
    const Routing& mine = routing[r];
    const int domain = r / nvl, local = r % nvl;
    const int num_tokens = ranks[r].num_tokens;
    for (int e = 0; e < num_domains; ++e) {
      if (e == domain) continue;
      w.token_domain_pairs += mine.count_to_domain(0, num_tokens, e);
      for (int j = e * nvl; j < (e + 1) * nvl; ++j) w.token_rank_pairs += mine.count_to_rank(0, num_tokens, j);
    }
    for (int c = 0; c < num_channels; ++c) {
      const int t0 = channel_begin(num_tokens, c, num_channels), t1 = channel_begin(num_tokens, c + 1, num_channels);
      const int u0 = deepep_channel_begin(num_tokens, c, num_channels);
      const int u1 = deepep_channel_begin(num_tokens, c + 1, num_channels);
      for (int e = 0; e < num_domains; ++e) {
        if (e == domain) continue;
        add(w.dispatch_turnout, mine.count_to_domain(t0, t1, e), ours_dispatch);
        add(w.dispatch_deepep, mine.count_to_domain(u0, u1, e), deepep_dispatch);
        for (int j = e * nvl; j < (e + 1) * nvl; ++j)
          add(w.dispatch_per_rank, mine.count_to_rank(t0, t1, j), ours_dispatch);
      }
    }
    // Combine sends back what dispatch brought from other domains: as a forwarder, one
    // partial sum per token of each source (s, m) of a column m it serves, a stream per
    // source; per rank, one row per received row.
    const uint32_t served = plan.served(domain, local);
    for (int s = 0; s < num_domains; ++s) {
      if (s == domain) continue;
      for (int m = 0; m < nvl; ++m) {
        if (!(served >> m & 1)) continue;
        const Routing& peer = routing[s * nvl + m];
        const int peer_tokens = peer.in.num_tokens;
        for (int c = 0; c < num_channels; ++c) {
          add(w.combine_turnout,
              peer.count_to_domain(channel_begin(peer_tokens, c, num_channels),
                                   channel_begin(peer_tokens, c + 1, num_channels), domain),
              ours_combine);
          add(w.combine_deepep,
              peer.count_to_domain(deepep_channel_begin(peer_tokens, c, num_channels),
                                   deepep_channel_begin(peer_tokens, c + 1, num_channels), domain),
              deepep_combine);
        }
      }
      for (int q = s * nvl; q < (s + 1) * nvl; ++q) {
        const int src_tokens = ranks[q].num_tokens;
        for (int c = 0; c < num_channels; ++c)
          add(w.combine_per_rank,
              routing[q].count_to_rank(channel_begin(src_tokens, c, num_channels),
                                       channel_begin(src_tokens, c + 1, num_channels), r),
              ours_combine);
      }
    }
  }
  return results;
}

}  // namespace turnout::reference
