// Intranode dispatch and combine: argument checks, the buffer region of the
// call, the host wait for the receive counts, and the kernel launches.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/intranode/launch.hpp"
#include "ops/require.hpp"
#include "runtime/host_wait.hpp"
#include "runtime/control_region.hpp"
#include "turnout/buffer.hpp"
#include "turnout/config.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

constexpr double kHostGraceS = 2.0;

std::string str(int64_t v) { return std::to_string(v); }

using ops::require;

// Rows move as 16-byte words. Null (no rows) passes.
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The channel layout of a config: checks shared by dispatch and combine.
void check_config(const char* op, int num_sms, int send_tokens, int recv_tokens) {
  require(num_sms >= 2 && num_sms % 2 == 0 && num_sms / 2 <= kernels::kMaxChannels, op, [&] {
    return "config.num_sms must be even and in [2, " + str(2 * kernels::kMaxChannels) + "], got " + str(num_sms);
  });
  require(send_tokens >= 1 && send_tokens <= recv_tokens, op, [&] {
    return "config needs 1 <= num_max_nvl_chunked_send_tokens <= num_max_nvl_chunked_recv_tokens, got " +
           str(send_tokens) + " and " + str(recv_tokens);
  });
}

void check_fits(const char* op, const kernels::IntranodeRegion& region, size_t num_nvl_bytes) {
  if (static_cast<size_t>(region.total) > num_nvl_bytes)
    throw InvalidArgument(std::string(op) + ": num_nvl_bytes is too small for this call: it needs " +
                          str(region.total) + " bytes (" + str(region.num_channels) + " channels x " +
                          str(region.num_ranks) + " ranks x " + str(region.ring_slots) + " slots of " +
                          str(region.slot_bytes) + " bytes, plus counts), the buffer has " +
                          str(static_cast<int64_t>(num_nvl_bytes)) + "; size it with Config.get_nvl_buffer_size_hint");
}

kernels::IntranodeRegion dispatch_region(int num_ranks, int num_sms, int num_experts, int recv_tokens,
                                         int slot_bytes) {
  return kernels::make_intranode_region(num_ranks, num_sms / 2, num_experts / num_ranks, recv_tokens, slot_bytes);
}

}  // namespace

// What every intranode op checks first: a live buffer, no timeout, one NVL
// domain, a usable config. Returns the SMs the op runs on: the config's, at
// most the budget, since every block must be resident at once (senders and
// receivers wait on each other, also across ranks that share a GPU). Input
// errors of earlier calls are raised only after the launches (see buffer.hpp).
int Buffer::begin_intranode_op(const char* op, int num_sms, int send_tokens, int recv_tokens) {
  require_alive(op);
  if (errors_.timed_out()) check_errors(op);
  if (!topology_.single_nvl_domain())
    throw NotSupported(std::string(op) +
                       ": groups that span several NVL domains (internode) are not available in this version");
  check_config(op, num_sms, send_tokens, recv_tokens);
  return std::min(num_sms, sm_budget_);
}

