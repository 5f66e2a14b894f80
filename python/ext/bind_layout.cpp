#include <nanobind/stl/optional.h>

#include "bindings.hpp"

namespace turnout::bindings {

using namespace nb::literals;

namespace {

void get_dispatch_layout(Buffer& b, uintptr_t topk_idx, int num_tokens, int num_topk, int num_experts,
                         uintptr_t num_tokens_per_rank, uintptr_t num_tokens_per_rdma_rank,
                         uintptr_t num_tokens_per_expert, uintptr_t is_token_in_rank, uintptr_t s, MaybeStream wait_for,
                         MaybeStream join_to) {
  LayoutArgs a;
  a.topk_idx = ptr<const int64_t>(topk_idx);
  a.num_tokens = num_tokens;
  a.num_topk = num_topk;
  a.num_experts = num_experts;
  a.num_tokens_per_rank = ptr<int32_t>(num_tokens_per_rank);
  a.num_tokens_per_rdma_rank = ptr<int32_t>(num_tokens_per_rdma_rank);
  a.num_tokens_per_expert = ptr<int32_t>(num_tokens_per_expert);
  a.is_token_in_rank = ptr<bool>(is_token_in_rank);
  join_before(b, s, wait_for);
  b.get_dispatch_layout(a, stream(s));
  join_after(b, s, join_to);
}

}  // namespace

void bind_layout(BufferClass& buffer) {
  buffer.def("get_dispatch_layout", &get_dispatch_layout, "topk_idx"_a, "num_tokens"_a, "num_topk"_a, "num_experts"_a,
             "num_tokens_per_rank"_a, "num_tokens_per_rdma_rank"_a, "num_tokens_per_expert"_a, "is_token_in_rank"_a,
             "stream"_a, "wait_for"_a, "join_to"_a);
}

}  // namespace turnout::bindings
