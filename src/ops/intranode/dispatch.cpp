// A dispatch's data step: the tokens move into outputs sized from the counts;
// and both steps at once where the host knows those sizes before the counts.
#include <array>
#include <string>

#include "kernels/intranode/launch.hpp"
#include "ops/intranode/intranode.hpp"
#include "ops/require.hpp"

namespace turnout::intranode {
namespace {

kernels::DispatchParams data_params(BufferCore& core, const DispatchArgs& a, const DispatchPlan& plan) {
  const Topology& t = core.topology();
  return {{core.nvl().device_table(), core.peer_nvl_table(), t.rank, t.num_ranks},
          plan.region,
          plan.slot,
          a,
          a.num_topk > 0 ? a.num_experts / t.num_ranks : 0,
          core.wait_context(OpKind::kDispatch, true),
          {}};
}

// The landing areas where the counts step before told every rank the most
// rows any rank receives and they fit, with few channels
// (kLandingMaxChannels); not in shrink mode, where a source may die before
// telling a receiver it is done. TURNOUT_DISPATCH_LANDING=0 keeps every
// dispatch on the rings.
kernels::DispatchLanding landing_for(const BufferCore& core, const BufferCore::CountedRows& rows, const DispatchArgs& a,
                                     const DispatchPlan& plan) {
  static const bool allowed = switched_on("TURNOUT_DISPATCH_LANDING");
  if (rows.most < 0 || !allowed || core.shrink_enabled() || a.num_worst_tokens > 0 ||
      plan.region.num_channels > kernels::kLandingMaxChannels)
    return {};
  return kernels::dispatch_landing(static_cast<int64_t>(core.options().num_nvl_bytes), rows.most, a.row_bytes,
                                   a.num_scales, a.num_topk);
}

}  // namespace

void dispatch(BufferCore& core, OpGraph& graph, const DispatchArgs& a, cudaStream_t stream) {
  const char* op = "dispatch";
  const BufferShape shape = begin_op(core, op, a.num_sms, a.num_max_send_tokens, a.num_max_recv_tokens);
  const DispatchPlan plan = check_dispatch(a, shape);
  // The data step belongs to the call of the counts step before it.
  kernels::DispatchParams data = data_params(core, a, plan);
  const BufferCore::CountedRows rows = core.take_counted_rows();
  data.landing = landing_for(core, rows, a, plan);
  if (data.landing.x < 0) {
    kernels::launch_intranode_dispatch(data, stream);
  } else {
    // The rank's rows from itself went straight into recv_x.
    RowCopies copies;
    if (a.out.recv_x != nullptr)
      copies = rows_around(a.out.recv_x, static_cast<char*>(core.local_nvl_buffer()) + data.landing.x, a.num_recv_rows,
                           rows.own_begin, rows.own, a.row_bytes);
    // Eager calls enqueue the launch and its copies as one graph (ops/op_graph.hpp); TURNOUT_OP_GRAPHS=0: one by one.
    static const bool graphs = switched_on("TURNOUT_OP_GRAPHS");
    if (graphs && !capturing(stream)) {
      void* data_args[] = {&data};
      std::array<GraphStep, 3> steps;
      steps[0] = GraphStep::launch(kernels::intranode_landing_dispatch_launch(data), data_args);
      for (int i = 0; i < copies.count; ++i) steps[1 + i] = copies.steps[i];
      graph.enqueue({steps.data(), static_cast<size_t>(1 + copies.count)}, stream);
    } else {
      kernels::launch_intranode_landing_dispatch(data, stream);
      copy_one_by_one(copies, stream);
    }
  }
  core.check_errors(op);
}

void dispatch_known_rows(BufferCore& core, CountsMailbox& mailbox, OpGraph& graph, const DispatchCountsArgs& counts,
                         const DispatchArgs& a, cudaStream_t stream) {
  const char* op = "dispatch";
  const BufferShape shape = begin_op(core, op, a.num_sms, a.num_max_send_tokens, a.num_max_recv_tokens);
  // With rows to wait for the counts step would need the host between the steps.
  ops::require(counts.num_worst_tokens > 0 || counts.num_tokens_per_expert == nullptr, op,
               "both steps in one call need the receive rows known before the counts: num_worst_tokens > 0, or "
               "a cached dispatch (no num_tokens_per_expert)");
  // The counts step bounds the receive count by num_worst_tokens: a bound past the outputs' rows would let it through.
  ops::require(counts.num_worst_tokens <= a.num_recv_rows, op, [&] {
    return "the counts' num_worst_tokens (" + std::to_string(counts.num_worst_tokens) +
           ") must not exceed the outputs' num_recv_rows (" + std::to_string(a.num_recv_rows) + ")";
  });
  const kernels::IntranodeRegion region = check_dispatch_counts(counts, shape);
  const DispatchPlan plan = check_dispatch(a, shape);
  const int32_t sequence = mailbox.next_sequence();
  core.begin_dispatch_call();
  kernels::NotifyParams notify = counts_params(core, counts, region, nullptr, sequence);
  core.take_counted_rows();
  kernels::DispatchParams data = data_params(core, a, plan);
  const bool one_launch = core.one_launch();
  // Eager calls launch through the buffer's graph (ops/op_graph.hpp); TURNOUT_OP_GRAPHS=0: one by one.
  static const bool graphs = switched_on("TURNOUT_OP_GRAPHS");
  if (graphs && !capturing(stream)) {
    void* notify_args[] = {&notify};
    void* data_args[] = {&data};
    void* both_args[] = {&notify, &data};
    std::array<GraphStep, 2> steps;
    size_t n = 0;
    if (one_launch) {
      steps[n++] = GraphStep::launch(kernels::intranode_counts_and_dispatch_launch(data), both_args);
    } else {
      steps[n++] = GraphStep::launch(kernels::intranode_notify_launch(), notify_args);
      steps[n++] = GraphStep::launch(kernels::intranode_dispatch_launch(data), data_args);
    }
    graph.enqueue({steps.data(), n}, stream);
  } else if (one_launch) {
    kernels::launch_intranode_counts_and_dispatch(notify, data, stream);
  } else {
    kernels::launch_intranode_notify(notify, stream);
    kernels::launch_intranode_dispatch(data, stream);
  }
  core.check_errors(op);
}

}  // namespace turnout::intranode
