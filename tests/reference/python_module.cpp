#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <initializer_list>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "reference.hpp"

namespace nb = nanobind;
using namespace nb::literals;
namespace reference = turnout::reference;

namespace {

template <typename T>
using HostArray = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

// Hands a vector to numpy without a copy; the capsule frees it.
template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T>&& v, std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owned->data(), shape.size(), shape.begin(), owner);
}

auto dispatch_layout(HostArray<const int64_t> topk_idx, int num_ranks, int num_experts, int num_nvl_ranks) {
  if (topk_idx.ndim() != 2) throw std::invalid_argument("topk_idx must be 2-D");
  const int t = static_cast<int>(topk_idx.shape(0));
  const int k = static_cast<int>(topk_idx.shape(1));
  auto l =
      reference::get_dispatch_layout({topk_idx.data(), topk_idx.size()}, t, k, num_ranks, num_experts, num_nvl_ranks);
  const size_t r = num_ranks;
  const size_t rdma = l.num_tokens_per_rdma_rank.size();
  return nb::make_tuple(to_numpy(std::move(l.num_tokens_per_rank), {r}),
                        to_numpy(std::move(l.num_tokens_per_rdma_rank), {rdma}),
                        to_numpy(std::move(l.num_tokens_per_expert), {size_t(num_experts)}),
                        to_numpy(std::move(l.is_token_in_rank), {size_t(t), r}));
}

auto cast_to_fp8(HostArray<const uint16_t> x, bool round_scale, bool use_ue8m0) {
  if (x.ndim() != 2) throw std::invalid_argument("x must be 2-D [tokens, hidden] bf16 bits");
  const size_t t = x.shape(0), h = x.shape(1);
  std::vector<uint8_t> q;
  std::vector<float> scales;
  std::vector<uint32_t> packed;
  for (size_t i = 0; i < t; ++i) {
    auto row = reference::cast_row_to_fp8({x.data() + i * h, h}, round_scale, use_ue8m0);
    q.insert(q.end(), row.q.begin(), row.q.end());
    scales.insert(scales.end(), row.scales.begin(), row.scales.end());
    packed.insert(packed.end(), row.packed_scales.begin(), row.packed_scales.end());
  }
  const size_t packed_cols = use_ue8m0 ? h / 512 : 0;
  return nb::make_tuple(to_numpy(std::move(q), {t, h}), to_numpy(std::move(scales), {t, h / 128}),
                        to_numpy(std::move(packed), {t, packed_cols}));
}

std::span<const uint16_t> logfmt_row(const HostArray<const uint16_t>& x) {
  if (x.ndim() != 1) throw std::invalid_argument("x: one row, 1-D uint16 bf16 bits [H]");
  return {x.data(), x.size()};
}

// Row by row over the last axis, any number of leading axes; the shape of x.
auto logfmt_error_bound(HostArray<const uint16_t> x) {
  if (x.ndim() == 0) throw std::invalid_argument("x: uint16 bf16 bits [..., H]");
  const size_t h = x.shape(x.ndim() - 1);
  std::vector<double> bound;
  bound.reserve(x.size());
  for (size_t r = 0; h > 0 && r < x.size() / h; ++r) {
    auto row = reference::logfmt_error_bound({x.data() + r * h, h});
    bound.insert(bound.end(), row.begin(), row.end());
  }
  std::vector<size_t> shape(x.shape_ptr(), x.shape_ptr() + x.ndim());
  auto* owned = new std::vector<double>(std::move(bound));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<double>*>(p); });
  return nb::ndarray<nb::numpy, double>(owned->data(), shape.size(), shape.data(), owner);
}

// A dispatch result with the shapes its arrays need.
struct DispatchResult {
  reference::NormalDispatchResult r;
  int64_t row_bytes;
  int num_scales;
  int num_topk;
};

// Copies element i of a list of arrays (None -> empty) into a vector.
template <typename T>
std::vector<T> list_item(const nb::list& items, size_t i, const char* what) {
  if (items.size() <= i) throw std::invalid_argument(std::string(what) + ": one array per rank is needed");
  nb::handle h = items[i];
  if (h.is_none()) return {};
  auto a = nb::cast<HostArray<const T>>(h);
  return std::vector<T>(a.data(), a.data() + a.size());
}

// Every rank's input to normal_dispatch and its widths, from lists of one
// numpy array (or None) per rank.
std::pair<std::vector<reference::NormalDispatchInput>, reference::NormalDispatchParams> dispatch_inputs(
    const nb::list& x, const nb::list& x_scales, const nb::list& topk_idx, const nb::list& topk_weights,
    const nb::list& is_token_in_rank, int num_experts, int expert_alignment) {
  const size_t num_ranks = x.size();
  std::vector<reference::NormalDispatchInput> inputs(num_ranks);
  reference::NormalDispatchParams params;
  params.num_experts = num_experts;
  params.expert_alignment = expert_alignment;
  for (size_t r = 0; r < num_ranks; ++r) {
    auto xr = nb::cast<HostArray<const uint8_t>>(x[r]);
    if (xr.ndim() != 2) throw std::invalid_argument("x: 2-D uint8 [T, row_bytes] per rank");
    auto& in = inputs[r];
    in.num_tokens = static_cast<int>(xr.shape(0));
    params.row_bytes = static_cast<int64_t>(xr.shape(1));
    in.x.assign(xr.data(), xr.data() + xr.size());
    in.x_scales = list_item<float>(x_scales, r, "x_scales");
    if (in.num_tokens > 0) params.num_scales = static_cast<int>(in.x_scales.size() / in.num_tokens);
    in.topk_idx = list_item<int64_t>(topk_idx, r, "topk_idx");
    in.topk_weights = list_item<float>(topk_weights, r, "topk_weights");
    if (in.num_tokens > 0) params.num_topk = static_cast<int>(in.topk_idx.size() / in.num_tokens);
    in.is_token_in_rank = list_item<uint8_t>(is_token_in_rank, r, "is_token_in_rank");
  }
  // A rank with no tokens says nothing about the widths: take them from any rank.
  for (size_t r = 0; r < num_ranks; ++r) {
    nb::handle sc = x_scales[r], ti = topk_idx[r];
    if (!sc.is_none()) {
      auto a = nb::cast<HostArray<const float>>(sc);
      if (a.ndim() == 2) params.num_scales = static_cast<int>(a.shape(1));
    }
    if (!ti.is_none()) {
      auto a = nb::cast<HostArray<const int64_t>>(ti);
      if (a.ndim() == 2) params.num_topk = static_cast<int>(a.shape(1));
    }
  }
  return {std::move(inputs), params};
}

