// Normal-mode dispatch and combine for all ranks at once: rows move by is_token_in_rank,
// ordered by (source rank, source token) on every receiver; combine sums them back.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "reference.hpp"

namespace turnout::reference {

namespace {

void expect_size(size_t got, size_t expected, size_t rank, const char* field) {
  if (got != expected)
    throw std::invalid_argument("ranks[" + std::to_string(rank) + "]." + field + ": expected " +
                                std::to_string(expected) + " elements, got " + std::to_string(got));
}

void check_dispatch_inputs(std::span<const NormalDispatchInput> ranks, const NormalDispatchParams& params) {
  if (ranks.empty()) throw std::invalid_argument("ranks: need at least one rank");
  if (params.row_bytes <= 0)
    throw std::invalid_argument("row_bytes: must be positive, got " + std::to_string(params.row_bytes));
  if (params.num_scales < 0)
    throw std::invalid_argument("num_scales: must be >= 0, got " + std::to_string(params.num_scales));
  if (params.num_topk < 0)
    throw std::invalid_argument("num_topk: must be >= 0, got " + std::to_string(params.num_topk));
  if (params.expert_alignment < 1)
    throw std::invalid_argument("expert_alignment: must be >= 1, got " + std::to_string(params.expert_alignment));
  const size_t num_ranks = ranks.size();
  for (size_t r = 0; r < num_ranks; ++r) {
    const NormalDispatchInput& in = ranks[r];
    if (in.num_tokens < 0)
      throw std::invalid_argument("ranks[" + std::to_string(r) + "].num_tokens: must be >= 0, got " +
                                  std::to_string(in.num_tokens));
    const size_t tokens = static_cast<size_t>(in.num_tokens);
    expect_size(in.x.size(), tokens * params.row_bytes, r, "x");
    expect_size(in.x_scales.size(), tokens * params.num_scales, r, "x_scales");
    expect_size(in.topk_idx.size(), tokens * params.num_topk, r, "topk_idx");
    expect_size(in.topk_weights.size(), tokens * params.num_topk, r, "topk_weights");
    expect_size(in.is_token_in_rank.size(), tokens * num_ranks, r, "is_token_in_rank");
    for (uint8_t v : in.is_token_in_rank)
      if (v > 1)
        throw std::invalid_argument("ranks[" + std::to_string(r) + "].is_token_in_rank: entries must be 0 or 1, got " +
                                    std::to_string(v));
    if (params.num_topk > 0)
      check_expert_ids(in.topk_idx, params.num_experts, static_cast<int>(num_ranks),
                       ("ranks[" + std::to_string(r) + "].topk_idx").c_str());
  }
}

}  // namespace

std::vector<NormalDispatchResult> normal_dispatch(std::span<const NormalDispatchInput> ranks,
                                                  const NormalDispatchParams& params) {
  check_dispatch_inputs(ranks, params);
  const int num_ranks = static_cast<int>(ranks.size());
  if (params.rows_for_rank < -1 || params.rows_for_rank >= num_ranks)
    throw std::invalid_argument("rows_for_rank: must be -1 or a rank in [0, " + std::to_string(num_ranks) + "), got " +
                                std::to_string(params.rows_for_rank));
  const size_t row_bytes = static_cast<size_t>(params.row_bytes);
  const size_t num_scales = static_cast<size_t>(params.num_scales);
  const size_t num_topk = static_cast<size_t>(params.num_topk);
  const bool has_topk = num_topk > 0;
  const int experts_per_rank = has_topk ? params.num_experts / num_ranks : 0;

  // The same matrix on every rank: a running sum down each receiver's column.
  std::vector<int32_t> prefix(static_cast<size_t>(num_ranks) * num_ranks, 0);
  for (int dst = 0; dst < num_ranks; ++dst) {
    int32_t running = 0;
    for (int src = 0; src < num_ranks; ++src) {
      const NormalDispatchInput& in = ranks[src];
      for (int t = 0; t < in.num_tokens; ++t) running += in.is_token_in_rank[static_cast<size_t>(t) * num_ranks + dst];
      prefix[static_cast<size_t>(src) * num_ranks + dst] = running;
    }
  }

  std::vector<NormalDispatchResult> results(num_ranks);
  for (int dst = 0; dst < num_ranks; ++dst) {
    NormalDispatchResult& out = results[dst];
    out.num_tokens = ranks[dst].num_tokens;
    out.rank_prefix_matrix = prefix;
    const int64_t local_begin = static_cast<int64_t>(dst) * experts_per_rank;
    const int64_t local_end = local_begin + experts_per_rank;
    if (has_topk) out.num_recv_tokens_per_expert.assign(experts_per_rank, 0);
    std::vector<uint8_t> local_hit(experts_per_rank);
    // A GPU test checks one rank's rows: copying every rank's is most of the work.
    const bool keep_rows = params.rows_for_rank < 0 || params.rows_for_rank == dst;

    for (int src = 0; src < num_ranks; ++src) {
      const NormalDispatchInput& in = ranks[src];
      for (int t = 0; t < in.num_tokens; ++t) {
        const size_t tok = static_cast<size_t>(t);
        if (!in.is_token_in_rank[tok * num_ranks + dst]) continue;
        if (keep_rows) {
          out.recv_x.insert(out.recv_x.end(), in.x.begin() + tok * row_bytes, in.x.begin() + (tok + 1) * row_bytes);
          out.recv_x_scales.insert(out.recv_x_scales.end(), in.x_scales.begin() + tok * num_scales,
                                   in.x_scales.begin() + (tok + 1) * num_scales);
        }
        out.recv_src_rank.push_back(src);
        out.recv_src_idx.push_back(t);
        if (!has_topk) continue;
        std::fill(local_hit.begin(), local_hit.end(), 0);
        for (size_t k = 0; k < num_topk; ++k) {
          const int64_t expert = in.topk_idx[tok * num_topk + k];
          const bool local = expert >= local_begin && expert < local_end;
          out.recv_topk_idx.push_back(local ? expert - local_begin : -1);
          out.recv_topk_weights.push_back(local ? in.topk_weights[tok * num_topk + k] : 0.0f);
          if (local) local_hit[expert - local_begin] = 1;
        }
        // A duplicate local expert in one row is still one token for that expert.
        for (int l = 0; l < experts_per_rank; ++l) out.num_recv_tokens_per_expert[l] += local_hit[l];
      }
    }
    out.num_recv = static_cast<int>(out.recv_src_idx.size());
    const int32_t align = params.expert_alignment;
    for (int32_t& count : out.num_recv_tokens_per_expert) count = (count + align - 1) / align * align;
  }
  return results;
}

std::vector<NormalCombineResult> normal_combine(std::span<const NormalCombineInput> ranks,
                                                std::span<const NormalDispatchResult> dispatch, int hidden,
                                                int num_topk, int only_rank) {
  if (ranks.empty()) throw std::invalid_argument("ranks: need at least one rank");
  if (only_rank < -1 || only_rank >= static_cast<int>(ranks.size()))
    throw std::invalid_argument("only_rank: must be -1 or a rank in [0, " + std::to_string(ranks.size()) + "), got " +
                                std::to_string(only_rank));
  if (dispatch.size() != ranks.size())
    throw std::invalid_argument("dispatch: expected one result per rank (" + std::to_string(ranks.size()) + "), got " +
                                std::to_string(dispatch.size()));
  if (hidden <= 0) throw std::invalid_argument("hidden: must be positive, got " + std::to_string(hidden));
  if (num_topk < 0) throw std::invalid_argument("num_topk: must be >= 0, got " + std::to_string(num_topk));
  const size_t num_ranks = ranks.size();
  const size_t h = static_cast<size_t>(hidden);
  const size_t k_count = static_cast<size_t>(num_topk);
  for (size_t r = 0; r < num_ranks; ++r) {
    const NormalDispatchResult& d = dispatch[r];
    const size_t num_recv = static_cast<size_t>(d.num_recv);
    if (d.num_recv < 0 || d.num_tokens < 0 || d.recv_src_rank.size() != num_recv || d.recv_src_idx.size() != num_recv)
      throw std::invalid_argument("dispatch[" + std::to_string(r) +
                                  "]: inconsistent num_recv / recv_src_rank / recv_src_idx");
    expect_size(ranks[r].x.size(), num_recv * h, r, "x");
    expect_size(ranks[r].topk_weights.size(), num_recv * k_count, r, "topk_weights");
    const size_t own_tokens = static_cast<size_t>(d.num_tokens);
    if (!ranks[r].bias0.empty()) expect_size(ranks[r].bias0.size(), own_tokens * h, r, "bias0");
    if (!ranks[r].bias1.empty()) expect_size(ranks[r].bias1.size(), own_tokens * h, r, "bias1");
  }

  const auto wanted = [&](size_t s) { return only_rank < 0 || s == static_cast<size_t>(only_rank); };
  std::vector<NormalCombineResult> results(num_ranks);
  for (size_t s = 0; s < num_ranks; ++s) {
    if (!wanted(s)) continue;
    results[s].combined_x.assign(static_cast<size_t>(dispatch[s].num_tokens) * h, 0.0);
    results[s].combined_topk_weights.assign(static_cast<size_t>(dispatch[s].num_tokens) * k_count, 0.0);
  }
  // Receivers in rank order, rows in receive order: a fixed order for the fp64 sums.
  for (size_t r = 0; r < num_ranks; ++r) {
    const NormalDispatchResult& d = dispatch[r];
    for (size_t row = 0; row < static_cast<size_t>(d.num_recv); ++row) {
      const int32_t src = d.recv_src_rank[row];
      const int32_t tok = d.recv_src_idx[row];
      if (src < 0 || static_cast<size_t>(src) >= num_ranks || tok < 0 || tok >= dispatch[src].num_tokens)
        throw std::invalid_argument("dispatch[" + std::to_string(r) + "]: row " + std::to_string(row) +
                                    " names source (" + std::to_string(src) + ", " + std::to_string(tok) +
                                    ") that does not exist");
      if (!wanted(static_cast<size_t>(src))) continue;
      double* dst_x = &results[src].combined_x[static_cast<size_t>(tok) * h];
      for (size_t c = 0; c < h; ++c) dst_x[c] += bf16_to_float(ranks[r].x[row * h + c]);
      double* dst_w = results[src].combined_topk_weights.data() + static_cast<size_t>(tok) * k_count;
      for (size_t k = 0; k < k_count; ++k) dst_w[k] += ranks[r].topk_weights[row * k_count + k];
    }
  }
  // Biases are added once per token, after the received rows.
  for (size_t s = 0; s < num_ranks; ++s) {
    if (!wanted(s)) continue;
    std::vector<double>& out = results[s].combined_x;
    for (size_t i = 0; i < ranks[s].bias0.size(); ++i) out[i] += bf16_to_float(ranks[s].bias0[i]);
    for (size_t i = 0; i < ranks[s].bias1.size(); ++i) out[i] += bf16_to_float(ranks[s].bias1[i]);
  }
  return results;
}

}  // namespace turnout::reference
