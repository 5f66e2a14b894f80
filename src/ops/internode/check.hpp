// The arguments of internode dispatch and combine, checked on the host before
// anything is launched: free functions of the arguments and the buffer's
// shape, so the CPU tests can drive every case. Each throws InvalidArgument
// whose message starts with the op and names the argument; each returns where
// the call's data goes in the network region and the NVL buffer.
#pragma once

#include <cstddef>

#include "kernels/internode/region.hpp"
#include "turnout/internode.hpp"

namespace turnout::internode {

// What the checks need to know of the buffer.
struct BufferShape {
  int num_ranks = 0;          // R
  int num_nvl_ranks = 0;      // D: R / D domains
  int num_sms = 0;            // the SMs the call runs on (the config's, within the budget)
  size_t num_nvl_bytes = 0;   // the user part of the NVL buffer
  size_t num_rdma_bytes = 0;  // the network region
  bool shrink = false;        // enable_shrink: handles carry the live set, rings split into parts
};

// Both memories of one call.
struct Regions {
  kernels::internode::NetRegion net;
  kernels::internode::NvlRegion nvl;
};

// The config's channels and rings: num_sms even and within the channel
// limit, send <= recv chunks at both levels, NVL rings of at least one slot
// per domain (combine splits them per source domain).
void check_config(const char* op, const Config& config, const BufferShape& shape);

// The handle's entries a call reads, and its channel count against the call's.
void check_handle(const char* op, const InternodeHandle& handle, const BufferShape& shape, bool counts_written);

Regions check_dispatch_counts(const InternodeDispatchCountsArgs& args, const BufferShape& shape);
Regions check_dispatch(const InternodeDispatchArgs& args, const BufferShape& shape);
Regions check_combine(const InternodeCombineArgs& args, const BufferShape& shape);

}  // namespace turnout::internode
