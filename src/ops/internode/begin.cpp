#include <algorithm>
#include <string>

#include "ops/internode/internode.hpp"
#include "turnout/error.hpp"

namespace turnout::internode {

BufferShape begin_op(BufferCore& core, const char* op, const Config& config) {
  core.require_alive(op);
  if (core.timed_out()) core.check_errors(op);
  const Topology& t = core.topology();
  if (t.single_nvl_domain())
    throw InvalidArgument(std::string(op) +
                          ": this buffer's group is one NVL domain; internode mode needs a group that spans several "
                          "(declare smaller domains with nvl_domain_size= or TURNOUT_NVL_DOMAIN_SIZE to emulate them)");
  if (core.options().low_latency_mode)
    throw NotSupported(std::string(op) +
                       ": normal mode across NVL domains on a buffer built with low_latency_mode=True is not "
                       "available in this version of turnout; build a second Buffer without it");
  if (core.local_internode() == nullptr)
    throw InvalidArgument(std::string(op) +
                          ": num_rdma_bytes must be > 0 for a group that spans NVL domains (size it with "
                          "Config.get_rdma_buffer_size_hint), this buffer has 0");
  BufferShape shape;
  shape.num_ranks = t.num_ranks;
  shape.num_nvl_ranks = t.num_nvl_ranks;
  shape.num_sms = std::min(config.num_sms, core.sm_budget());
  shape.num_nvl_bytes = core.options().num_nvl_bytes;
  shape.num_rdma_bytes = core.internode_bytes();
  shape.shrink = core.options().enable_shrink;
  return shape;
}

}  // namespace turnout::internode
