// Combine: the handle is checked on the device (notify), then the rows go back
// to their source ranks and are reduced there; both in one launch where the
// rank has its GPU to itself.
#include "kernels/intranode/launch.hpp"
#include "ops/intranode/intranode.hpp"

namespace turnout::intranode {

void combine(BufferCore& core, const CombineArgs& a, cudaStream_t stream) {
  const char* op = "combine";
  const BufferShape shape = begin_op(core, op, a.num_sms, a.num_max_send_tokens, a.num_max_recv_tokens);
  const CombinePlan plan = check_combine(a, shape);
  const Topology& t = core.topology();
  const kernels::Peers peers{core.nvl().device_table(), core.peer_nvl_table(), t.rank, t.num_ranks};
  core.begin_call();
  const kernels::WaitContext ctx = core.wait_context(OpKind::kCombine, true);
  const kernels::HandleCheck handle{a.rank_prefix_matrix, a.source_num_tokens, a.num_rows, a.num_tokens};
  const kernels::NotifyParams check{peers, plan.region, false, {}, handle, nullptr, 0, ctx};
  // With few channels the send blocks skip this rank's own rows (see kOwnRowsDirectMaxChannels).
  const bool own_rows_direct = plan.region.num_channels <= kernels::kOwnRowsDirectMaxChannels;
  const kernels::CombineParams data{peers, plan.region, plan.slot, a, ctx, own_rows_direct};
  // One launch where no other rank shares the GPU (every block resident at once).
  if (core.ranks_on_gpu() == 1) {
    kernels::launch_intranode_check_and_combine(check, data, stream);
  } else {
    kernels::launch_intranode_notify(check, stream);
    kernels::launch_intranode_combine(data, stream);
  }
  core.check_errors(op);
}

}  // namespace turnout::intranode
