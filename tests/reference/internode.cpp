// Internode normal mode for all ranks at once: dispatch's handle and forwarders'
// view beside normal_dispatch's rows, the two-level combine, and the network
// traffic of both against DeepEP's protocol and a per-rank one.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference.hpp"

namespace turnout::reference {

namespace {

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

std::vector<InternodeDispatchResult> internode_dispatch(std::span<const NormalDispatchInput> ranks,
                                                        const NormalDispatchParams& params,
                                                        const InternodeParams& internode) {
  check_domain_size(ranks.size(), internode.num_nvl_ranks);
  if (internode.num_channels < 0)
    throw std::invalid_argument("num_channels: must be >= 0, got " + std::to_string(internode.num_channels));
  // Checks every input too.
  std::vector<NormalDispatchResult> normal = normal_dispatch(ranks, params);

  const int num_ranks = static_cast<int>(ranks.size());
  const int nvl = internode.num_nvl_ranks;
  const int num_domains = num_ranks / nvl;
  const int num_channels = internode.num_channels;
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

    // The forwarder's view: peers (s, local) in domain order, tokens in order.
    out.recv_rdma_rank_prefix_sum.resize(num_domains);
    for (int s = 0; s < num_domains; ++s) {
      const Routing& peer = routing[s * nvl + local];
      for (int t = 0; t < peer.in.num_tokens; ++t) {
        const uint32_t mask = peer.domain_mask(t, domain);
        if (mask == 0) continue;
        out.forward_src_domain.push_back(s);
        out.forward_src_idx.push_back(t);
        out.forward_nvl_mask.push_back(mask);
      }
      out.recv_rdma_rank_prefix_sum[s] = static_cast<int32_t>(out.forward_src_idx.size());
    }
    out.num_forward = static_cast<int>(out.forward_src_idx.size());

    if (num_channels == 0) continue;
    out.rdma_channel_prefix_matrix = sent[r].rdma_prefix;
    out.gbl_channel_prefix_matrix = sent[r].gbl_prefix;
    out.send_rdma_head = sent[r].rdma_head;
    out.recv_rdma_channel_prefix_matrix.resize(static_cast<size_t>(num_domains) * num_channels);
    for (int s = 0; s < num_domains; ++s)
      for (int c = 0; c < num_channels; ++c)
        out.recv_rdma_channel_prefix_matrix[static_cast<size_t>(s) * num_channels + c] =
            sent[s * nvl + local].rdma_prefix[static_cast<size_t>(domain) * num_channels + c];
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
      const int peer_tokens = ranks[out.forward_src_domain[i] * nvl + local].num_tokens;
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
                                                   int num_topk, bool round_remote_partials, int only_rank) {
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
  const size_t h = static_cast<size_t>(hidden);
  const size_t k_count = static_cast<size_t>(num_topk);
  for (int r = 0; r < num_ranks; ++r) {
    const InternodeDispatchResult& d = dispatch[r];
    const size_t num_recv = static_cast<size_t>(d.normal.num_recv);
    if (d.num_nvl_ranks != nvl || d.recv_gbl_rank_prefix_sum.size() != static_cast<size_t>(num_ranks) ||
        d.recv_gbl_rank_prefix_sum.back() != d.normal.num_recv || d.normal.recv_src_idx.size() != num_recv ||
        d.forward_src_idx.size() != static_cast<size_t>(d.num_forward))
      throw std::invalid_argument("dispatch[" + std::to_string(r) + "]: not one internode_dispatch of these ranks");
    expect_size(ranks[r].x.size(), num_recv * h, r, "x");
    expect_size(ranks[r].topk_weights.size(), num_recv * k_count, r, "topk_weights");
    const size_t own_tokens = static_cast<size_t>(d.normal.num_tokens);
    if (!ranks[r].bias0.empty()) expect_size(ranks[r].bias0.size(), own_tokens * h, r, "bias0");
    if (!ranks[r].bias1.empty()) expect_size(ranks[r].bias1.size(), own_tokens * h, r, "bias1");
  }

  const auto wanted = [&](int s) { return only_rank < 0 || s == only_rank; };
  std::vector<NormalCombineResult> results(num_ranks);
  for (int s = 0; s < num_ranks; ++s) {
    if (!wanted(s)) continue;
    results[s].combined_x.assign(static_cast<size_t>(dispatch[s].normal.num_tokens) * h, 0.0);
    results[s].combined_topk_weights.assign(static_cast<size_t>(dispatch[s].normal.num_tokens) * k_count, 0.0);
  }
  // Forwarders in rank order, so each source gets its domains' partial sums in domain order.
  std::vector<double> partial_x(h), partial_w(k_count);
  for (int f = 0; f < num_ranks; ++f) {
    const InternodeDispatchResult& fwd = dispatch[f];
    const int domain = f / nvl, local = f % nvl;
    for (int i = 0; i < fwd.num_forward; ++i) {
      const int src_domain = fwd.forward_src_domain[i];
      const int src = src_domain * nvl + local;
      const int token = fwd.forward_src_idx[i];
      if (!wanted(src)) continue;
      std::fill(partial_x.begin(), partial_x.end(), 0.0);
      std::fill(partial_w.begin(), partial_w.end(), 0.0);
      for (int j = 0; j < nvl; ++j) {
        if (!(fwd.forward_nvl_mask[i] >> j & 1)) continue;
        const int dst = domain * nvl + j;
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

std::vector<InternodeWire> internode_wire(std::span<const NormalDispatchInput> ranks,
                                          const InternodeWireParams& params) {
  check_domain_size(ranks.size(), params.num_nvl_ranks);
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
  const int num_ranks = static_cast<int>(ranks.size());
  const int nvl = params.num_nvl_ranks;
  const int num_domains = num_ranks / nvl;
  const int num_channels = params.num_channels;
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
    // partial sum per token of its peer (s, local); per rank, one row per received row.
    for (int s = 0; s < num_domains; ++s) {
      if (s == domain) continue;
      const Routing& peer = routing[s * nvl + local];
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