DispatchCounts Buffer::dispatch_counts(const DispatchCountsArgs& a, cudaStream_t stream) {
  const char* op = "dispatch";
  const int sms = begin_intranode_op(op, a.num_sms, a.num_max_send_tokens, a.num_max_recv_tokens);
  const int R = topology_.num_ranks;
  require(a.num_tokens >= 0, op, [&] { return "num_tokens must be >= 0, got " + str(a.num_tokens); });
  require(a.num_tokens == 0 || a.is_token_in_rank, op, "is_token_in_rank must be given");
  require(a.expert_alignment >= 1, op, [&] { return "expert_alignment must be >= 1, got " + str(a.expert_alignment); });
  require(a.num_worst_tokens >= 0, op, [&] { return "num_worst_tokens must be >= 0, got " + str(a.num_worst_tokens); });
  require(a.rank_prefix_matrix != nullptr, op, "rank_prefix_matrix must be given");
  require(a.num_topk >= 0 && a.num_topk <= kMaxTopk && (a.num_topk == 0 || a.num_tokens == 0 || a.topk_idx), op,
          [&] { return "num_topk must be in [0, " + str(kMaxTopk) + "] with topk_idx given, got " + str(a.num_topk); });
  if (a.num_tokens_per_expert || a.num_topk > 0) {
    require(a.num_experts > 0 && a.num_experts % R == 0, op, [&] {
      return "num_experts must be a positive multiple of the group size " + str(R) + ", got " + str(a.num_experts);
    });
    require(a.num_experts / R <= kernels::kMaxMailboxExperts, op, [&] {
      return "at most " + str(kernels::kMaxMailboxExperts) + " experts per rank, got " + str(a.num_experts / R);
    });
  }
  // Only the counts area is used here; the data step checks the rings.
  const int experts = a.num_tokens_per_expert ? a.num_experts : 0;
  const auto region = dispatch_region(R, sms, experts, a.num_max_recv_tokens, 16);
  require(region.rings <= kernels::kIntranodeMetaBytes, op, [&] {
    return "the counts of " + str(experts) + " experts over " + str(sms / 2) + " channels exceed " +
           str(kernels::kIntranodeMetaBytes) + " bytes";
  });
  require(static_cast<size_t>(region.rings) <= options_.num_nvl_bytes, op, [&] {
    return "num_nvl_bytes is too small for this call: it needs at least " + str(region.rings) +
           " bytes, the buffer has " + str(static_cast<int64_t>(options_.num_nvl_bytes));
  });

  const bool wait = a.num_worst_tokens == 0 && a.num_tokens_per_expert != nullptr;
  if (wait) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TURNOUT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    require(capture == cudaStreamCaptureStatusNone, op,
            "a dispatch that learns its receive counts on the host cannot be captured in a CUDA graph: pass "
            "num_worst_tokens > 0 (outputs of that many rows, padding marked -1)");
  }
  auto* device_box = wait ? static_cast<kernels::RecvCountsMailbox*>(recv_counts_device_) : nullptr;
  const int32_t sequence = ++recv_counts_sequence_;
  last_dispatch_call_ = ++calls_;
  kernels::NotifyParams p{{nvl_->device_table(), peer_nvl_table(), topology_.rank, R},
                          region,
                          true,
                          a,
                          {},
                          device_box,
                          sequence,
                          wait_context(OpKind::kDispatch)};
  kernels::launch_intranode_notify(p, stream);
  if (!wait) return {};
  return wait_recv_counts(op, sequence, a.num_experts / R);
}

// The one host wait of the normal path. Every rank learns there whether some
// rank's input was bad: then every rank raises, and none launches the data step.
DispatchCounts Buffer::wait_recv_counts(const char* op, int32_t sequence, int experts_per_rank) {
  const auto* host_box = static_cast<const kernels::RecvCountsMailbox*>(recv_counts_.get());
  const auto start = HostClock::now();
  const auto deadline =
      start + std::chrono::duration_cast<HostClock::duration>(std::chrono::duration<double>(timeout_s_ + kHostGraceS));
  const volatile int32_t* seen = &host_box->sequence;
  // A sleep costs the timer slack (~50 us) after the counts land, so the first
  // second only yields; a wait that long hides a sleep's cost.
  const bool arrived = host_wait(
      op, deadline, {std::chrono::seconds(1), std::chrono::microseconds(50)}, [&] { return *seen == sequence; },
      [&] {
        if (errors_.timed_out()) check_errors(op);
      });
  if (!arrived)
    throw TimeoutError(std::string(op) + ": rank " + str(topology_.rank) +
                       ": the receive counts did not arrive within " + std::to_string(timeout_s_ + kHostGraceS) + " s");
  std::atomic_thread_fence(std::memory_order_acquire);
  last_host_wait_s_ = std::chrono::duration<double>(HostClock::now() - start).count();
  if (host_box->failed) {
    // Recorded before the counts were posted (or an earlier error holds the record).
    check_errors(op);
    throw InvalidArgument(std::string(op) + ": a rank passed invalid input; nothing was dispatched");
  }
  DispatchCounts out;
  out.num_recv_tokens = host_box->num_recv_tokens;
  out.num_recv_tokens_per_expert.assign(host_box->num_recv_tokens_per_expert,
                                        host_box->num_recv_tokens_per_expert + experts_per_rank);
  return out;
}

