// Combine's stages: where the buffer has room past the rings, each rank copies
// its expert outputs (and their top-k weights) into a stage in its own buffer
// before the handle check, and every block then pulls the rows of its tokens
// from the stages of the ranks they went to, over NVLink loads instead of
// ring slots. Every rank derives the same layout from the same call; the
// check tells every rank whether all ranks' rows fit (notify_block.cuh), and
// only then do they pull.
#pragma once

#include <cuda_runtime_api.h>  // __host__ __device__ for the C++ compiler too

#include <cstdint>

#include "kernels/intranode/region.hpp"
#include "runtime/align.hpp"

namespace turnout::kernels {

struct CombineStage {
  int64_t at = -1;   // this call's stage, the same offset in every rank's buffer; -1: the rings
  int64_t rows = 0;  // offset of the rows in the stage (its top-k weights at 0)
  int fit_rows = 0;  // rows the stage holds
  int parity = 0;
};

// Two stages past the region, taken by alternate combines (`parity`): a rank
// copies into stage k % 2 only after the check of combine k - 1, which every
// rank reaches only once it has pulled all it needed in combine k - 2.
__host__ __device__ inline CombineStage combine_stage(int64_t region_total, int64_t num_nvl_bytes, int row_bytes,
                                                      int num_topk, int64_t parity) {
  CombineStage s;
  const int64_t base = align_up(region_total > kStageFloor ? region_total : kStageFloor, 4096);
  const int64_t span = num_nvl_bytes > base ? (num_nvl_bytes - base) / 2 / 4096 * 4096 : 0;
  const int64_t per_row = row_bytes + static_cast<int64_t>(num_topk) * 4;
  const int64_t fit = span > 128 && per_row > 0 ? (span - 128) / per_row : 0;
  if (fit <= 0) return s;
  s.fit_rows = fit < INT32_MAX ? static_cast<int>(fit) : INT32_MAX;
  s.rows = align_up(static_cast<int64_t>(s.fit_rows) * num_topk * 4, 128);
  s.parity = static_cast<int>(parity % 2);
  s.at = base + s.parity * span;
  return s;
}

// The most bytes of a rank's own rows that its stage copy takes along where
// they lie between other ranks' rows: one copy then replaces two, about 5 us
// less of host time (benchmarks/call_costs), for at most this many more bytes
// to copy, about 2 us of the GPU. Small calls, where the host sets the pace,
// fall under it; large ones keep the two copies.
inline constexpr int64_t kOwnRowsCopiedBytes = 2 << 20;

// The range of x's rows the stage copy leaves out, [begin, begin + count):
// the rank's own rows (the reducers read them from x) unless they are few
// and in the middle (above); count 0 leaves nothing out. `own_count` 0 when
// the range is not known.
struct StageGap {
  int64_t begin = 0, count = 0;
};
inline StageGap stage_gap(int64_t own_begin, int64_t own_count, int64_t num_rows, int64_t row_bytes) {
  if (own_count <= 0) return {};
  const bool between = own_begin > 0 && own_begin + own_count < num_rows;
  if (between && own_count * row_bytes <= kOwnRowsCopiedBytes) return {};
  return {own_begin, own_count};
}

}  // namespace turnout::kernels