std::vector<DispatchResult> normal_dispatch(const nb::list& x, const nb::list& x_scales, const nb::list& topk_idx,
                                            const nb::list& topk_weights, const nb::list& is_token_in_rank,
                                            int num_experts, int expert_alignment, int only_rank) {
  auto [inputs, params] =
      dispatch_inputs(x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_experts, expert_alignment);
  params.rows_for_rank = only_rank;
  auto results = reference::normal_dispatch(inputs, params);
  std::vector<DispatchResult> out;
  for (auto& r : results) out.push_back({std::move(r), params.row_bytes, params.num_scales, params.num_topk});
  return out;
}

// Each rank's combine input, from lists of one numpy array (or None) per rank.
std::vector<reference::NormalCombineInput> combine_inputs(const nb::list& x, const nb::list& topk_weights,
                                                          const nb::list& bias0, const nb::list& bias1) {
  std::vector<reference::NormalCombineInput> inputs(x.size());
  for (size_t r = 0; r < inputs.size(); ++r) {
    inputs[r].x = list_item<uint16_t>(x, r, "x");
    inputs[r].topk_weights = list_item<float>(topk_weights, r, "topk_weights");
    inputs[r].bias0 = list_item<uint16_t>(bias0, r, "bias0");
    inputs[r].bias1 = list_item<uint16_t>(bias1, r, "bias1");
  }
  return inputs;
}

// (combined_x, combined_topk_weights) per rank, None for the ranks only_rank leaves out.
nb::list combine_outputs(std::vector<reference::NormalCombineResult>&& combined, std::span<const int> num_tokens,
                         int hidden, int num_topk, int only_rank) {
  nb::list out;
  for (size_t r = 0; r < combined.size(); ++r) {
    if (only_rank >= 0 && r != static_cast<size_t>(only_rank)) {
      out.append(nb::none());
      continue;
    }
    const size_t t = num_tokens[r];
    out.append(nb::make_tuple(to_numpy(std::move(combined[r].combined_x), {t, size_t(hidden)}),
                              to_numpy(std::move(combined[r].combined_topk_weights), {t, size_t(num_topk)})));
  }
  return out;
}

nb::list normal_combine(const nb::list& x, const nb::list& topk_weights, const nb::list& bias0, const nb::list& bias1,
                        const std::vector<DispatchResult>& dispatch, int hidden, int num_topk, int only_rank) {
  std::vector<reference::NormalCombineInput> inputs = combine_inputs(x, topk_weights, bias0, bias1);
  std::vector<reference::NormalDispatchResult> results;
  std::vector<int> num_tokens;
  for (size_t r = 0; r < inputs.size(); ++r) {
    results.push_back(dispatch.at(r).r);
    num_tokens.push_back(results.back().num_tokens);
  }
  return combine_outputs(reference::normal_combine(inputs, results, hidden, num_topk, only_rank), num_tokens, hidden,
                         num_topk, only_rank);
}

// An internode dispatch result with the shapes its arrays need.
struct InternodeResult {
  reference::InternodeDispatchResult r;
  int64_t row_bytes;
  int num_scales;
  int num_topk;
  int num_ranks;

  int num_domains() const { return num_ranks / r.num_nvl_ranks; }
};

const reference::NormalDispatchResult& normal_of(const DispatchResult& d) {
  return d.r;
}
const reference::NormalDispatchResult& normal_of(const InternodeResult& d) {
  return d.r.normal;
}

// A live set from None (every rank) or one truth value per rank (True: takes part).
std::vector<uint32_t> live_set(nb::handle live, size_t num_ranks) {
  if (live.is_none()) return {};
  std::vector<int> masked;
  size_t count = 0;
  for (nb::handle item : live) {
    const int truth = PyObject_IsTrue(item.ptr());
    if (truth < 0) throw nb::python_error();
    if (truth == 0) masked.push_back(static_cast<int>(count));
    ++count;
  }
  if (count != num_ranks)
    throw std::invalid_argument("live: expected one truth value per rank (" + std::to_string(num_ranks) + "), got " +
                                std::to_string(count));
  return reference::internode_live_set(static_cast<int>(num_ranks), masked);
}