void Buffer::dispatch(const DispatchArgs& a, cudaStream_t stream) {
  const char* op = "dispatch";
  const int sms = begin_intranode_op(op, a.num_sms, a.num_max_send_tokens, a.num_max_recv_tokens);
  const int R = topology_.num_ranks;
  require(a.num_tokens >= 0, op, [&] { return "num_tokens must be >= 0, got " + str(a.num_tokens); });
  require(a.row_bytes > 0 && a.row_bytes % 16 == 0, op,
          [&] { return "the row of x must be a positive multiple of 16 bytes, got " + str(a.row_bytes); });
  // Empty tensors may have null pointers: only rows that exist need one.
  require(a.num_scales >= 0 && (a.num_scales == 0 || a.num_tokens == 0 || a.x_scales), op,
          "x_scales must be given with num_scales > 0");
  require(a.num_topk >= 0 && a.num_topk <= kMaxTopk, op,
          [&] { return "num_topk must be in [0, " + str(kMaxTopk) + "], got " + str(a.num_topk); });
  if (a.num_topk > 0) {
    require(a.num_tokens == 0 || (a.topk_idx && a.topk_weights), op,
            "topk_idx and topk_weights must be given together");
    require(a.num_experts > 0 && a.num_experts % R == 0, op, [&] {
      return "num_experts must be a positive multiple of the group size " + str(R) + ", got " + str(a.num_experts);
    });
  }
  require(a.num_tokens == 0 || (a.x && a.is_token_in_rank), op, "x and is_token_in_rank must be given");
  require(a.rank_prefix_matrix != nullptr, op, "rank_prefix_matrix must be given");
  require(aligned16(a.x), op, "x must start at a 16-byte aligned address");
  const DispatchOutputs& o = a.out;
  require(a.num_recv_rows >= 0, op, "num_recv_rows must be >= 0");
  require(a.num_recv_rows == 0 || o.recv_x, op, "recv_x must be given");
  require(a.num_worst_tokens == 0 || a.num_recv_rows == 0 || o.recv_src_idx, op,
          "recv_src_idx must be given with num_worst_tokens (its padding rows are marked -1)");
  require(a.num_scales == 0 || a.num_recv_rows == 0 || o.recv_x_scales, op,
          "recv_x_scales must be given with scales");
  require(a.num_topk == 0 || a.num_recv_rows == 0 || (o.recv_topk_idx && o.recv_topk_weights), op,
          "recv_topk_idx and recv_topk_weights must be given with top-k");
  require(aligned16(o.recv_x), op, "recv_x must start at a 16-byte aligned address");
  const auto slot = kernels::make_dispatch_slot(a.row_bytes, a.num_scales, a.num_topk);
  const int experts = a.num_topk > 0 ? a.num_experts : 0;
  const auto region = dispatch_region(R, sms, experts, a.num_max_recv_tokens, slot.bytes);
  check_fits(op, region, options_.num_nvl_bytes);
  // The data step belongs to the call of the counts step before it.
  kernels::launch_intranode_dispatch(
      {{nvl_->device_table(), peer_nvl_table(), topology_.rank, R}, region, slot, a,
       a.num_topk > 0 ? a.num_experts / R : 0, wait_context(OpKind::kDispatch)},
      stream);
  check_errors(op);
}

void Buffer::combine(const CombineArgs& a, cudaStream_t stream) {
  const char* op = "combine";
  const int sms = begin_intranode_op(op, a.num_sms, a.num_max_send_tokens, a.num_max_recv_tokens);
  const int R = topology_.num_ranks;
  require(a.hidden > 0 && a.hidden % 8 == 0, op,
          [&] { return "hidden must be a positive multiple of 8, got " + str(a.hidden); });
  require(a.num_rows >= 0 && a.num_tokens >= 0, op, "num_rows and num_tokens must be >= 0");
  require(a.num_topk >= 0 && a.num_topk <= kMaxTopk, op,
          [&] { return "num_topk must be in [0, " + str(kMaxTopk) + "], got " + str(a.num_topk); });
  require(a.num_topk == 0 || ((a.num_rows == 0 || a.topk_weights) && (a.num_tokens == 0 || a.combined_topk_weights)),
          op, "topk_weights and combined_topk_weights must be given together");
  require(a.rank_prefix_matrix && a.source_num_tokens, op, "the handle's rank_prefix_matrix and counts must be given");
  require(a.num_rows == 0 || (a.x && a.recv_src_idx), op, "x and the handle's recv_src_idx must be given");
  require(a.num_tokens == 0 || (a.combined_x && a.is_token_in_rank), op,
          "combined_x and the handle's is_token_in_rank must be given");
  require(aligned16(a.x) && aligned16(a.combined_x) && aligned16(a.bias0) && aligned16(a.bias1), op,
          "x, combined_x and the biases must start at a 16-byte aligned address");
  const auto slot = kernels::make_combine_slot(a.hidden, a.num_topk);
  const auto region = kernels::make_intranode_region(R, sms / 2, 0, a.num_max_recv_tokens, slot.bytes);
  check_fits(op, region, options_.num_nvl_bytes);
  const kernels::Peers peers{nvl_->device_table(), peer_nvl_table(), topology_.rank, R};
  ++calls_;
  const kernels::WaitContext ctx = wait_context(OpKind::kCombine);
  const kernels::HandleCheck handle{a.rank_prefix_matrix, a.source_num_tokens, a.num_rows, a.num_tokens};
  kernels::launch_intranode_notify({peers, region, false, {}, handle, nullptr, 0, ctx}, stream);
  kernels::launch_intranode_combine({peers, region, slot, a, ctx}, stream);
  check_errors(op);
}

}  // namespace turnout
