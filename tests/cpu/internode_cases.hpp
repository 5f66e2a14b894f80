// Shared by the internode reference tests (test_reference_internode*.cpp): the
// four-rank case written out by hand, random and skewed routings over NVL domains,
// and the combine inputs that echo a dispatch's rows.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "reference.hpp"

namespace turnout::internode_cases {

namespace ref = turnout::reference;

inline std::vector<uint16_t> bytes_to_bf16(const std::vector<uint8_t>& bytes) {
  std::vector<uint16_t> values(bytes.size() / 2);
  std::memcpy(values.data(), bytes.data(), values.size() * 2);
  return values;
}

inline uint16_t bf(float v) {
  return ref::float_to_bf16(v);
}

// The hand case: R = 4 as domains {0, 1} and {2, 3}; E = 8 (experts 2r, 2r + 1 on rank
// r); K = 2; one byte per row (its value names the token), one scale per row.
//   rank 0: t0 -> {1, 6} (ranks 0, 3), t1 -> {4, 5} (rank 2), t2 -> {-1, 3} (rank 1)
//   rank 1: t0 -> {7, 5} (ranks 3, 2), t1 -> {-1, -1},       t2 -> {0, 2} (ranks 0, 1)
//   rank 2: t0 -> {2, 2} (rank 1),     t1 -> {6, 0} (ranks 3, 0), t2 -> {5, -1} (rank 2)
//   rank 3: no tokens
inline std::vector<ref::NormalDispatchInput> hand_inputs() {
  const std::vector<std::vector<int64_t>> topk = {{1, 6, 4, 5, -1, 3}, {7, 5, -1, -1, 0, 2}, {2, 2, 6, 0, 5, -1}, {}};
  std::vector<ref::NormalDispatchInput> in(4);
  for (int r = 0; r < 4; ++r) {
    const int tokens = static_cast<int>(topk[r].size() / 2);
    in[r].num_tokens = tokens;
    for (int t = 0; t < tokens; ++t) {
      in[r].x.push_back(static_cast<uint8_t>(10 * r + t));
      in[r].x_scales.push_back(static_cast<float>(100 * r + t));
      in[r].topk_weights.push_back(0.5f + r + t);
      in[r].topk_weights.push_back(0.25f + r + t);
    }
    in[r].topk_idx = topk[r];
    in[r].is_token_in_rank = ref::get_dispatch_layout(topk[r], tokens, 2, 4, 8, 2).is_token_in_rank;
  }
  return in;
}

inline const ref::NormalDispatchParams kHandParams = {.row_bytes = 1, .num_scales = 1, .num_topk = 2, .num_experts = 8};

enum class Routing {
  kUniform,      // experts drawn uniformly, 20% of slots -1
  kSkewed,       // 80% of slots on the experts of rank 0's domain
  kOneRank,      // every slot on one expert of the last rank
  kLocalDomain,  // experts of the source's own domain only: nothing crosses
  kEmptyDomain,  // no expert of domain 1; domain 1 sends nothing either
};

struct Case {
  int num_ranks = 0;
  int nvl = 0;
  int num_experts = 0;
  int num_topk = 0;
  int hidden = 0;
  std::vector<ref::DispatchLayout> layouts;
  std::vector<ref::NormalDispatchInput> inputs;

