// Combine: the handle is checked on the device (notify), then the rows go back
// to their source ranks and are reduced there; both in one launch where the
// rank has its GPU to itself. Where the buffer has room past the rings, the
// inputs are first copied into a stage there and the reducers pull the rows
// (kernels/intranode/combine_stage.hpp).
#include <array>

#include "kernels/intranode/launch.hpp"
#include "ops/intranode/intranode.hpp"
#include "turnout/error.hpp"

namespace turnout::intranode {
namespace {

// The rows of x the stage copy leaves out: the caller's range of the rows from
// this rank itself, where it lies within x, unless the copy takes them along.
kernels::StageGap stage_gap(const CombineArgs& a) {
  if (a.own_rows_begin < 0 || a.num_own_rows <= 0 || a.own_rows_begin > a.num_rows - a.num_own_rows) return {};
  return kernels::stage_gap(a.own_rows_begin, a.num_own_rows, a.num_rows, static_cast<int64_t>(a.hidden) * 2);
}

// Where this rank's rows go before the kernels pull them: the call's stage
// where they fit, with the copies that fill it (on every SM, several times
// the rate of the call's own); their weights follow in the check step
// (notify_block.cuh). stage.at < 0 for the rings. The parity advances on what
// every rank shares; the check step pulls only where every rank staged in
// the same stage. Not in shrink mode (a rank that dies mid-call must not
// leave the others reading its stage), nor in a CUDA graph: a graph's
// replays would all copy into the stage it captured, over the rows a slower
// rank may still be pulling. TURNOUT_COMBINE_STAGES=0 keeps every combine on
// the rings.
struct StagePlan {
  kernels::CombineStage stage;
  RowCopies copies;
};

StagePlan plan_stage(BufferCore& core, const CombineArgs& a, const kernels::IntranodeRegion& region,
                     kernels::StageGap gap, cudaStream_t stream) {
  static const bool allowed = switched_on("TURNOUT_COMBINE_STAGES");
  if (!allowed || core.shrink_enabled()) return {};
  const int row_bytes = a.hidden * 2;
  const int64_t cap = static_cast<int64_t>(core.options().num_nvl_bytes);
  if (kernels::combine_stage(region.total, cap, row_bytes, a.num_topk, 0).at < 0) return {};
  if (capturing(stream)) return {};
  const kernels::CombineStage stage =
      kernels::combine_stage(region.total, cap, row_bytes, a.num_topk, core.next_combine_stage());
  if (a.num_rows > stage.fit_rows) return {};
  char* dst = static_cast<char*>(core.local_nvl_buffer()) + stage.at;
  return {stage, rows_around(dst + stage.rows, a.x, a.num_rows, gap.begin, gap.count, row_bytes)};
}

}  // namespace

void combine(BufferCore& core, OpGraph& graph, const CombineArgs& a, cudaStream_t stream) {
  const char* op = "combine";
  const BufferShape shape = begin_op(core, op, a.num_sms, a.num_max_send_tokens, a.num_max_recv_tokens);
  const CombinePlan plan = check_combine(a, shape);
  const Topology& t = core.topology();
  const kernels::Peers peers{core.nvl().device_table(), core.peer_nvl_table(), t.rank, t.num_ranks};
  core.begin_call();
  const kernels::WaitContext ctx = core.wait_context(OpKind::kCombine, true);
  const kernels::StageGap gap = stage_gap(a);
  // The copies come before the check, whose barrier then orders every rank's copy before anyone pulls.
  const StagePlan staged = plan_stage(core, a, plan.region, gap, stream);
  const kernels::CombineStage& stage = staged.stage;
  const int stage_tag = stage.at < 0 ? 0 : 1 + stage.parity;
  // The check step sends every rank to the rings unless the range left out is the handle's own.
  const kernels::StageGap skipped = stage.at < 0 ? kernels::StageGap{-1, 0} : gap;
  const bool stage_weights = stage.at >= 0 && a.num_rows > 0 && a.num_topk > 0;
  const kernels::HandleCheck handle{a.rank_prefix_matrix,
                                    a.source_num_tokens,
                                    a.num_rows,
                                    a.num_tokens,
                                    stage_tag,
                                    skipped.count > 0 ? static_cast<int>(skipped.begin) : -1,
                                    static_cast<int>(skipped.count),
                                    a.topk_weights,
                                    stage_weights ? stage.at : -1,
                                    stage_weights ? static_cast<int64_t>(a.num_rows) * a.num_topk : 0};
  kernels::NotifyParams check{peers, plan.region, false, {}, handle, nullptr, 0, ctx};
  // With few channels the send blocks skip this rank's own rows (see kOwnRowsDirectMaxChannels).
  const bool own_rows_direct = plan.region.num_channels <= kernels::kOwnRowsDirectMaxChannels;
  kernels::CombineParams data{peers, plan.region, plan.slot, a, ctx, own_rows_direct, stage};
  // One launch where every block is resident at once (BufferCore::one_launch).
  const bool one_launch = core.one_launch();
  // Eager calls enqueue their copies and launches as one graph; a staged
  // combine is never under capture (plan_stage). TURNOUT_OP_GRAPHS=0: one by one.
  static const bool graphs = switched_on("TURNOUT_OP_GRAPHS");
  if (graphs && (stage.at >= 0 || !capturing(stream))) {
    void* check_args[] = {&check};
    void* data_args[] = {&data};
    void* both_args[] = {&check, &data};
    std::array<GraphStep, 4> steps;
    int n = 0;
    for (int i = 0; i < staged.copies.count; ++i) steps[n++] = staged.copies.steps[i];
    if (one_launch) {
      steps[n++] = GraphStep::launch(kernels::intranode_check_and_combine_launch(data), both_args);
    } else {
      steps[n++] = GraphStep::launch(kernels::intranode_notify_launch(), check_args);
      steps[n++] = GraphStep::launch(kernels::intranode_combine_launch(data), data_args);
    }
    graph.enqueue({steps.data(), static_cast<size_t>(n)}, stream);
  } else {
    copy_one_by_one(staged.copies, stream);
    if (one_launch) {
      kernels::launch_intranode_check_and_combine(check, data, stream);
    } else {
      kernels::launch_intranode_notify(check, stream);
      kernels::launch_intranode_combine(data, stream);
    }
  }
  core.check_errors(op);
}

}  // namespace turnout::intranode
