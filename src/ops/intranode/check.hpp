// The arguments of intranode dispatch and combine, checked on the host before
// anything is launched: free functions of the arguments and the buffer's
// shape, so the CPU tests can drive every case. Each throws InvalidArgument
// whose message starts with the op and names the argument; each returns where
// the call's data goes in the NVL buffer.
#pragma once

#include <cstddef>

#include "kernels/intranode/region.hpp"
#include "turnout/intranode.hpp"

namespace turnout::intranode {

// What the checks need to know of the buffer.
struct BufferShape {
  int num_ranks = 0;         // the group (one NVL domain)
  int num_sms = 0;           // the SMs the call runs on (the config's, within the budget)
  size_t num_nvl_bytes = 0;  // the user part of the NVL buffer
};

// The channel layout of a config (dispatch and combine alike).
void check_config(const char* op, int num_sms, int send_tokens, int recv_tokens);

// The counts area of a dispatch's counts step.
kernels::IntranodeRegion check_dispatch_counts(const DispatchCountsArgs& args, const BufferShape& shape);

struct DispatchPlan {
  kernels::DispatchSlot slot;
  kernels::IntranodeRegion region;
};
DispatchPlan check_dispatch(const DispatchArgs& args, const BufferShape& shape);

struct CombinePlan {
  kernels::CombineSlot slot;
  kernels::IntranodeRegion region;
};
CombinePlan check_combine(const CombineArgs& args, const BufferShape& shape);

}  // namespace turnout::intranode
