#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "intranode_entry.hpp"
#include "turnout/error.hpp"

namespace turnout::bindings {

using namespace nb::literals;

namespace {

// The part of a Config the intranode ops read (every args struct has it).
template <typename Args>
void set_channels(Args& a, const Config& config) {
  a.num_sms = config.num_sms;
  a.num_max_send_tokens = config.num_max_nvl_chunked_send_tokens;
  a.num_max_recv_tokens = config.num_max_nvl_chunked_recv_tokens;
}

// (num_recv, num_recv_tokens_per_expert, own_rows_begin, num_own_rows); see DispatchCounts.
std::tuple<int, std::vector<int>, int, int> dispatch_counts(Buffer& b, uintptr_t is_token_in_rank, int num_tokens,
                                                            uintptr_t num_tokens_per_expert, int num_experts,
                                                            uintptr_t topk_idx, int num_topk, int expert_alignment,
                                                            int num_worst_tokens, const Config& config,
                                                            uintptr_t rank_prefix_matrix, uintptr_t s,
                                                            MaybeStream wait_for) {
  DispatchCountsArgs a;
  a.num_tokens = num_tokens;
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.num_tokens_per_expert = ptr<const int32_t>(num_tokens_per_expert);
  a.num_experts = num_experts;
  a.topk_idx = ptr<const int64_t>(topk_idx);
  a.num_topk = num_topk;
  a.expert_alignment = expert_alignment;
  a.num_worst_tokens = num_worst_tokens;
  set_channels(a, config);
  a.rank_prefix_matrix = ptr<int32_t>(rank_prefix_matrix);
  // The host wait runs without the GIL (other threads may drive other GPUs);
  // a call that does not wait keeps it (releasing costs time).
  std::optional<nb::gil_scoped_release> release;
  if (num_worst_tokens == 0 && num_tokens_per_expert != 0) release.emplace();
  join_before(b, s, wait_for);
  DispatchCounts c = b.dispatch_counts(a, stream(s));
  return {c.num_recv_tokens, std::move(c.num_recv_tokens_per_expert), c.own_rows_begin, c.num_own_rows};
}

// The data step's arguments (the counts step reads a subset of them).
DispatchArgs dispatch_args(uintptr_t x, int num_tokens, int row_bytes, uintptr_t x_scales, int num_scales,
                           int64_t scale_stride_token, int64_t scale_stride_group, uintptr_t topk_idx,
                           uintptr_t topk_weights, int num_topk, int num_experts, uintptr_t is_token_in_rank,
                           uintptr_t rank_prefix_matrix, int num_recv_rows, int num_worst_tokens, const Config& config,
                           uintptr_t recv_x, uintptr_t recv_x_scales, uintptr_t recv_topk_idx,
                           uintptr_t recv_topk_weights, uintptr_t recv_src_idx, uintptr_t source_num_tokens) {
  DispatchArgs a;
  a.x = ptr<const void>(x);
  a.num_tokens = num_tokens;
  a.row_bytes = row_bytes;
  a.x_scales = ptr<const void>(x_scales);
  a.num_scales = num_scales;
  a.scale_stride_token = scale_stride_token;
  a.scale_stride_group = scale_stride_group;
  a.topk_idx = ptr<const int64_t>(topk_idx);
  a.topk_weights = ptr<const float>(topk_weights);
  a.num_topk = num_topk;
  a.num_experts = num_experts;
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.rank_prefix_matrix = ptr<const int32_t>(rank_prefix_matrix);
  a.num_recv_rows = num_recv_rows;
  a.num_worst_tokens = num_worst_tokens;
  set_channels(a, config);
  a.out.recv_x = ptr<void>(recv_x);
  a.out.recv_x_scales = ptr<void>(recv_x_scales);
  a.out.recv_topk_idx = ptr<int64_t>(recv_topk_idx);
  a.out.recv_topk_weights = ptr<float>(recv_topk_weights);
  a.out.recv_src_idx = ptr<int32_t>(recv_src_idx);
  a.out.source_num_tokens = ptr<int32_t>(source_num_tokens);
  return a;
}

void dispatch(Buffer& b, uintptr_t x, int num_tokens, int row_bytes, uintptr_t x_scales, int num_scales,
              int64_t scale_stride_token, int64_t scale_stride_group, uintptr_t topk_idx, uintptr_t topk_weights,
              int num_topk, int num_experts, uintptr_t is_token_in_rank, uintptr_t rank_prefix_matrix,
              int num_recv_rows, int num_worst_tokens, const Config& config, uintptr_t recv_x, uintptr_t recv_x_scales,
              uintptr_t recv_topk_idx, uintptr_t recv_topk_weights, uintptr_t recv_src_idx, uintptr_t source_num_tokens,
              uintptr_t s, MaybeStream join_to) {
  const DispatchArgs a = dispatch_args(
      x, num_tokens, row_bytes, x_scales, num_scales, scale_stride_token, scale_stride_group, topk_idx, topk_weights,
      num_topk, num_experts, is_token_in_rank, rank_prefix_matrix, num_recv_rows, num_worst_tokens, config, recv_x,
      recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx, source_num_tokens);
  b.dispatch(a, stream(s));
  join_after(b, s, join_to);
}

// A dispatch whose receive rows the host knows before the counts step (a
// cached one: the handle's; or one with num_worst_tokens): both steps in one
// call into the module, joins included. A cached dispatch passes no
// num_tokens_per_expert and num_worst_tokens 0; its counts step only checks
// that the handle's rows still fit.
void dispatch_known_rows(Buffer& b, uintptr_t x, int num_tokens, int row_bytes, uintptr_t x_scales, int num_scales,
                         int64_t scale_stride_token, int64_t scale_stride_group, uintptr_t topk_idx,
                         uintptr_t topk_weights, int num_topk, int num_experts, uintptr_t num_tokens_per_expert,
                         int expert_alignment, uintptr_t is_token_in_rank, uintptr_t rank_prefix_matrix,
                         int num_recv_rows, int num_worst_tokens, const Config& config, uintptr_t recv_x,
                         uintptr_t recv_x_scales, uintptr_t recv_topk_idx, uintptr_t recv_topk_weights,
                         uintptr_t recv_src_idx, uintptr_t source_num_tokens, uintptr_t s, MaybeStream wait_for,
                         MaybeStream join_to) {
  const DispatchArgs a = dispatch_args(
      x, num_tokens, row_bytes, x_scales, num_scales, scale_stride_token, scale_stride_group, topk_idx, topk_weights,
      num_topk, num_experts, is_token_in_rank, rank_prefix_matrix, num_recv_rows, num_worst_tokens, config, recv_x,
      recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx, source_num_tokens);
  DispatchCountsArgs counts;
  counts.num_tokens = num_tokens;
  counts.is_token_in_rank = a.is_token_in_rank;
  counts.num_tokens_per_expert = ptr<const int32_t>(num_tokens_per_expert);
  counts.num_experts = num_experts;
  counts.topk_idx = a.topk_idx;
  counts.num_topk = num_topk;
  counts.expert_alignment = expert_alignment;
  // The rows the outputs have: the counts step checks the receive count fits them.
  counts.num_worst_tokens = num_recv_rows;
  set_channels(counts, config);
  counts.rank_prefix_matrix = ptr<int32_t>(rank_prefix_matrix);
  join_before(b, s, wait_for);
  b.dispatch_known_rows(counts, a, stream(s));
  join_after(b, s, join_to);
}

void combine(Buffer& b, uintptr_t x, int num_rows, int hidden, uintptr_t topk_weights, int num_topk, uintptr_t bias0,
             uintptr_t bias1, uintptr_t rank_prefix_matrix, uintptr_t source_num_tokens, uintptr_t recv_src_idx,
             uintptr_t is_token_in_rank, int num_tokens, const Config& config, uintptr_t combined_x,
             uintptr_t combined_topk_weights, int own_rows_begin, int num_own_rows, uintptr_t s, MaybeStream wait_for,
             MaybeStream join_to) {
  CombineArgs a;
  a.x = ptr<const void>(x);
  a.num_rows = num_rows;
  a.hidden = hidden;
  a.topk_weights = ptr<const float>(topk_weights);
  a.num_topk = num_topk;
  a.bias0 = ptr<const void>(bias0);
  a.bias1 = ptr<const void>(bias1);
  a.rank_prefix_matrix = ptr<const int32_t>(rank_prefix_matrix);
  a.source_num_tokens = ptr<const int32_t>(source_num_tokens);
  a.recv_src_idx = ptr<const int32_t>(recv_src_idx);
  a.is_token_in_rank = ptr<const bool>(is_token_in_rank);
  a.num_tokens = num_tokens;
  set_channels(a, config);
  a.combined_x = ptr<void>(combined_x);
  a.combined_topk_weights = ptr<float>(combined_topk_weights);
  a.own_rows_begin = own_rows_begin;
  a.num_own_rows = num_own_rows;
  join_before(b, s, wait_for);
  b.combine(a, stream(s));
  join_after(b, s, join_to);
}

// The capsule's functions (intranode_entry.hpp): dispatch_known_rows and
// combine above, with the arguments already in their structs. `op(buffer,
// config)` runs where `native` and `config` are of _C's types (else 1); a C++
// exception becomes the Python error (-1).
template <typename Op>
int run_entry(PyObject* native, PyObject* config, Op op) {
  if (!nb::isinstance<Buffer>(nb::handle(native)) || !nb::isinstance<Config>(nb::handle(config))) return 1;
  try {
    op(*nb::inst_ptr<Buffer>(nb::handle(native)), *nb::inst_ptr<Config>(nb::handle(config)));
    return 0;
  } catch (...) {
    set_python_error(std::current_exception());
    return -1;
  }
}

int entry_dispatch_known_rows(PyObject* native, PyObject* config, DispatchCountsArgs* counts, DispatchArgs* a,
                              uintptr_t s) {
  return run_entry(native, config, [&](Buffer& b, const Config& c) {
    set_channels(*counts, c);
    set_channels(*a, c);
    b.dispatch_known_rows(*counts, *a, stream(s));
  });
}

int entry_combine(PyObject* native, PyObject* config, CombineArgs* a, uintptr_t s) {
  return run_entry(native, config, [&](Buffer& b, const Config& c) {
    set_channels(*a, c);
    b.combine(*a, stream(s));
  });
}

int entry_dispatch_counts(PyObject* native, PyObject* config, DispatchCountsArgs* counts, WaitedCounts* out,
                          uintptr_t s) {
  return run_entry(native, config, [&](Buffer& b, const Config& c) {
    set_channels(*counts, c);
    DispatchCounts got;
    {
      nb::gil_scoped_release release;
      got = b.dispatch_counts(*counts, stream(s));
    }
    if (got.num_recv_tokens_per_expert.size() != static_cast<size_t>(out->num_local_experts))
      throw Error("dispatch: " + std::to_string(got.num_recv_tokens_per_expert.size()) +
                  " per-expert counts for room of " + std::to_string(out->num_local_experts));
    std::copy(got.num_recv_tokens_per_expert.begin(), got.num_recv_tokens_per_expert.end(), out->per_expert);
    out->num_recv_tokens = got.num_recv_tokens;
    out->own_rows_begin = got.own_rows_begin;
    out->num_own_rows = got.num_own_rows;
  });
}

int entry_dispatch(PyObject* native, PyObject* config, DispatchArgs* a, uintptr_t s) {
  return run_entry(native, config, [&](Buffer& b, const Config& c) {
    set_channels(*a, c);
    b.dispatch(*a, stream(s));
  });
}

const IntranodeEntry kEntry = {sizeof(IntranodeEntry), sizeof(DispatchArgs),  sizeof(DispatchCountsArgs),
                               sizeof(CombineArgs),    sizeof(WaitedCounts),  entry_dispatch_known_rows,
                               entry_combine,          entry_dispatch_counts, entry_dispatch};

}  // namespace

void bind_intranode(BufferClass& buffer) {
  buffer.attr("intranode_entry") = nb::capsule(&kEntry, kIntranodeEntryName);
  buffer
      .def("dispatch_counts", &dispatch_counts, "is_token_in_rank"_a, "num_tokens"_a, "num_tokens_per_expert"_a,
           "num_experts"_a, "topk_idx"_a, "num_topk"_a, "expert_alignment"_a, "num_worst_tokens"_a, "config"_a,
           "rank_prefix_matrix"_a, "stream"_a, "wait_for"_a)
      .def("dispatch", &dispatch, "x"_a, "num_tokens"_a, "row_bytes"_a, "x_scales"_a, "num_scales"_a,
           "scale_stride_token"_a, "scale_stride_group"_a, "topk_idx"_a, "topk_weights"_a, "num_topk"_a,
           "num_experts"_a, "is_token_in_rank"_a, "rank_prefix_matrix"_a, "num_recv_rows"_a, "num_worst_tokens"_a,
           "config"_a, "recv_x"_a, "recv_x_scales"_a, "recv_topk_idx"_a, "recv_topk_weights"_a, "recv_src_idx"_a,
           "source_num_tokens"_a, "stream"_a, "join_to"_a)
      .def("dispatch_known_rows", &dispatch_known_rows, "x"_a, "num_tokens"_a, "row_bytes"_a, "x_scales"_a,
           "num_scales"_a, "scale_stride_token"_a, "scale_stride_group"_a, "topk_idx"_a, "topk_weights"_a, "num_topk"_a,
           "num_experts"_a, "num_tokens_per_expert"_a, "expert_alignment"_a, "is_token_in_rank"_a,
           "rank_prefix_matrix"_a, "num_recv_rows"_a, "num_worst_tokens"_a, "config"_a, "recv_x"_a, "recv_x_scales"_a,
           "recv_topk_idx"_a, "recv_topk_weights"_a, "recv_src_idx"_a, "source_num_tokens"_a, "stream"_a, "wait_for"_a,
           "join_to"_a)
      .def("combine", &combine, "x"_a, "num_rows"_a, "hidden"_a, "topk_weights"_a, "num_topk"_a, "bias0"_a, "bias1"_a,
           "rank_prefix_matrix"_a, "source_num_tokens"_a, "recv_src_idx"_a, "is_token_in_rank"_a, "num_tokens"_a,
           "config"_a, "combined_x"_a, "combined_topk_weights"_a, "own_rows_begin"_a, "num_own_rows"_a, "stream"_a,
           "wait_for"_a, "join_to"_a);
}

}  // namespace turnout::bindings
