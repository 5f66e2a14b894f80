// A dispatch's data step: the tokens move into outputs sized from the counts.
#include "kernels/intranode/launch.hpp"
#include "ops/intranode/intranode.hpp"

namespace turnout::intranode {

void dispatch(BufferCore& core, const DispatchArgs& a, cudaStream_t stream) {
  const char* op = "dispatch";
  const BufferShape shape = begin_op(core, op, a.num_sms, a.num_max_send_tokens, a.num_max_recv_tokens);
  const DispatchPlan plan = check_dispatch(a, shape);
  const Topology& t = core.topology();
  // The data step belongs to the call of the counts step before it.
  kernels::launch_intranode_dispatch({{core.nvl().device_table(), core.peer_nvl_table(), t.rank, t.num_ranks},
                                      plan.region,
                                      plan.slot,
                                      a,
                                      a.num_topk > 0 ? a.num_experts / t.num_ranks : 0,
                                      core.wait_context(OpKind::kDispatch, true)},
                                     stream);
  core.check_errors(op);
}

}  // namespace turnout::intranode
