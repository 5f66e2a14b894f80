#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <initializer_list>
#include <stdexcept>
#include <string>
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

std::vector<DispatchResult> normal_dispatch(const nb::list& x, const nb::list& x_scales, const nb::list& topk_idx,
                                            const nb::list& topk_weights, const nb::list& is_token_in_rank,
                                            int num_experts, int expert_alignment) {
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
  auto results = reference::normal_dispatch(inputs, params);
  std::vector<DispatchResult> out;
  for (auto& r : results) out.push_back({std::move(r), params.row_bytes, params.num_scales, params.num_topk});
  return out;
}

nb::list normal_combine(const nb::list& x, const nb::list& topk_weights, const nb::list& bias0, const nb::list& bias1,
                        const std::vector<DispatchResult>& dispatch, int hidden, int num_topk, int only_rank) {
  std::vector<reference::NormalCombineInput> inputs(x.size());
  std::vector<reference::NormalDispatchResult> results;
  for (size_t r = 0; r < inputs.size(); ++r) {
    inputs[r].x = list_item<uint16_t>(x, r, "x");
    inputs[r].topk_weights = list_item<float>(topk_weights, r, "topk_weights");
    inputs[r].bias0 = list_item<uint16_t>(bias0, r, "bias0");
    inputs[r].bias1 = list_item<uint16_t>(bias1, r, "bias1");
    results.push_back(dispatch.at(r).r);
  }
  auto combined = reference::normal_combine(inputs, results, hidden, num_topk, only_rank);
  nb::list out;
  for (size_t r = 0; r < combined.size(); ++r) {
    if (only_rank >= 0 && r != static_cast<size_t>(only_rank)) {
      out.append(nb::none());
      continue;
    }
    const size_t t = results[r].num_tokens;
    out.append(nb::make_tuple(to_numpy(std::move(combined[r].combined_x), {t, size_t(hidden)}),
                              to_numpy(std::move(combined[r].combined_topk_weights), {t, size_t(num_topk)})));
  }
  return out;
}

template <typename T>
auto copy_out(const std::vector<T>& v, size_t rows, size_t cols) {
  return to_numpy(std::vector<T>(v), {rows, cols});
}

}  // namespace

NB_MODULE(turnout_reference, m) {
  m.doc() = "Host reference of every op: the oracle the tests compare turnout with";
  // Each property hands Python a new array or value of its own.
  constexpr auto fresh = nb::rv_policy::automatic;
  using D = const DispatchResult&;
  nb::class_<DispatchResult>(m, "NormalDispatchResult")
      .def_prop_ro(
          "num_recv", [](D d) { return d.r.num_recv; }, fresh)
      .def_prop_ro(
          "recv_x", [](D d) { return copy_out(d.r.recv_x, d.r.num_recv, d.row_bytes); }, fresh)
      .def_prop_ro(
          "recv_x_scales", [](D d) { return copy_out(d.r.recv_x_scales, d.r.num_recv, d.num_scales); }, fresh)
      .def_prop_ro(
          "recv_topk_idx", [](D d) { return copy_out(d.r.recv_topk_idx, d.r.num_recv, d.num_topk); }, fresh)
      .def_prop_ro(
          "recv_topk_weights", [](D d) { return copy_out(d.r.recv_topk_weights, d.r.num_recv, d.num_topk); }, fresh)
      .def_prop_ro(
          "recv_src_idx", [](D d) { return to_numpy(std::vector<int32_t>(d.r.recv_src_idx), {size_t(d.r.num_recv)}); },
          fresh)
      .def_prop_ro(
          "recv_src_rank",
          [](D d) { return to_numpy(std::vector<int32_t>(d.r.recv_src_rank), {size_t(d.r.num_recv)}); }, fresh)
      .def_prop_ro(
          "num_recv_tokens_per_expert", [](D d) { return std::vector<int32_t>(d.r.num_recv_tokens_per_expert); }, fresh)
      .def_prop_ro(
          "rank_prefix_matrix",
          [](D d) {
            const size_t r = static_cast<size_t>(std::lround(std::sqrt(double(d.r.rank_prefix_matrix.size()))));
            return copy_out(d.r.rank_prefix_matrix, r, r);
          },
          fresh);
  m.def("normal_dispatch", &normal_dispatch, "x"_a, "x_scales"_a, "topk_idx"_a, "topk_weights"_a, "is_token_in_rank"_a,
        "num_experts"_a, "expert_alignment"_a,
        "Every rank's dispatch result from every rank's input (lists, one numpy array or None per rank).");
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
  m.def("cast_to_fp8", &cast_to_fp8, "x"_a, "round_scale"_a, "use_ue8m0"_a,
        "Per-128-channel FP8 cast of bf16 rows (uint16 bits): (q uint8, scales float32, packed ue8m0 uint32)");
}
