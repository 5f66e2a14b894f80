// A dispatch's data step: the tokens move into outputs sized from the counts
// (or the handle), through the forwarders.
#include "kernels/internode/launch.hpp"
#include "ops/internode/internode.hpp"

namespace turnout::internode {

void dispatch(BufferCore& core, const InternodeDispatchArgs& a, cudaStream_t stream) {
  const char* op = "dispatch";
  const BufferShape shape = begin_op(core, op, a.config);
  const Regions regions = check_dispatch(a, shape);
  const Topology& t = core.topology();
  kernels::internode::DispatchParams p{};
  p.peers = {core.nvl().device_table(), core.peer_nvl_table(), t.rank, t.num_ranks, t.num_nvl_ranks};
  p.net = regions.net;
  p.nvl = regions.nvl;
  p.slot = kernels::internode::make_token_slot(a.row_bytes, a.num_scales, a.num_topk);
  p.net_local = static_cast<char*>(core.local_internode());
  p.args = a;
  p.experts_per_rank = a.num_topk > 0 ? a.num_experts / t.num_ranks : 0;
  // The data step belongs to the call of the counts step before it.
  p.ctx = core.wait_context(OpKind::kDispatch);
  const NvshmemApi& api = *core.internode_nvshmem();
  nvshmem_check(api, api.internode_dispatch(&p, stream), op);
  core.check_errors(op);
}

}  // namespace turnout::internode
