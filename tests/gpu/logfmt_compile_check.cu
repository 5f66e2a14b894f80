// Not a test that runs: it makes nvcc compile LogFMT-10's warp functions on
// their own (the library calls them only once combine moves to them), so
// that -Xptxas -v reports their registers and spills. Built as an object
// library, linked into nothing.
#include "kernels/low_latency/logfmt.cuh"

namespace turnout::kernels::low_latency {

// One warp per (row, chunk): rows of bf16 in, their slots out.
__global__ void logfmt_put_check(const float* x, char* slots, int hidden, int64_t slot_bytes, int* bytes) {
  __shared__ __align__(16) char smem[32][kLogfmtChunk * 2];
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int chunks = (hidden + kLogfmtChunk - 1) / kLogfmtChunk;
  const int item = static_cast<int>(blockIdx.x) * (blockDim.x / 32) + warp;
  const int row = item / chunks, chunk = item % chunks;
  const int first = kLogfmtChunk * chunk + 16 * lane;
  const bool in_row = first < hidden;
  float v[16];
#pragma unroll
  for (int j = 0; j < 16; ++j) v[j] = in_row ? x[static_cast<int64_t>(row) * hidden + first + j] : 0.0f;
  const int n = put_logfmt_chunk(slots + row * slot_bytes, hidden, chunk, v, in_row, smem[warp]);
  if (lane == 0) bytes[item] = n;
}

__global__ void logfmt_load_check(const char* slots, int hidden, int64_t slot_bytes, float* out) {
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int chunks = (hidden + kLogfmtChunk - 1) / kLogfmtChunk;
  const int item = static_cast<int>(blockIdx.x) * (blockDim.x / 32) + warp;
  const int row = item / chunks, chunk = item % chunks;
  const int first = kLogfmtChunk * chunk + 16 * lane;
  const bool in_row = first < hidden;
  float v[16];
  load_logfmt_chunk(slots + row * slot_bytes, hidden, chunk, in_row, v);
  if (in_row)
#pragma unroll
    for (int j = 0; j < 16; ++j) out[static_cast<int64_t>(row) * hidden + first + j] = v[j];
}

}  // namespace turnout::kernels::low_latency