std::vector<InternodeResult> internode_dispatch(const nb::list& x, const nb::list& x_scales, const nb::list& topk_idx,
                                                const nb::list& topk_weights, const nb::list& is_token_in_rank,
                                                int num_experts, int expert_alignment, int num_nvl_ranks,
                                                int num_channels, nb::handle live) {
  auto [inputs, params] =
      dispatch_inputs(x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_experts, expert_alignment);
  auto results = reference::internode_dispatch(
      inputs, params,
      {.num_nvl_ranks = num_nvl_ranks, .num_channels = num_channels, .live = live_set(live, inputs.size())});
  const int num_ranks = static_cast<int>(results.size());
  std::vector<InternodeResult> out;
  for (auto& r : results)
    out.push_back({std::move(r), params.row_bytes, params.num_scales, params.num_topk, num_ranks});
  return out;
}

nb::list internode_combine(const nb::list& x, const nb::list& topk_weights, const nb::list& bias0,
                           const nb::list& bias1, const std::vector<InternodeResult>& dispatch, int hidden,
                           int num_topk, bool round_remote_partials, int only_rank, nb::handle live,
                           bool drop_lost_partials) {
  std::vector<reference::NormalCombineInput> inputs = combine_inputs(x, topk_weights, bias0, bias1);
  std::vector<reference::InternodeDispatchResult> results;
  std::vector<int> num_tokens;
  for (size_t r = 0; r < inputs.size(); ++r) {
    results.push_back(dispatch.at(r).r);
    num_tokens.push_back(results.back().normal.num_tokens);
  }
  const std::vector<uint32_t> combine_live = live_set(live, inputs.size());
  const auto lost = drop_lost_partials ? reference::LostPartials::kDropped : reference::LostPartials::kSummed;
  auto combined = reference::internode_combine(inputs, results, hidden, num_topk, round_remote_partials, only_rank,
                                               combine_live, lost);
  // A rank that sits the combine out gets None, as one only_rank leaves out.
  std::vector<bool> out_of_it(inputs.size(), false);
  for (size_t r = 0; r < inputs.size(); ++r)
    if (!combine_live.empty() && !(combine_live[r / 32] >> (r % 32) & 1)) {
      out_of_it[r] = true;
      num_tokens[r] = 0;
    }
  nb::list out = combine_outputs(std::move(combined), num_tokens, hidden, num_topk, only_rank);
  for (size_t r = 0; r < inputs.size(); ++r)
    if (out_of_it[r]) out[r] = nb::none();
  return out;
}

auto internode_forwarders(int num_ranks, int num_nvl_ranks, nb::handle live) {
  if (num_ranks <= 0) throw std::invalid_argument("num_ranks: must be positive, got " + std::to_string(num_ranks));
  auto plan = reference::internode_forwarders(live_set(live, size_t(num_ranks)), num_ranks, num_nvl_ranks);
  const size_t n = num_ranks / num_nvl_ranks, d = num_nvl_ranks;
  return nb::make_tuple(to_numpy(std::move(plan.forwarder), {n, d}), to_numpy(std::move(plan.part), {n, d}),
                        to_numpy(std::move(plan.num_parts), {size_t(num_ranks)}));
}

nb::list internode_wire(const nb::list& is_token_in_rank, const reference::InternodeWireParams& base, nb::handle live) {
  reference::InternodeWireParams params = base;
  params.live = live_set(live, is_token_in_rank.size());
  const size_t num_ranks = is_token_in_rank.size();
  std::vector<reference::NormalDispatchInput> inputs(num_ranks);
  for (size_t r = 0; r < num_ranks; ++r) {
    auto a = nb::cast<HostArray<const uint8_t>>(is_token_in_rank[r]);
    if (a.ndim() != 2 || a.shape(1) != num_ranks)
      throw std::invalid_argument("is_token_in_rank[" + std::to_string(r) + "]: expected a 2-D uint8 array [T, " +
                                  std::to_string(num_ranks) + "]");
    inputs[r].num_tokens = static_cast<int>(a.shape(0));
    inputs[r].is_token_in_rank.assign(a.data(), a.data() + a.size());
  }
  nb::list out;
  for (const reference::InternodeWire& w : reference::internode_wire(inputs, params)) {
    nb::dict row;
    row["token_domain_pairs"] = w.token_domain_pairs;
    row["token_rank_pairs"] = w.token_rank_pairs;
    const std::pair<const char*, const reference::WireCount*> counts[] = {
        {"dispatch_turnout", &w.dispatch_turnout},   {"dispatch_deepep", &w.dispatch_deepep},
        {"dispatch_per_rank", &w.dispatch_per_rank}, {"combine_turnout", &w.combine_turnout},
        {"combine_deepep", &w.combine_deepep},       {"combine_per_rank", &w.combine_per_rank}};
    for (const auto& [name, count] : counts) {
      row[(std::string(name) + "_bytes").c_str()] = count->bytes;
      row[(std::string(name) + "_messages").c_str()] = count->messages;
    }
    out.append(row);
  }
  return out;
}

template <typename T>
auto copy_out(const std::vector<T>& v, size_t rows, size_t cols) {
  if (v.size() != rows * cols)
    throw std::invalid_argument("this result holds " + std::to_string(v.size()) + " elements, not " +
                                std::to_string(rows) + " x " + std::to_string(cols) +
                                " (rows made with only_rank are kept for that rank alone)");
  return to_numpy(std::vector<T>(v), {rows, cols});
}

// A low-latency dispatch result with what its arrays' shapes need.
struct LowLatencyResult {
  reference::LowLatencyDispatchResult r;
  reference::LowLatencyParams params;
  int num_ranks = 0;

