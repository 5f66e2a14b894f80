// Combine: expert outputs go back through the forwarders, reduced in each
// domain first. A step before it meets the peers and resets the rings.
#include "kernels/internode/launch.hpp"
#include "ops/internode/internode.hpp"

namespace turnout::internode {

void combine(BufferCore& core, const InternodeCombineArgs& a, cudaStream_t stream) {
  const char* op = "combine";
  const BufferShape shape = begin_op(core, op, a.config);
  const Regions regions = check_combine(a, shape);
  core.begin_call();
  // The counts step meets the dispatch's peers (shrink mode: the handle's live
  // set, less a rank that does not come within the shrink timeout).
  InternodeDispatchCountsArgs meet;
  meet.handle = a.handle;
  launch_notify(core, notify_params(core, regions, false, meet, OpKind::kCombine), op, stream);
  const Topology& t = core.topology();
  kernels::internode::CombineParams p{};
  p.peers = {core.nvl().device_table(), core.peer_nvl_table(), t.rank, t.num_ranks, t.num_nvl_ranks};
  p.net = regions.net;
  p.nvl = regions.nvl;
  p.slot = kernels::make_combine_slot(a.hidden, a.num_topk);
  p.net_local = static_cast<char*>(core.local_internode());
  p.args = a;
  // Shrink mode: every wait judged under the shrink timeout, as the counts step's.
  p.ctx = core.wait_context(OpKind::kCombine, a.handle.live != nullptr);
  const NvshmemApi& api = *core.internode_nvshmem();
  nvshmem_check(api, api.internode_combine(&p, stream), op);
  core.check_errors(op);
}

}  // namespace turnout::internode
