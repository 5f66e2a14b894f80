// How many SMs one op of a Buffer may use when ranks of its group share GPUs.
// Ranks on one GPU run their kernels side by side (MPS) or in turns (time
// slices); either way every block of every rank on that GPU must be able to be
// resident at once, because blocks spin waiting for their peers' blocks.
#pragma once

#include <array>
#include <cstdint>
#include <span>

namespace turnout {

struct RankGpu {
  std::array<uint8_t, 16> uuid{};  // the GPU's UUID: ordinals mean nothing across processes
  int32_t sms = 0;                 // multiprocessors this rank's context sees
  // 1 when `sms` is already this rank's share (an MPS active-thread cap:
  // the driver then reports the capped count), 0 when it is the whole GPU.
  int32_t sms_are_share = 0;
};

// The even SM count every rank of `ranks` may use at once: each GPU's SMs
// divided among the ranks that share it, the smallest share over all ranks
// (channels must match between ranks), at least 2.
int sm_budget(std::span<const RankGpu> ranks);

// Ranks in `ranks` on the GPU of ranks[i], i included.
int ranks_on_gpu(std::span<const RankGpu> ranks, int i);

// This process's view of the current device: its UUID, its SM count, and
// whether CUDA_MPS_ACTIVE_THREAD_PERCENTAGE caps it.
RankGpu local_rank_gpu(int device);

}  // namespace turnout