  int num_local_experts() const { return static_cast<int>(r.experts.size()); }
  const reference::LowLatencyExpertRecv& expert(int l) const {
    if (l < 0 || l >= num_local_experts())
      throw std::invalid_argument("local_expert: must be in [0, " + std::to_string(num_local_experts()) + "), got " +
                                  std::to_string(l));
    return r.experts[l];
  }
  size_t rows(int l) const { return expert(l).src_token.size(); }
};

// A 2-D array of a list, or an empty one where the entry is None and
// none_ok; `cols` is checked when >= 0.
template <typename T>
std::vector<T> rank_rows(const nb::list& items, size_t r, const char* what, int64_t cols, size_t* num_rows,
                         bool none_ok) {
  if (items.size() <= r) throw std::invalid_argument(std::string(what) + ": one array per rank is needed");
  nb::handle h = items[r];
  if (h.is_none()) {
    if (!none_ok) throw std::invalid_argument(std::string(what) + "[" + std::to_string(r) + "]: None is not allowed");
    *num_rows = 0;
    return {};
  }
  auto a = nb::cast<HostArray<const T>>(h);
  if (a.ndim() != 2 || (cols >= 0 && static_cast<int64_t>(a.shape(1)) != cols))
    throw std::invalid_argument(std::string(what) + "[" + std::to_string(r) + "]: expected a 2-D array" +
                                (cols >= 0 ? " of " + std::to_string(cols) + " columns" : std::string()));
  *num_rows = a.shape(0);
  return std::vector<T>(a.data(), a.data() + a.size());
}

std::vector<LowLatencyResult> low_latency_dispatch(const nb::list& x, const nb::list& topk_idx,
                                                   int num_max_dispatch_tokens_per_rank, int num_experts, bool use_fp8,
                                                   bool round_scale, bool use_ue8m0) {
  const size_t num_ranks = x.size();
  if (num_ranks == 0) throw std::invalid_argument("x: one array per rank is needed");
  if (topk_idx.size() != num_ranks)
    throw std::invalid_argument("topk_idx: one array per rank is needed (" + std::to_string(num_ranks) + "), got " +
                                std::to_string(topk_idx.size()));
  reference::LowLatencyParams params;
  params.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank;
  params.num_experts = num_experts;
  params.use_fp8 = use_fp8;
  params.round_scale = round_scale;
  params.use_ue8m0 = use_ue8m0;
  // Widths from rank 0 (a rank without tokens still has them in its shapes).
  params.hidden = static_cast<int>(nb::cast<HostArray<const uint16_t>>(x[0]).shape(1));
  params.num_topk = static_cast<int>(nb::cast<HostArray<const int64_t>>(topk_idx[0]).shape(1));
  std::vector<reference::LowLatencyDispatchInput> inputs(num_ranks);
  for (size_t r = 0; r < num_ranks; ++r) {
    size_t tokens = 0, topk_tokens = 0;
    inputs[r].x = rank_rows<uint16_t>(x, r, "x", params.hidden, &tokens, false);
    inputs[r].topk_idx = rank_rows<int64_t>(topk_idx, r, "topk_idx", params.num_topk, &topk_tokens, false);
    if (tokens != topk_tokens)
      throw std::invalid_argument("topk_idx[" + std::to_string(r) + "]: " + std::to_string(topk_tokens) +
                                  " rows, x has " + std::to_string(tokens));
    inputs[r].num_tokens = static_cast<int>(tokens);
  }
  auto results = reference::low_latency_dispatch(inputs, params);
  std::vector<LowLatencyResult> out;
  for (auto& r : results) out.push_back({std::move(r), params, static_cast<int>(num_ranks)});
  return out;
}

auto canonical_order(HostArray<const int32_t> src_info, HostArray<const int64_t> layout_range, int recv_count) {
  if (src_info.ndim() != 1) throw std::invalid_argument("src_info: expected one expert's 1-D row");
  if (layout_range.ndim() != 1) throw std::invalid_argument("layout_range: expected one expert's 1-D row [R]");
  auto perm = reference::low_latency_canonical_order({src_info.data(), src_info.size()},
                                                     {layout_range.data(), layout_range.size()}, recv_count);
  const size_t n = perm.size();
  return to_numpy(std::move(perm), {n});
}

