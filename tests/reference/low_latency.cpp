// Low-latency dispatch and combine for all ranks at once: each (token, distinct expert)
// pair becomes one row of that expert; combine weighs the rows back per top-k slot.
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

void check_params(size_t num_ranks, const LowLatencyParams& p) {
  if (num_ranks == 0) throw std::invalid_argument("ranks: need at least one rank");
  if (p.num_max_dispatch_tokens_per_rank <= 0)
    throw std::invalid_argument("num_max_dispatch_tokens_per_rank: must be positive, got " +
                                std::to_string(p.num_max_dispatch_tokens_per_rank));
  if (p.hidden <= 0) throw std::invalid_argument("hidden: must be positive, got " + std::to_string(p.hidden));
  if (p.num_topk <= 0) throw std::invalid_argument("num_topk: must be positive, got " + std::to_string(p.num_topk));
  if (p.num_experts <= 0 || p.num_experts % static_cast<int>(num_ranks) != 0)
    throw std::invalid_argument("num_experts: must be a positive multiple of num_ranks (" + std::to_string(num_ranks) +
                                "), got " + std::to_string(p.num_experts));
}

void check_token_count(int num_tokens, size_t rank, const LowLatencyParams& p) {
  if (num_tokens < 0 || num_tokens > p.num_max_dispatch_tokens_per_rank)
    throw std::invalid_argument(
        "ranks[" + std::to_string(rank) + "].num_tokens: must be in [0, " + "num_max_dispatch_tokens_per_rank = " +
        std::to_string(p.num_max_dispatch_tokens_per_rank) + "], got " + std::to_string(num_tokens));
}

bool row_has_expert(const int64_t* row, int num_topk, int64_t expert) {
  for (int k = 0; k < num_topk; ++k)
    if (row[k] == expert) return true;
  return false;
}

}  // namespace

std::vector<LowLatencyDispatchResult> low_latency_dispatch(std::span<const LowLatencyDispatchInput> ranks,
                                                           const LowLatencyParams& params) {
  check_params(ranks.size(), params);
  if (params.use_ue8m0 && !params.round_scale) throw std::invalid_argument("use_ue8m0: needs round_scale");
  if (params.use_fp8 && params.hidden % 128 != 0)
    throw std::invalid_argument("hidden: fp8 needs a multiple of 128, got " + std::to_string(params.hidden));
  if (params.use_fp8 && params.use_ue8m0 && params.hidden % 512 != 0)
    throw std::invalid_argument("hidden: use_ue8m0 needs a multiple of 512, got " + std::to_string(params.hidden));
  const int num_ranks = static_cast<int>(ranks.size());
  const size_t h = static_cast<size_t>(params.hidden);
  const int num_topk = params.num_topk;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const LowLatencyDispatchInput& in = ranks[r];
    check_token_count(in.num_tokens, r, params);
    expect_size(in.x.size(), static_cast<size_t>(in.num_tokens) * h, r, "x");
    expect_size(in.topk_idx.size(), static_cast<size_t>(in.num_tokens) * num_topk, r, "topk_idx");
    check_expert_ids(in.topk_idx, params.num_experts, num_ranks, ("ranks[" + std::to_string(r) + "].topk_idx").c_str());
  }

  // Each token is cast once on its source rank, whichever experts it then goes to.
  std::vector<std::vector<Fp8Row>> casts(num_ranks);
  if (params.use_fp8) {
    for (int s = 0; s < num_ranks; ++s)
      for (int t = 0; t < ranks[s].num_tokens; ++t)
        casts[s].push_back(cast_row_to_fp8(std::span<const uint16_t>(ranks[s].x).subspan(static_cast<size_t>(t) * h, h),
                                           params.round_scale, params.use_ue8m0));
  }

  const int experts_per_rank = params.num_experts / num_ranks;
  std::vector<LowLatencyDispatchResult> results(num_ranks);
  for (int dst = 0; dst < num_ranks; ++dst) {
    LowLatencyDispatchResult& out = results[dst];
    out.recv_count.assign(experts_per_rank, 0);
    out.layout_range.assign(static_cast<size_t>(experts_per_rank) * num_ranks, 0);
    out.experts.resize(experts_per_rank);
    for (int l = 0; l < experts_per_rank; ++l) {
      const int64_t expert = static_cast<int64_t>(dst) * experts_per_rank + l;
      LowLatencyExpertRecv& rows = out.experts[l];
      for (int src = 0; src < num_ranks; ++src) {
        const int64_t begin = static_cast<int64_t>(rows.src_token.size());
        for (int t = 0; t < ranks[src].num_tokens; ++t) {
          const size_t tok = static_cast<size_t>(t);
          if (!row_has_expert(&ranks[src].topk_idx[tok * num_topk], num_topk, expert)) continue;
          rows.src_rank.push_back(src);
          rows.src_token.push_back(t);
          if (!params.use_fp8) {
            rows.x.insert(rows.x.end(), ranks[src].x.begin() + tok * h, ranks[src].x.begin() + (tok + 1) * h);
            continue;
          }
          const Fp8Row& cast = casts[src][tok];
          rows.x_fp8.insert(rows.x_fp8.end(), cast.q.begin(), cast.q.end());
          rows.scales.insert(rows.scales.end(), cast.scales.begin(), cast.scales.end());
          rows.packed_scales.insert(rows.packed_scales.end(), cast.packed_scales.begin(), cast.packed_scales.end());
        }
        const int64_t count = static_cast<int64_t>(rows.src_token.size()) - begin;
        out.layout_range[static_cast<size_t>(l) * num_ranks + src] = (begin << 32) | count;
      }
      out.recv_count[l] = static_cast<int32_t>(rows.src_token.size());
    }
  }
  return results;
}