  int num_domains() const { return num_ranks / nvl; }
  ref::NormalDispatchParams params(int alignment = 1) const {
    return {.row_bytes = 2 * hidden,
            .num_scales = 1,
            .num_topk = num_topk,
            .num_experts = num_experts,
            .expert_alignment = alignment};
  }
};

// Rank 1 has no tokens; the others up to max_tokens. x is random bf16.
inline Case make_case(uint32_t seed, int num_domains, int nvl, Routing routing, int max_tokens = 24, int num_topk = 4) {
  std::mt19937 rng(seed);
  Case c;
  c.num_ranks = num_domains * nvl;
  c.nvl = nvl;
  c.num_experts = 2 * c.num_ranks;
  c.num_topk = num_topk;
  c.hidden = 8;
  const int experts_per_domain = 2 * nvl;
  std::uniform_int_distribution<int> percent(0, 99);
  std::uniform_int_distribution<int> tokens(0, max_tokens);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const auto expert_of = [&](int r) -> int64_t {
    const int domain = r / nvl;
    switch (routing) {
      case Routing::kUniform:
        return percent(rng) < 20 ? -1 : std::uniform_int_distribution<int64_t>(0, c.num_experts - 1)(rng);
      case Routing::kSkewed:
        return percent(rng) < 80 ? std::uniform_int_distribution<int64_t>(0, experts_per_domain - 1)(rng)
                                 : std::uniform_int_distribution<int64_t>(-1, c.num_experts - 1)(rng);
      case Routing::kOneRank:
        return c.num_experts - 1;
      case Routing::kLocalDomain:
        return domain * experts_per_domain + std::uniform_int_distribution<int64_t>(0, experts_per_domain - 1)(rng);
      case Routing::kEmptyDomain: {
        const int64_t e = std::uniform_int_distribution<int64_t>(-1, c.num_experts - 1 - experts_per_domain)(rng);
        return e >= experts_per_domain ? e + experts_per_domain : e;
      }
    }
    return -1;
  };
  for (int r = 0; r < c.num_ranks; ++r) {
    const bool silent = r == 1 || (routing == Routing::kEmptyDomain && r / nvl == 1);
    const int num_tokens = silent ? 0 : (max_tokens > 64 ? max_tokens : tokens(rng));
    std::vector<int64_t> topk(static_cast<size_t>(num_tokens) * num_topk);
    for (int64_t& id : topk) id = expert_of(r);
    if (num_tokens > 0 && routing == Routing::kUniform)
      for (int k = 0; k < num_topk; ++k) topk[k] = -1;  // a token that goes nowhere
    ref::NormalDispatchInput in;
    in.num_tokens = num_tokens;
    std::vector<uint16_t> x(static_cast<size_t>(num_tokens) * c.hidden);
    for (uint16_t& v : x) v = bf(normal(rng));
    in.x.resize(x.size() * 2);
    std::memcpy(in.x.data(), x.data(), in.x.size());
    for (int t = 0; t < num_tokens; ++t) in.x_scales.push_back(normal(rng));
    in.topk_idx = topk;
    for (size_t i = 0; i < topk.size(); ++i) in.topk_weights.push_back(std::fabs(normal(rng)));
    ref::DispatchLayout layout = ref::get_dispatch_layout(topk, num_tokens, num_topk, c.num_ranks, c.num_experts, nvl);
    in.is_token_in_rank = layout.is_token_in_rank;
    c.layouts.push_back(std::move(layout));
    c.inputs.push_back(std::move(in));
  }
  return c;
}

inline bool in_rank(const Case& c, int src, int t, int dst) {
  return c.inputs[src].is_token_in_rank[static_cast<size_t>(t) * c.num_ranks + dst] != 0;
}

inline int channel_of(int t, int num_tokens, int num_channels) {
  int channel = 0;
  while (static_cast<int64_t>(num_tokens) * (channel + 1) / num_channels <= t) ++channel;
  return channel;
}

// Every rank returns its received rows as they came (bf16 values) and their weights;
// every source adds two biases.
inline std::vector<ref::NormalCombineInput> echo(const std::vector<ref::InternodeDispatchResult>& out, int hidden) {
  std::vector<ref::NormalCombineInput> back(out.size());
  for (size_t r = 0; r < out.size(); ++r) {
    back[r].x = bytes_to_bf16(out[r].normal.recv_x);
    back[r].topk_weights = out[r].normal.recv_topk_weights;
    const size_t n = static_cast<size_t>(out[r].normal.num_tokens) * hidden;
    back[r].bias0.assign(n, bf(0.5f + static_cast<float>(r)));
    back[r].bias1.assign(n, bf(-0.25f));
  }
  return back;
}

}  // namespace turnout::internode_cases