nb::list low_latency_combine(const nb::list& expert_x, const nb::list& topk_idx, const nb::list& topk_weights,
                             const nb::list& dispatch, int only_rank) {
  const size_t num_ranks = dispatch.size();
  if (num_ranks == 0) throw std::invalid_argument("dispatch: one result per rank is needed");
  if (only_rank >= static_cast<int>(num_ranks))
    throw std::invalid_argument("only_rank: must be < " + std::to_string(num_ranks) + ", got " +
                                std::to_string(only_rank));
  if (expert_x.size() != num_ranks)
    throw std::invalid_argument("expert_x: one list per rank is needed (" + std::to_string(num_ranks) + "), got " +
                                std::to_string(expert_x.size()));
  const reference::LowLatencyParams params = nb::cast<const LowLatencyResult&>(dispatch[0]).params;
  const int h = params.hidden, k = params.num_topk;
  // Combine reads only who sent each row: copy that, and with only_rank
  // keep the rows that came from it alone.
  std::vector<reference::LowLatencyDispatchResult> results(num_ranks);
  std::vector<reference::LowLatencyCombineInput> inputs(num_ranks);
  for (size_t r = 0; r < num_ranks; ++r) {
    const auto& d = nb::cast<const LowLatencyResult&>(dispatch[r]);
    if (d.num_ranks != static_cast<int>(num_ranks) || d.params.hidden != h || d.params.num_topk != k ||
        d.params.num_experts != params.num_experts ||
        d.params.num_max_dispatch_tokens_per_rank != params.num_max_dispatch_tokens_per_rank)
      throw std::invalid_argument("dispatch[" + std::to_string(r) + "]: comes from another dispatch call");
    auto& kept = results[r];
    kept.recv_count = d.r.recv_count;
    kept.layout_range = d.r.layout_range;
    kept.experts.resize(d.r.experts.size());
    for (size_t l = 0; l < d.r.experts.size(); ++l) {
      const auto& all = d.r.experts[l];
      for (size_t i = 0; i < all.src_token.size(); ++i) {
        if (only_rank >= 0 && all.src_rank[i] != only_rank) continue;
        kept.experts[l].src_rank.push_back(all.src_rank[i]);
        kept.experts[l].src_token.push_back(all.src_token[i]);
      }
    }
    nb::handle xr = expert_x[r];
    if (!nb::isinstance<nb::list>(xr) && !nb::isinstance<nb::tuple>(xr))
      throw std::invalid_argument("expert_x[" + std::to_string(r) + "]: expected a list of one array per local expert");
    nb::list per_expert;
    for (nb::handle item : xr) per_expert.append(item);
    if (per_expert.size() != kept.experts.size())
      throw std::invalid_argument("expert_x[" + std::to_string(r) + "]: expected " +
                                  std::to_string(kept.experts.size()) + " arrays (one per local expert), got " +
                                  std::to_string(per_expert.size()));
    for (size_t l = 0; l < kept.experts.size(); ++l) {
      size_t rows = 0;
      inputs[r].expert_x.push_back(rank_rows<uint16_t>(per_expert, l, "expert_x[r]", h, &rows, false));
      if (rows != kept.experts[l].src_token.size())
        throw std::invalid_argument("expert_x[" + std::to_string(r) + "][" + std::to_string(l) + "]: expected " +
                                    std::to_string(kept.experts[l].src_token.size()) + " rows" +
                                    (only_rank >= 0 ? " (those from only_rank)" : "") + ", got " +
                                    std::to_string(rows));
    }
    // Only only_rank's tokens are combined: the other ranks' top-k may be None.
    const bool wanted = only_rank < 0 || static_cast<int>(r) == only_rank;
    size_t tokens = 0, weight_tokens = 0;
    if (wanted) {
      inputs[r].topk_idx = rank_rows<int64_t>(topk_idx, r, "topk_idx", k, &tokens, false);
      inputs[r].topk_weights = rank_rows<float>(topk_weights, r, "topk_weights", k, &weight_tokens, false);
      if (tokens != weight_tokens)
        throw std::invalid_argument("topk_weights[" + std::to_string(r) + "]: " + std::to_string(weight_tokens) +
                                    " rows, topk_idx has " + std::to_string(tokens));
    }
  }
  auto combined = reference::low_latency_combine(inputs, results, params);
  nb::list out;
  for (size_t r = 0; r < num_ranks; ++r) {
    if (only_rank >= 0 && r != static_cast<size_t>(only_rank)) {
      out.append(nb::none());
      continue;
    }
    const size_t t = combined[r].size() / h;
    out.append(to_numpy(std::move(combined[r]), {t, size_t(h)}));
  }
  return out;
}
}  // namespace

// The properties of a dispatch's user-visible outputs, alike for both modes.
template <typename Result>
void def_normal_outputs(nb::class_<Result>& cls) {
  // Each property hands Python a new array or value of its own.
  constexpr auto fresh = nb::rv_policy::automatic;
  using D = const Result&;
  cls.def_prop_ro(
         "num_recv", [](D d) { return normal_of(d).num_recv; }, fresh)
      .def_prop_ro(
          "recv_x", [](D d) { return copy_out(normal_of(d).recv_x, normal_of(d).num_recv, d.row_bytes); }, fresh)
      .def_prop_ro(
          "recv_x_scales",
          [](D d) { return copy_out(normal_of(d).recv_x_scales, normal_of(d).num_recv, d.num_scales); }, fresh)
      .def_prop_ro(
          "recv_topk_idx", [](D d) { return copy_out(normal_of(d).recv_topk_idx, normal_of(d).num_recv, d.num_topk); },
          fresh)
      .def_prop_ro(
          "recv_topk_weights",
          [](D d) { return copy_out(normal_of(d).recv_topk_weights, normal_of(d).num_recv, d.num_topk); }, fresh)
      .def_prop_ro(
          "recv_src_idx",
          [](D d) {
            return to_numpy(std::vector<int32_t>(normal_of(d).recv_src_idx), {size_t(normal_of(d).num_recv)});
          },
          fresh)
      .def_prop_ro(
          "recv_src_rank",
          [](D d) {
            return to_numpy(std::vector<int32_t>(normal_of(d).recv_src_rank), {size_t(normal_of(d).num_recv)});
          },
          fresh)
      .def_prop_ro(
          "num_recv_tokens_per_expert",
          [](D d) { return std::vector<int32_t>(normal_of(d).num_recv_tokens_per_expert); }, fresh)
      .def_prop_ro(
          "rank_prefix_matrix",
          [](D d) {
            const auto& m = normal_of(d).rank_prefix_matrix;
            const size_t r = static_cast<size_t>(std::lround(std::sqrt(double(m.size()))));
            return copy_out(m, r, r);
          },
          fresh);
}