std::vector<int32_t> low_latency_canonical_order(std::span<const int32_t> src_info,
                                                 std::span<const int64_t> layout_range, int recv_count) {
  if (recv_count < 0 || src_info.size() < static_cast<size_t>(recv_count))
    throw std::invalid_argument("recv_count: must be in [0, src_info rows = " + std::to_string(src_info.size()) +
                                "], got " + std::to_string(recv_count));
  std::vector<uint8_t> covered(recv_count, 0);
  std::vector<int32_t> perm;
  perm.reserve(recv_count);
  for (size_t s = 0; s < layout_range.size(); ++s) {
    if (layout_range[s] < 0) throw std::invalid_argument("layout_range: entry " + std::to_string(s) + " is negative");
    const int64_t begin = layout_range[s] >> 32;
    const int64_t count = layout_range[s] & 0xffffffffLL;
    if (begin + count > recv_count)
      throw std::invalid_argument("layout_range: source rank " + std::to_string(s) + " rows [" + std::to_string(begin) +
                                  ", " + std::to_string(begin + count) + ") pass recv_count " +
                                  std::to_string(recv_count));
    const size_t group_start = perm.size();
    for (int64_t row = begin; row < begin + count; ++row) {
      if (covered[row])
        throw std::invalid_argument("layout_range: source rank " + std::to_string(s) +
                                    " overlaps another group at row " + std::to_string(row));
      covered[row] = 1;
      perm.push_back(static_cast<int32_t>(row));
    }
    std::sort(perm.begin() + group_start, perm.end(), [&](int32_t a, int32_t b) { return src_info[a] < src_info[b]; });
    for (size_t i = group_start + 1; i < perm.size(); ++i)
      if (src_info[perm[i]] == src_info[perm[i - 1]])
        throw std::invalid_argument("src_info: source rank " + std::to_string(s) + " sends token " +
                                    std::to_string(src_info[perm[i]]) + " twice to one expert");
  }
  if (perm.size() != static_cast<size_t>(recv_count))
    throw std::invalid_argument("layout_range: groups cover " + std::to_string(perm.size()) + " rows, recv_count is " +
                                std::to_string(recv_count));
  return perm;
}

