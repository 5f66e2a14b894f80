// Plain copies to and from every NVL peer's buffer, with SM stores or bulk
// copies: the NVLink ceiling the bench compares every op with.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "ops/buffer_core.hpp"

namespace turnout::peer_copy {

// The SM copies' shape: 1-32 warps a block; 1, 2, 4 or 8 words a lane in
// flight, or 16 where `sixteen_words` (the loads) with at most 16 warps (the
// registers of 512 threads). Throws InvalidArgument naming the argument.
void check_sm_copy(const char* op, int warps_per_block, int words_in_flight, bool sixteen_words);

void store_to_peers(BufferCore& core, const void* src, size_t bytes, size_t dst_offset, bool include_self, int num_sms,
                    int warps_per_block, int words_in_flight, bool bulk, cudaStream_t stream);
void load_from_peers(BufferCore& core, void* dst, size_t bytes, size_t src_offset, bool include_self, int num_sms,
                     int warps_per_block, int words_in_flight, cudaStream_t stream);

}  // namespace turnout::peer_copy