NB_MODULE(turnout_reference, m) {
  m.doc() = "Host reference of every op: the oracle the tests compare turnout with";
  // Each property hands Python a new array or value of its own.
  constexpr auto fresh = nb::rv_policy::automatic;
  auto normal = nb::class_<DispatchResult>(m, "NormalDispatchResult");
  def_normal_outputs(normal);
  m.def("normal_dispatch", &normal_dispatch, "x"_a, "x_scales"_a, "topk_idx"_a, "topk_weights"_a, "is_token_in_rank"_a,
        "num_experts"_a, "expert_alignment"_a, "only_rank"_a = -1,
        "Every rank's dispatch result from every rank's input (lists, one numpy array or None per rank); with "
        "only_rank >= 0 only that rank's result keeps its rows (recv_x, recv_x_scales), the others everything "
        "else.");
  m.def("normal_combine", &normal_combine, "x"_a, "topk_weights"_a, "bias0"_a, "bias1"_a, "dispatch"_a, "hidden"_a,
        "num_topk"_a, "only_rank"_a = -1,
        "Every rank's fp64 combine result: a list of (combined_x, combined_topk_weights); with only_rank >= 0, "
        "that rank's alone (None for the others).");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  m.def("get_dispatch_layout", &dispatch_layout, "topk_idx"_a, "num_ranks"_a, "num_experts"_a, "num_nvl_ranks"_a,
        "(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank) as numpy arrays");
  m.def(
      "logfmt_row_bytes_ours",
      [](HostArray<const uint16_t> x) { return reference::logfmt_row_bytes_ours(logfmt_row(x)); }, "x"_a,
      "Bytes LogFMT-10 (use_logfmt) puts on the wire for one bf16 row (uint16 bits [H], H % 128 == 0), meta "
      "included.");
  m.def(
      "logfmt_row_bytes_deepep",
      [](HostArray<const uint16_t> x) { return reference::logfmt_row_bytes_deepep(logfmt_row(x)); }, "x"_a,
      "Bytes DeepEP's LogFMT puts on the wire for the same row, by its per-1024 (512) channel chunk rule.");
  m.def("logfmt_error_bound", &logfmt_error_bound, "x"_a,
        "float64 of x's shape: the most |decoded - x| LogFMT-10's bound allows per value, rows along the last "
        "axis (uint16 bf16 bits, H % 128 == 0).");
  m.def("cast_to_fp8", &cast_to_fp8, "x"_a, "round_scale"_a, "use_ue8m0"_a,
        "Per-128-channel FP8 cast of bf16 rows (uint16 bits): (q uint8, scales float32, packed ue8m0 uint32)");

  using L = const LowLatencyResult&;
  nb::class_<LowLatencyResult>(m, "LowLatencyDispatchResult",
                               "One rank's low-latency dispatch result, rows per local expert in canonical order "
                               "(source rank ascending, then source token)")
      .def_prop_ro("num_local_experts", [](L d) { return d.num_local_experts(); })
      .def_prop_ro("num_ranks", [](L d) { return d.num_ranks; })
      .def_prop_ro("hidden", [](L d) { return d.params.hidden; })
      .def_prop_ro("num_topk", [](L d) { return d.params.num_topk; })
      .def_prop_ro("num_experts", [](L d) { return d.params.num_experts; })
      .def_prop_ro("num_max_dispatch_tokens_per_rank", [](L d) { return d.params.num_max_dispatch_tokens_per_rank; })
      .def_prop_ro("use_fp8", [](L d) { return d.params.use_fp8; })
      .def_prop_ro("use_ue8m0", [](L d) { return d.params.use_fp8 && d.params.use_ue8m0; })
      .def_prop_ro(
          "recv_count",
          [](L d) { return to_numpy(std::vector<int32_t>(d.r.recv_count), {size_t(d.num_local_experts())}); }, fresh)
      .def_prop_ro(
          "layout_range", [](L d) { return copy_out(d.r.layout_range, d.num_local_experts(), size_t(d.num_ranks)); },
          fresh)
      .def(
          "recv_src_rank", [](L d, int l) { return to_numpy(std::vector<int32_t>(d.expert(l).src_rank), {d.rows(l)}); },
          "local_expert"_a, fresh, "int32 [n]: the source rank of each row of that expert")
      .def(
          "recv_src_token",
          [](L d, int l) { return to_numpy(std::vector<int32_t>(d.expert(l).src_token), {d.rows(l)}); },
          "local_expert"_a, fresh, "int32 [n]: the source token of each row (the GPU's src_info)")
      .def(
          "recv_x",
          [](L d, int l) {
            if (d.params.use_fp8) throw std::invalid_argument("recv_x: this dispatch used use_fp8: read recv_x_fp8");
            return copy_out(d.expert(l).x, d.rows(l), size_t(d.params.hidden));
          },
          "local_expert"_a, fresh, "uint16 [n, H]: bf16 rows, without use_fp8")
      .def(
          "recv_x_fp8",
          [](L d, int l) {
            if (!d.params.use_fp8) throw std::invalid_argument("recv_x_fp8: this dispatch did not use use_fp8");
            return copy_out(d.expert(l).x_fp8, d.rows(l), size_t(d.params.hidden));
          },
          "local_expert"_a, fresh, "uint8 [n, H]: e4m3 rows, with use_fp8")
      .def(
          "recv_scales",
          [](L d, int l) {
            if (!d.params.use_fp8) throw std::invalid_argument("recv_scales: this dispatch did not use use_fp8");
            return copy_out(d.expert(l).scales, d.rows(l), size_t(d.params.hidden / 128));
          },
          "local_expert"_a, fresh, "float32 [n, H / 128] row-major, with use_fp8 (ue8m0 too)")
      .def(
          "recv_packed_scales",
          [](L d, int l) {
            if (!(d.params.use_fp8 && d.params.use_ue8m0))
              throw std::invalid_argument("recv_packed_scales: this dispatch did not use use_ue8m0");
            return copy_out(d.expert(l).packed_scales, d.rows(l), size_t(d.params.hidden / 512));
          },
          "local_expert"_a, fresh, "uint32 [n, H / 512]: byte j of word i = exponent of group 4i + j, with use_ue8m0");
  m.def("low_latency_dispatch", &low_latency_dispatch, "x"_a, "topk_idx"_a, "num_max_dispatch_tokens_per_rank"_a,
        "num_experts"_a, "use_fp8"_a = false, "round_scale"_a = false, "use_ue8m0"_a = false,
        "Every rank's low-latency dispatch result (a list of LowLatencyDispatchResult) from every rank's x (uint16 "
        "bf16 bits [T, H]) and topk_idx (int64 [T, K]).");
  m.def("low_latency_canonical_order", &canonical_order, "src_info"_a, "layout_range"_a, "recv_count"_a,
        "For one GPU expert (src_info [>= recv_count] int32, layout_range [R] int64): int32 perm, perm[i] = the GPU "
        "row holding canonical row i. Raises ValueError if the ranges overlap, leave rows uncovered or repeat a "
        "token.");
  m.def("low_latency_combine", &low_latency_combine, "expert_x"_a, "topk_idx"_a, "topk_weights"_a, "dispatch"_a,
        "only_rank"_a = -1,
        "Every rank's fp64 combined_x [T, H]: sum over k of topk_weights[t, k] * the row of (t, expert topk_idx[t, "
        "k]). expert_x[r][l]: uint16 bf16 rows [n, H] of rank r's local expert l in canonical order. With only_rank "
        ">= 0: that rank's result alone (None for the others), expert_x[r][l] holds only the rows that came from "
        "only_rank, and the other ranks' topk_idx / topk_weights may be None.");

  using I = const InternodeResult&;
  const auto per_row = [](const auto& v, size_t rows) { return to_numpy(std::vector(v), {rows}); };
  const auto matrix = [](const auto& v, size_t rows, size_t cols) { return copy_out(v, rows, cols); };
  auto internode = nb::class_<InternodeResult>(m, "InternodeDispatchResult",
                                               "One rank's internode dispatch result: the user-visible outputs "
                                               "(intranode's for the same routing), DeepEP's handle entries and the "
                                               "rank's view as a forwarder (tests/reference/reference.hpp)");
  def_normal_outputs(internode);
  internode.def_prop_ro("num_nvl_ranks", [](I d) { return d.r.num_nvl_ranks; })
      .def_prop_ro("num_channels", [](I d) { return d.r.num_channels; })
      .def_prop_ro("num_forward", [](I d) { return d.r.num_forward; })
      .def_prop_ro(
          "is_token_in_rank",
          [=](I d) {
            return matrix(d.r.is_token_in_rank, d.r.is_token_in_rank.size() / d.num_ranks, size_t(d.num_ranks));
          },
          fresh, "[0] uint8 [T, R]")
      .def_prop_ro(
          "rdma_channel_prefix_matrix",
          [=](I d) { return matrix(d.r.rdma_channel_prefix_matrix, d.num_domains(), d.r.num_channels); }, fresh,
          "[1] int32 [N, C]")
      .def_prop_ro(
          "gbl_channel_prefix_matrix",
          [=](I d) { return matrix(d.r.gbl_channel_prefix_matrix, d.num_ranks, d.r.num_channels); }, fresh,
          "[2] int32 [R, C]")
      .def_prop_ro(
          "recv_rdma_channel_prefix_matrix",
          [=](I d) {
            return matrix(d.r.recv_rdma_channel_prefix_matrix, size_t(d.num_domains()) * d.r.num_parts,
                          d.r.num_channels);
          },
          fresh, "[3] int32 [N x num_parts, C]: row s num_parts + p for the source of part p in domain s")
      .def_prop_ro(
          "recv_rdma_rank_prefix_sum",
          [=](I d) { return per_row(d.r.recv_rdma_rank_prefix_sum, size_t(d.num_domains()) * d.r.num_parts); }, fresh,
          "[4] int32 [N x num_parts]: prefix over (source domain, part)")
      .def_prop_ro(
          "recv_gbl_channel_prefix_matrix",
          [=](I d) { return matrix(d.r.recv_gbl_channel_prefix_matrix, d.num_ranks, d.r.num_channels); }, fresh,
          "[5] int32 [R, C]")
      .def_prop_ro(
          "recv_gbl_rank_prefix_sum", [=](I d) { return per_row(d.r.recv_gbl_rank_prefix_sum, d.num_ranks); }, fresh,
          "[6] int32 [R] (DeepEP's handle[-4])")
      .def_prop_ro(
          "recv_nvl_mask", [=](I d) { return per_row(d.r.recv_nvl_mask, d.r.normal.num_recv); }, fresh,
          "[7]'s mask: uint32 [num_recv], bit j = the row's token reached local rank j of this domain")
      .def_prop_ro(
          "send_rdma_head",
          [=](I d) {
            const size_t num_tokens = d.r.num_channels > 0 ? size_t(d.r.normal.num_tokens) : 0;
            return matrix(d.r.send_rdma_head, num_tokens, d.num_domains());
          },
          fresh, "[8] int32 [T, N] (empty without channels)")
      .def_prop_ro(
          "send_nvl_head",
          [=](I d) {
            const size_t rows = d.r.num_channels > 0 ? size_t(d.r.num_forward) : 0;
            return matrix(d.r.send_nvl_head, rows, d.r.num_nvl_ranks);
          },
          fresh, "[9] int32 [num_forward, D] in forward order (empty without channels)")
      .def_prop_ro(
          "num_parts", [](I d) { return d.r.num_parts; },
          "columns this rank forwards: 1 with every rank live, more as a substitute, 0 when masked")
      .def_prop_ro(
          "live",
          [=](I d) {
            std::vector<uint8_t> live(d.num_ranks);
            for (int r = 0; r < d.num_ranks; ++r) live[r] = d.r.live[r / 32] >> (r % 32) & 1;
            return to_numpy(std::move(live), {size_t(d.num_ranks)});
          },
          fresh, "uint8 [R]: 1 where the rank took part in the dispatch")
      .def_prop_ro(
          "forward_src_domain", [=](I d) { return per_row(d.r.forward_src_domain, d.r.num_forward); }, fresh)
      .def_prop_ro(
          "forward_src_rank", [=](I d) { return per_row(d.r.forward_src_rank, d.r.num_forward); }, fresh)
      .def_prop_ro(
          "forward_src_idx", [=](I d) { return per_row(d.r.forward_src_idx, d.r.num_forward); }, fresh)
      .def_prop_ro("forward_nvl_mask", [=](I d) { return per_row(d.r.forward_nvl_mask, d.r.num_forward); }, fresh);
  m.def("internode_dispatch", &internode_dispatch, "x"_a, "x_scales"_a, "topk_idx"_a, "topk_weights"_a,
        "is_token_in_rank"_a, "num_experts"_a, "expert_alignment"_a, "num_nvl_ranks"_a, "num_channels"_a = 0,
        "live"_a = nb::none(),
        "Every rank's internode dispatch result (lists as normal_dispatch takes); rank r is in NVL domain r // "
        "num_nvl_ranks. num_channels > 0 fills the channel entries of the handle. live: None (every rank) or a "
        "truth value per rank; a masked rank's input is ignored, it receives nothing, and its columns are "
        "forwarded by substitutes (shrink mode).");
  m.def("internode_combine", &internode_combine, "x"_a, "topk_weights"_a, "bias0"_a, "bias1"_a, "dispatch"_a,
        "hidden"_a, "num_topk"_a, "round_remote_partials"_a = true, "only_rank"_a = -1, "live"_a = nb::none(),
        "drop_lost_partials"_a = false,
        "Every rank's fp64 two-level combine, as normal_combine returns it; round_remote_partials rounds each "
        "partial sum of a domain other than the source's to bf16, as it crosses the network. live: None (the "
        "dispatch's) or a truth value per rank within the dispatch's; the rows of a rank left out are left out of "
        "every sum and its result is None. drop_lost_partials: the partial sums such a rank forwarded (for other "
        "domains' sources of the columns it served) are left out too, as the GPU combine in shrink mode leaves "
        "them; else they are summed as if another rank forwarded them.");
  m.def("internode_forwarders", &internode_forwarders, "num_ranks"_a, "num_nvl_ranks"_a, "live"_a = nb::none(),
        "The forwarder plan of shrink mode across domains: (forwarder int32 [N, D]: the local index of the rank of "
        "domain e forwarding column n there, -1 if none; part int32 [N, D]: the part of that forwarder's rings "
        "column n uses; num_parts int32 [R]).");
  nb::class_<reference::InternodeWireParams>(m, "InternodeWireParams")
      .def(nb::init<>())
      .def_rw("row_bytes", &reference::InternodeWireParams::row_bytes)
      .def_rw("num_scales", &reference::InternodeWireParams::num_scales)
      .def_rw("num_topk", &reference::InternodeWireParams::num_topk)
      .def_rw("hidden", &reference::InternodeWireParams::hidden)
      .def_rw("num_nvl_ranks", &reference::InternodeWireParams::num_nvl_ranks)
      .def_rw("num_channels", &reference::InternodeWireParams::num_channels)
      .def_rw("chunk_tokens", &reference::InternodeWireParams::chunk_tokens);
  m.def("internode_wire", &internode_wire, "is_token_in_rank"_a, "params"_a, "live"_a = nb::none(),
        "Per rank, a dict of the network bytes and puts of one dispatch and one combine in turnout's, DeepEP's and "
        "a per-rank protocol (keys <op>_<protocol>_bytes / _messages), and the (token, domain) and (token, rank) "
        "pairs that cross; is_token_in_rank: one uint8 [T, R] array per rank. live: None (every rank) or a truth "
        "value per rank.");
  m.def("turnout_dispatch_token_bytes", &reference::turnout_dispatch_token_bytes, "row_bytes"_a, "num_scales"_a,
        "num_topk"_a);
  m.def("deepep_dispatch_token_bytes", &reference::deepep_dispatch_token_bytes, "row_bytes"_a, "num_scales"_a,
        "num_topk"_a);
  m.def("turnout_combine_token_bytes", &reference::turnout_combine_token_bytes, "hidden"_a, "num_topk"_a);
  m.def("deepep_combine_token_bytes", &reference::deepep_combine_token_bytes, "hidden"_a, "num_topk"_a);
}
