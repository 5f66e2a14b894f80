// Combine: expert outputs go back through the forwarders, reduced per domain.
#include "ops/internode/internode.hpp"
#include "turnout/error.hpp"

namespace turnout::internode {

void combine(BufferCore& core, const InternodeCombineArgs& a, cudaStream_t) {
  const char* op = "combine";
  const BufferShape shape = begin_op(core, op, a.config);
  check_combine(a, shape);
  throw NotSupported("combine: the internode kernels are not in this version of turnout yet (issue 31)");
}

}  // namespace turnout::internode
