// Dispatch's landing area: where the buffer has room past the counts words
// for every rank's receive rows, the senders store each row and its small
// parts straight at their final positions in the receiver's landing area,
// with no rings, so every block sends; the receiver copies its rows out
// (device-to-device copies) and its small parts (its blocks) once every sender is done.
// The rows any rank receives are known on every rank after the counts step,
// so every rank derives the same layout.
#pragma once

#include <cuda_runtime_api.h>  // __host__ __device__ for the C++ compiler too

#include <cstdint>

#include "kernels/intranode/region.hpp"
#include "runtime/align.hpp"

namespace turnout::kernels {

// Up to this many channels (20 SMs) dispatch lands its rows; past them the
// rings' receive blocks keep up, and the landing's copy-out costs more than
// they do. At EP2 on 2x H200, BF16 / FP8 GB/s, rings -> landing: 12 SMs
// 244 -> 361 / 174 -> 241, 16 SMs 313 -> 381 / 207 -> 278, 20 SMs 373 -> 364 /
// 239 -> 293, 24 SMs 433 -> 374 / 289 -> 290.
inline constexpr int kLandingMaxChannels = 10;

// Offsets in every rank's buffer, each part [rows][...] as the outputs lay it.
struct DispatchLanding {
  int64_t x = -1;  // -1: the rings
  int64_t scales = 0, topk_idx = 0, weights = 0, src_idx = 0;
};

__host__ __device__ inline DispatchLanding dispatch_landing(int64_t num_nvl_bytes, int64_t rows, int row_bytes,
                                                            int num_scales, int num_topk) {
  DispatchLanding l;
  int64_t at = kStageFloor;
  auto take = [&](int64_t bytes) {
    const int64_t start = at;
    at = align_up(at + bytes, 128);
    return start;
  };
  const int64_t x = take(rows * row_bytes);
  l.scales = take(rows * num_scales * 4);
  l.topk_idx = take(rows * num_topk * 8);
  l.weights = take(rows * num_topk * 4);
  l.src_idx = take(rows * 4);
  if (rows >= 0 && at <= num_nvl_bytes) l.x = x;
  return l;
}

}  // namespace turnout::kernels
