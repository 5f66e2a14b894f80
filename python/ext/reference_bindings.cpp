#include "reference_bindings.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/tuple.h>

#include <initializer_list>
#include <stdexcept>
#include <vector>

#include "turnout/reference.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace turnout::bindings {
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
  auto l = reference::get_dispatch_layout({topk_idx.data(), topk_idx.size()}, t, k, num_ranks, num_experts,
                                          num_nvl_ranks);
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

}  // namespace

void bind_reference(nb::module_& m) {
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

}  // namespace turnout::bindings
