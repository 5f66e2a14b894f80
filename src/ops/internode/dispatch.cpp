// A dispatch's data step: the tokens move into outputs sized from the counts.
#include "ops/internode/internode.hpp"
#include "turnout/error.hpp"

namespace turnout::internode {

void dispatch(BufferCore& core, const InternodeDispatchArgs& a, cudaStream_t) {
  const char* op = "dispatch";
  const BufferShape shape = begin_op(core, op, a.config);
  check_dispatch(a, shape);
  throw NotSupported("dispatch: the internode kernels are not in this version of turnout yet (issue 31)");
}

}  // namespace turnout::internode