std::vector<std::vector<double>> low_latency_combine(std::span<const LowLatencyCombineInput> ranks,
                                                     std::span<const LowLatencyDispatchResult> dispatch,
                                                     const LowLatencyParams& params) {
  check_params(ranks.size(), params);
  if (dispatch.size() != ranks.size())
    throw std::invalid_argument("dispatch: expected one result per rank (" + std::to_string(ranks.size()) + "), got " +
                                std::to_string(dispatch.size()));
  const int num_ranks = static_cast<int>(ranks.size());
  const size_t experts_per_rank = static_cast<size_t>(params.num_experts / num_ranks);
  const size_t h = static_cast<size_t>(params.hidden);
  const size_t num_topk = static_cast<size_t>(params.num_topk);
  const size_t max_tokens = static_cast<size_t>(params.num_max_dispatch_tokens_per_rank);
  for (size_t r = 0; r < ranks.size(); ++r) {
    const LowLatencyCombineInput& in = ranks[r];
    if (dispatch[r].experts.size() != experts_per_rank)
      throw std::invalid_argument("dispatch[" + std::to_string(r) + "].experts: expected " +
                                  std::to_string(experts_per_rank) + " local experts, got " +
                                  std::to_string(dispatch[r].experts.size()));
    expect_size(in.expert_x.size(), experts_per_rank, r, "expert_x");
    for (size_t l = 0; l < experts_per_rank; ++l)
      expect_size(in.expert_x[l].size(), dispatch[r].experts[l].src_token.size() * h, r, "expert_x[l]");
    if (in.topk_idx.size() % num_topk != 0)
      throw std::invalid_argument("ranks[" + std::to_string(r) + "].topk_idx: " + std::to_string(in.topk_idx.size()) +
                                  " ids is not a multiple of num_topk");
    check_token_count(static_cast<int>(in.topk_idx.size() / num_topk), r, params);
    expect_size(in.topk_weights.size(), in.topk_idx.size(), r, "topk_weights");
    check_expert_ids(in.topk_idx, params.num_experts, num_ranks, ("ranks[" + std::to_string(r) + "].topk_idx").c_str());
  }

  // row_of[rank][l][src * M + token] = that token's row in expert l of rank, or -1.
  std::vector<std::vector<std::vector<int32_t>>> row_of(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    row_of[r].assign(experts_per_rank, std::vector<int32_t>(num_ranks * max_tokens, -1));
    for (size_t l = 0; l < experts_per_rank; ++l) {
      const LowLatencyExpertRecv& rows = dispatch[r].experts[l];
      if (rows.src_rank.size() != rows.src_token.size())
        throw std::invalid_argument("dispatch[" + std::to_string(r) + "].experts[" + std::to_string(l) +
                                    "]: src_rank and src_token differ in size");
      for (size_t i = 0; i < rows.src_token.size(); ++i) {
        const int32_t src = rows.src_rank[i];
        const int32_t tok = rows.src_token[i];
        if (src < 0 || src >= num_ranks || tok < 0 || static_cast<size_t>(tok) >= max_tokens)
          throw std::invalid_argument("dispatch[" + std::to_string(r) + "].experts[" + std::to_string(l) + "]: row " +
                                      std::to_string(i) + " has an impossible source");
        row_of[r][l][src * max_tokens + tok] = static_cast<int32_t>(i);
      }
    }
  }

  std::vector<std::vector<double>> combined(num_ranks);
  for (int s = 0; s < num_ranks; ++s) {
    const LowLatencyCombineInput& in = ranks[s];
    const size_t num_tokens = in.topk_idx.size() / num_topk;
    combined[s].assign(num_tokens * h, 0.0);
    for (size_t t = 0; t < num_tokens; ++t) {
      double* out = &combined[s][t * h];
      for (size_t k = 0; k < num_topk; ++k) {
        const int64_t expert = in.topk_idx[t * num_topk + k];
        if (expert < 0) continue;
        const size_t owner = static_cast<size_t>(expert) / experts_per_rank;
        const size_t l = static_cast<size_t>(expert) % experts_per_rank;
        const int32_t row = row_of[owner][l][s * max_tokens + t];
        if (row < 0)
          throw std::invalid_argument("ranks[" + std::to_string(s) + "].topk_idx: token " + std::to_string(t) +
                                      " was not dispatched to expert " + std::to_string(expert));
        const double weight = in.topk_weights[t * num_topk + k];
        const uint16_t* x = &ranks[owner].expert_x[l][static_cast<size_t>(row) * h];
        for (size_t c = 0; c < h; ++c) out[c] += weight * bf16_to_float(x[c]);
      }
    }
  }
  return combined;
}

}  // namespace turnout::reference
