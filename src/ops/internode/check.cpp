#include "ops/internode/check.hpp"

#include <cstdint>
#include <string>

#include "kernels/internode/launch.hpp"
#include "ops/require.hpp"
#include "runtime/align.hpp"
#include "turnout/error.hpp"

namespace turnout::internode {
namespace {

using ops::check_num_experts;
using ops::check_num_topk;
using ops::require;
using ops::str;
namespace ki = kernels::internode;

int num_domains(const BufferShape& shape) {
  return shape.num_ranks / shape.num_nvl_ranks;
}

int channels_per_block(const BufferShape& shape) {
  return ki::channels_per_block(num_domains(shape), shape.num_nvl_ranks);
}

Regions regions(const BufferShape& shape, const Config& config, int num_local_experts, int slot_bytes) {
  const ki::Shape s =
      ki::make_shape(num_domains(shape), shape.num_nvl_ranks, shape.num_sms, config.num_max_rdma_chunked_recv_tokens,
                     config.num_max_nvl_chunked_recv_tokens, num_local_experts, slot_bytes, shape.shrink);
  return {ki::make_net_region(s), ki::make_nvl_region(s)};
}

// The counts areas hold what the counts step exchanges: a fixed size, so the
// size hints cover them.
// Shrink mode keeps the views of its agreement in the last bytes of the
// network counts area (NetRegion::view_epoch), which the counts must not reach.
void check_counts_fit(const char* op, const Regions& r, bool shrink) {
  const int64_t net_limit = shrink ? r.net.view_epoch() : ki::kNetMetaBytes;
  const int64_t net_end = r.net.outbox + r.net.shape.num_domains * r.net.message_bytes;
  require(r.net.recv_rings <= ki::kNetMetaBytes && net_end <= net_limit && r.nvl.rings <= ki::kNvlMetaBytes, op, [&] {
    return "the counts of " + str(r.net.shape.num_local_experts) + " experts per rank over " +
           str(r.net.shape.num_channels) + " channels and " + str(r.net.shape.num_domains) +
           " domains exceed the counts areas (" + str(net_limit) + " network and " + str(ki::kNvlMetaBytes) +
           " NVL bytes): use fewer SMs or experts per rank";
  });
}

void check_fits(const char* op, const Regions& r, const BufferShape& shape) {
  check_counts_fit(op, r, shape.shrink);
  require(static_cast<size_t>(r.net.total) <= shape.num_rdma_bytes, op, [&] {
    return "num_rdma_bytes is too small for this call: it needs " + str(r.net.total) + " bytes (" +
           str(r.net.shape.num_channels) + " channels x " + str(r.net.shape.num_domains) + " domains x 2 rings of " +
           str(r.net.shape.net_slots) + " slots of " + str(r.net.shape.slot_bytes) +
           " bytes, plus counts), the buffer has " + str(static_cast<int64_t>(shape.num_rdma_bytes)) +
           "; size it with Config.get_rdma_buffer_size_hint";
  });
  require(static_cast<size_t>(r.nvl.total) <= shape.num_nvl_bytes, op, [&] {
    return "num_nvl_bytes is too small for this call: it needs " + str(r.nvl.total) + " bytes (" +
           str(r.nvl.shape.num_channels) + " channels x " + str(r.nvl.shape.num_nvl_ranks) + " ranks x " +
           str(r.nvl.shape.nvl_slots) + " slots of " + str(r.nvl.shape.slot_bytes) +
           " bytes, plus counts), the buffer has " + str(static_cast<int64_t>(shape.num_nvl_bytes)) +
           "; size it with Config.get_nvl_buffer_size_hint";
  });
}

}  // namespace

void check_config(const char* op, const Config& c, const BufferShape& shape) {
  require(c.num_sms >= 2 && c.num_sms % 2 == 0 && c.num_sms / 2 <= kernels::kMaxChannels, op, [&] {
    return "config.num_sms must be even and in [2, " + str(2 * kernels::kMaxChannels) + "], got " + str(c.num_sms);
  });
  require(
      c.num_max_nvl_chunked_send_tokens >= 1 && c.num_max_nvl_chunked_send_tokens <= c.num_max_nvl_chunked_recv_tokens,
      op, [&] {
        return "config needs 1 <= num_max_nvl_chunked_send_tokens <= num_max_nvl_chunked_recv_tokens, got " +
               str(c.num_max_nvl_chunked_send_tokens) + " and " + str(c.num_max_nvl_chunked_recv_tokens);
      });
  require(c.num_max_rdma_chunked_send_tokens >= 1 &&
              c.num_max_rdma_chunked_send_tokens <= c.num_max_rdma_chunked_recv_tokens,
          op, [&] {
            return "config needs 1 <= num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens, got " +
                   str(c.num_max_rdma_chunked_send_tokens) + " and " + str(c.num_max_rdma_chunked_recv_tokens);
          });
  // A block pair runs K channels, each with 1/K of the rings' slots.
  const int k = channels_per_block(shape);
  require(c.num_max_nvl_chunked_recv_tokens >= num_domains(shape) * k, op, [&] {
    return "config.num_max_nvl_chunked_recv_tokens must be at least " + str(num_domains(shape) * k) + " (the " +
           str(num_domains(shape)) + " NVL domains times the " + str(k) +
           " channels a block runs: each channel's NVL ring is split per source domain), got " +
           str(c.num_max_nvl_chunked_recv_tokens);
  });
  require(c.num_max_rdma_chunked_recv_tokens >= k, op, [&] {
    return "config.num_max_rdma_chunked_recv_tokens must be at least " + str(k) + " (the channels a block runs), got " +
           str(c.num_max_rdma_chunked_recv_tokens);
  });
  // Shrink mode: a rank may forward for every column of its domain, each
  // with a part of a channel's network ring; a part needs a slot at least
  // (chunks are clamped to a part, docs/INTERNODE.md "Shrink across domains").
  if (shape.shrink)
    require(c.num_max_rdma_chunked_recv_tokens / k >= shape.num_nvl_ranks, op, [&] {
      return "config.num_max_rdma_chunked_recv_tokens must be at least " + str(k * shape.num_nvl_ranks) +
             " in shrink mode (the " + str(k) + " channels a block runs times the " + str(shape.num_nvl_ranks) +
             " columns a rank may forward for), got " + str(c.num_max_rdma_chunked_recv_tokens);
    });
}

void check_handle(const char* op, const InternodeHandle& h, const BufferShape& shape, bool counts_written) {
  require(h.num_tokens >= 0 && h.num_recv >= 0 && h.num_forward >= 0, op,
          "the handle's token, receive and forward counts must be >= 0");
  const int channels = shape.num_sms / 2 * channels_per_block(shape);
  require(h.num_channels == channels, op, [&] {
    return "the handle was made with " + str(h.num_channels) + " channels, this call runs " + str(channels) +
           " (config.num_sms / 2 block pairs within the SM budget, " + str(channels_per_block(shape)) +
           " channels each): pass the dispatch's config";
  });
  require(h.num_tokens == 0 || h.is_token_in_rank, op, "handle[0] (is_token_in_rank) must be given");
  require(shape.shrink == (h.live != nullptr), op,
          shape.shrink ? "a shrink-mode buffer's handle carries its live set (entry [10])"
                       : "handle[10] (the live set) belongs to shrink mode only");
  require(h.rdma_channel_prefix_matrix && h.gbl_channel_prefix_matrix && h.recv_rdma_channel_prefix_matrix &&
              h.recv_rdma_rank_prefix_sum && h.recv_gbl_channel_prefix_matrix && h.recv_gbl_rank_prefix_sum,
          op, "the handle's entries [1] to [6] must be given");
  if (!counts_written) {
    require(h.num_recv == 0 || h.recv_src_meta, op, "handle[7] (recv_src_meta) must be given");
    require(h.num_tokens == 0 || h.send_rdma_head, op, "handle[8] (send_rdma_head) must be given");
    require(h.num_forward == 0 || h.send_nvl_head, op, "handle[9] (send_nvl_head) must be given");
  }
}

Regions check_dispatch_counts(const InternodeDispatchCountsArgs& a, const BufferShape& shape) {
  const char* op = "dispatch";
  const int R = shape.num_ranks;
  check_config(op, a.config, shape);
  require(a.num_tokens >= 0, op, [&] { return "num_tokens must be >= 0, got " + str(a.num_tokens); });
  require(a.handle.num_tokens == a.num_tokens, op, "the handle's token count must be the call's");
  check_handle(op, a.handle, shape, true);
  require(a.expert_alignment >= 1, op, [&] { return "expert_alignment must be >= 1, got " + str(a.expert_alignment); });
  require(a.num_worst_tokens >= 0, op, [&] { return "num_worst_tokens must be >= 0, got " + str(a.num_worst_tokens); });
  check_num_topk(op, a.num_topk);
  require(a.num_topk == 0 || a.num_tokens == 0 || a.topk_idx, op, "topk_idx must be given with num_topk > 0");
  if (a.num_tokens_per_expert || a.num_topk > 0) check_num_experts(op, a.num_experts, R);
  require(!a.cached || (a.num_tokens_per_expert == nullptr && a.num_topk == 0), op,
          "a cached dispatch takes no top-k and no per-expert counts");
  const int experts = a.num_tokens_per_expert ? a.num_experts / R : 0;
  require(experts <= ki::kMaxMailboxExperts, op,
          [&] { return "at most " + str(ki::kMaxMailboxExperts) + " experts per rank, got " + str(experts); });
  // Only the counts areas are used here; the data step checks the rings.
  const Regions r = regions(shape, a.config, experts, 16);
  check_counts_fit(op, r, shape.shrink);
  require(static_cast<size_t>(r.net.recv_rings) <= shape.num_rdma_bytes &&
              static_cast<size_t>(r.nvl.rings) <= shape.num_nvl_bytes,
          op, [&] {
            return "the buffer is too small for this call's counts: it needs " + str(r.net.recv_rings) +
                   " bytes of num_rdma_bytes and " + str(r.nvl.rings) +
                   " of num_nvl_bytes; size them with the "
                   "Config's size hints";
          });
  return r;
}

Regions check_dispatch(const InternodeDispatchArgs& a, const BufferShape& shape) {
  const char* op = "dispatch";
  check_config(op, a.config, shape);
  require(a.num_tokens >= 0 && a.handle.num_tokens == a.num_tokens, op,
          "num_tokens must be >= 0 and the handle's token count");
  require(a.row_bytes > 0 && a.row_bytes % 16 == 0, op,
          [&] { return "the row of x must be a positive multiple of 16 bytes, got " + str(a.row_bytes); });
  require(a.num_scales >= 0 && (a.num_scales == 0 || a.num_tokens == 0 || a.x_scales), op,
          "x_scales must be given with num_scales > 0");
  check_num_topk(op, a.num_topk);
  if (a.num_topk > 0) {
    require(a.num_tokens == 0 || (a.topk_idx && a.topk_weights), op,
            "topk_idx and topk_weights must be given together");
    check_num_experts(op, a.num_experts, shape.num_ranks);
  }
  require(a.num_tokens == 0 || a.x, op, "x must be given");
  require(is_aligned(a.x, 16), op, "x must start at a 16-byte aligned address");
  check_handle(op, a.handle, shape, false);
  const int rows = a.handle.num_recv;
  require(rows == 0 || a.recv_x, op, "recv_x must be given");
  require(a.num_scales == 0 || rows == 0 || a.recv_x_scales, op, "recv_x_scales must be given with scales");
  require(a.num_topk == 0 || rows == 0 || (a.recv_topk_idx && a.recv_topk_weights), op,
          "recv_topk_idx and recv_topk_weights must be given with top-k");
  require(is_aligned(a.recv_x, 16), op, "recv_x must start at a 16-byte aligned address");
  require(a.num_worst_tokens == 0 ||
              (rows == a.num_worst_tokens && a.handle.num_forward == shape.num_nvl_ranks * a.num_worst_tokens),
          op, [&] {
            return "with num_worst_tokens " + str(a.num_worst_tokens) + " the outputs hold that many rows and " +
                   "handle[9] D x that many, got " + str(rows) + " and " + str(a.handle.num_forward);
          });
  require(shape.num_ranks / shape.num_nvl_ranks + shape.num_nvl_ranks <= 32, op, [&] {
    return "this version takes at most 32 - D NVL domains of D ranks (a warp per domain and per local rank in one "
           "block), got " +
           str(shape.num_ranks / shape.num_nvl_ranks) + " of " + str(shape.num_nvl_ranks);
  });
  // A fresh dispatch's forwarders read the counts step's messages, laid out
  // by its expert count.
  const int experts = a.cached || a.num_experts == 0 ? 0 : a.num_experts / shape.num_ranks;
  const auto slot = kernels::internode::make_token_slot(a.row_bytes, a.num_scales, a.num_topk);
  const Regions r = regions(shape, a.config, experts, slot.bytes);
  check_fits(op, r, shape);
  return r;
}

Regions check_combine(const InternodeCombineArgs& a, const BufferShape& shape) {
  const char* op = "combine";
  check_config(op, a.config, shape);
  require(a.hidden > 0 && a.hidden % 8 == 0, op,
          [&] { return "hidden must be a positive multiple of 8, got " + str(a.hidden); });
  check_num_topk(op, a.num_topk);
  const InternodeHandle& h = a.handle;
  check_handle(op, h, shape, false);
  require(a.num_topk == 0 || ((h.num_recv == 0 || a.topk_weights) && (h.num_tokens == 0 || a.combined_topk_weights)),
          op, "topk_weights and combined_topk_weights must be given together");
  require(h.num_recv == 0 || a.x, op, "x must be given");
  require(h.num_tokens == 0 || a.combined_x, op, "combined_x must be given");
  require(is_aligned(a.x, 16) && is_aligned(a.combined_x, 16) && is_aligned(a.bias0, 16) && is_aligned(a.bias1, 16), op,
          "x, combined_x and the biases must start at a 16-byte aligned address");
  const auto slot = kernels::make_combine_slot(a.hidden, a.num_topk);
  const Regions r = regions(shape, a.config, 0, slot.bytes);
  check_fits(op, r, shape);
  return r;
}

}  // namespace turnout::internode

namespace turnout {

int internode_channels_per_block(int num_domains, int num_nvl_ranks) {
  return kernels::internode::channels_per_block(num_domains, num_nvl_ranks);
}

}  // namespace turnout
