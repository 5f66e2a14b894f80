#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.hpp"

namespace turnout::bindings {

using namespace nb::literals;

namespace {

// The entries' addresses (0 where absent: [10], the live set, exists only in
// shrink mode) and the sizes the host knows.
using HandleAddresses = std::array<uintptr_t, 11>;

InternodeHandle handle_of(const HandleAddresses& e, int num_tokens, int num_channels, int num_recv, int num_forward) {
  InternodeHandle h;
  h.is_token_in_rank = ptr<const bool>(e[0]);
  h.rdma_channel_prefix_matrix = ptr<int32_t>(e[1]);
  h.gbl_channel_prefix_matrix = ptr<int32_t>(e[2]);
  h.recv_rdma_channel_prefix_matrix = ptr<int32_t>(e[3]);
  h.recv_rdma_rank_prefix_sum = ptr<int32_t>(e[4]);
  h.recv_gbl_channel_prefix_matrix = ptr<int32_t>(e[5]);
  h.recv_gbl_rank_prefix_sum = ptr<int32_t>(e[6]);
  h.recv_src_meta = ptr<int32_t>(e[7]);
  h.send_rdma_head = ptr<int32_t>(e[8]);
  h.send_nvl_head = ptr<int32_t>(e[9]);
  h.live = ptr<uint32_t>(e[10]);
  h.num_tokens = num_tokens;
  h.num_channels = num_channels;
  h.num_recv = num_recv;
  h.num_forward = num_forward;
  return h;
}

std::tuple<int, int, std::vector<int>, int> dispatch_counts(Buffer& b, const HandleAddresses& handle, int num_tokens,
                                                            int num_channels, uintptr_t num_tokens_per_expert,
                                                            int num_experts, uintptr_t topk_idx, int num_topk,
                                                            int expert_alignment, int num_worst_tokens, bool cached,
                                                            const Config& config, uintptr_t s, MaybeStream wait_for) {
  InternodeDispatchCountsArgs a;
  a.num_tokens = num_tokens;
  a.num_tokens_per_expert = ptr<const int32_t>(num_tokens_per_expert);
  a.num_experts = num_experts;
  a.topk_idx = ptr<const int64_t>(topk_idx);
  a.num_topk = num_topk;
  a.expert_alignment = expert_alignment;
  a.num_worst_tokens = num_worst_tokens;
  a.cached = cached;
  a.config = config;
  a.handle = handle_of(handle, num_tokens, num_channels, 0, 0);
  // The host wait runs without the GIL; a call that does not wait keeps it.
  std::optional<nb::gil_scoped_release> release;
  if (!cached && num_worst_tokens == 0 && num_tokens_per_expert != 0) release.emplace();
  join_before(b, s, wait_for);
  InternodeDispatchCounts c = b.internode_dispatch_counts(a, stream(s));
  return {c.num_recv_tokens, c.num_forward_tokens, std::move(c.num_recv_tokens_per_expert), c.num_parts};
}

void dispatch(Buffer& b, const HandleAddresses& handle, int num_tokens, int num_channels, int num_recv, int num_forward,
              uintptr_t x, int row_bytes, uintptr_t x_scales, int num_scales, int64_t scale_stride_token,
              int64_t scale_stride_group, uintptr_t topk_idx, uintptr_t topk_weights, int num_topk, int num_experts,
              int num_worst_tokens, bool cached, const Config& config, uintptr_t recv_x, uintptr_t recv_x_scales,
              uintptr_t recv_topk_idx, uintptr_t recv_topk_weights, uintptr_t s, MaybeStream join_to) {
  InternodeDispatchArgs a;
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
  a.num_worst_tokens = num_worst_tokens;
  a.cached = cached;
  a.config = config;
  a.handle = handle_of(handle, num_tokens, num_channels, num_recv, num_forward);
  a.recv_x = ptr<void>(recv_x);
  a.recv_x_scales = ptr<void>(recv_x_scales);
  a.recv_topk_idx = ptr<int64_t>(recv_topk_idx);
  a.recv_topk_weights = ptr<float>(recv_topk_weights);
  b.internode_dispatch(a, stream(s));
  join_after(b, s, join_to);
}

void combine(Buffer& b, const HandleAddresses& handle, int num_tokens, int num_channels, int num_recv, int num_forward,
             uintptr_t x, int hidden, uintptr_t topk_weights, int num_topk, uintptr_t bias0, uintptr_t bias1,
             const Config& config, uintptr_t combined_x, uintptr_t combined_topk_weights, uintptr_t s,
             MaybeStream wait_for, MaybeStream join_to) {
  InternodeCombineArgs a;
  a.x = ptr<const void>(x);
  a.hidden = hidden;
  a.topk_weights = ptr<const float>(topk_weights);
  a.num_topk = num_topk;
  a.bias0 = ptr<const void>(bias0);
  a.bias1 = ptr<const void>(bias1);
  a.config = config;
  a.handle = handle_of(handle, num_tokens, num_channels, num_recv, num_forward);
  a.combined_x = ptr<void>(combined_x);
  a.combined_topk_weights = ptr<float>(combined_topk_weights);
  join_before(b, s, wait_for);
  b.internode_combine(a, stream(s));
  join_after(b, s, join_to);
}

}  // namespace

void bind_internode(BufferClass& buffer) {
  buffer.def_prop_ro("num_internode_bytes", &Buffer::num_internode_bytes)
      .def_prop_ro("internode_channels_per_block",
                   [](const Buffer& b) {
                     const Topology& t = b.topology();
                     return internode_channels_per_block(t.num_rdma_ranks(), t.num_nvl_ranks);
                   })
      .def("internode_dispatch_counts", &dispatch_counts, "handle"_a, "num_tokens"_a, "num_channels"_a,
           "num_tokens_per_expert"_a, "num_experts"_a, "topk_idx"_a, "num_topk"_a, "expert_alignment"_a,
           "num_worst_tokens"_a, "cached"_a, "config"_a, "stream"_a, "wait_for"_a)
      .def("internode_dispatch", &dispatch, "handle"_a, "num_tokens"_a, "num_channels"_a, "num_recv"_a, "num_forward"_a,
           "x"_a, "row_bytes"_a, "x_scales"_a, "num_scales"_a, "scale_stride_token"_a, "scale_stride_group"_a,
           "topk_idx"_a, "topk_weights"_a, "num_topk"_a, "num_experts"_a, "num_worst_tokens"_a, "cached"_a, "config"_a,
           "recv_x"_a, "recv_x_scales"_a, "recv_topk_idx"_a, "recv_topk_weights"_a, "stream"_a, "join_to"_a)
      .def("internode_combine", &combine, "handle"_a, "num_tokens"_a, "num_channels"_a, "num_recv"_a, "num_forward"_a,
           "x"_a, "hidden"_a, "topk_weights"_a, "num_topk"_a, "bias0"_a, "bias1"_a, "config"_a, "combined_x"_a,
           "combined_topk_weights"_a, "stream"_a, "wait_for"_a, "join_to"_a);
}

}  // namespace turnout::bindings
