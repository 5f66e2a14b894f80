#include <algorithm>
#include <string>

#include "ops/intranode/intranode.hpp"
#include "turnout/error.hpp"

namespace turnout::intranode {

BufferShape begin_op(BufferCore& core, const char* op, int num_sms, int send_tokens, int recv_tokens) {
  core.require_alive(op);
  if (core.timed_out()) core.check_errors(op);
  if (!core.topology().single_nvl_domain())
    throw NotSupported(std::string(op) +
                       ": groups that span several NVL domains (internode) are not available in this version");
  check_config(op, num_sms, send_tokens, recv_tokens);
  return {core.topology().num_ranks, std::min(num_sms, core.sm_budget()), core.options().num_nvl_bytes};
}

}  // namespace turnout::intranode
