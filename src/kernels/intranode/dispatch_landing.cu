// Intranode dispatch through the landing areas (landing.hpp): every block
// sends. A channel's two blocks share its tokens, a warp a token: it loads the
// row once and stores it, with its small parts, at the token's final row in
// every destination's landing area: the source's prefix, the channel's start
// in the source's stream to that rank (both from the counts step), and the
// token's place in the channel. Then each block tells every destination it is
// done, waits until every source's blocks are, and copies its share of the
// small parts out; the rows from other ranks leave by device-to-device copies after
// the kernel (a rank's rows from itself go straight to recv_x).
#include <cuda_runtime.h>

#include <type_traits>

#include "kernels/device/bounded_wait.cuh"
#include "kernels/device/vector_copy.cuh"
#include "kernels/intranode/input_scale.cuh"
#include "kernels/intranode/launch.hpp"
#include "kernels/intranode/rank_masks.cuh"
#include "turnout/error.hpp"

namespace turnout::kernels {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kWords = 8;  // words of a row a lane has in flight

__device__ __forceinline__ char* bytes(void* p) {
  return static_cast<char*>(p);
}

template <int kRows>
__device__ void land_tokens(const DispatchParams& p) {
  const DispatchArgs& a = p.args;
  const int R = p.peers.num_ranks, me = p.peers.rank;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const IntranodeRegion& region = p.region;
  const DispatchLanding& land = p.landing;
  const int C = region.num_channels, channel = blockIdx.x / 2;
  const int t0 = channel_begin(a.num_tokens, channel, C), t1 = channel_begin(a.num_tokens, channel + 1, C);
  const int32_t* matrix = reinterpret_cast<const int32_t*>(bytes(p.peers.buffers[me]) + region.matrix);
  // The channel's first row on each rank.
  int next[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    next[j] = 0;
    if (j < R) {
      for (int s = 0; s < me; ++s) next[j] += matrix[s * R + j];
      next[j] +=
          reinterpret_cast<const int32_t*>(bytes(p.peers.buffers[j]) + region.channel_start)[me * (C + 1) + channel];
    }
  }
  const int n16 = a.row_bytes / 16, L = p.experts_per_rank;
  constexpr int kChannelWarps = 2 * kWarps;
  const int mine = (blockIdx.x % 2) * kWarps + warp;
  for (int base = t0; base < t1; base += 32) {
    uint32_t masks[kRows];
    rank_masks(a.is_token_in_rank, R, base, t1, lane, masks);
    // Warp w of the channel takes its tokens w, w + 2 * kWarps, ...
    const int first = ((mine - (base - t0)) % kChannelWarps + kChannelWarps) % kChannelWarps;
    for (int i = first; i < 32 && base + i < t1; i += kChannelWarps) {
      const int t = base + i;
      const uint32_t below = (1u << i) - 1;
      int64_t row[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) row[j] = (masks[j] >> i & 1) ? next[j] + __popc(masks[j] & below) : -1;
      // The small loads first, so they overlap the row.
      int64_t expert = -1;
      float weight = 0.0f;
      if (lane < a.num_topk) {
        expert = a.topk_idx[static_cast<int64_t>(t) * a.num_topk + lane];
        weight = a.topk_weights[static_cast<int64_t>(t) * a.num_topk + lane];
      }
      // Scale groups lane and lane + 32 once a token, not once a destination:
      // column-major scales make each a load of its own.
      int32_t scale[2] = {};
#pragma unroll
      for (int m = 0; m < 2; ++m)
        if (lane + 32 * m < a.num_scales) scale[m] = input_scale(a, t, lane + 32 * m);
      const char* src = static_cast<const char*>(a.x) + static_cast<int64_t>(t) * a.row_bytes;
      for (int v0 = lane; v0 < n16; v0 += 32 * kWords) {
        int4 w[kWords];
#pragma unroll
        for (int u = 0; u < kWords; ++u)
          if (v0 + 32 * u < n16) w[u] = device::load_input_16(src + (v0 + 32 * u) * 16);
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          if (row[j] < 0) continue;
          // This rank's own rows go straight to their output rows (those the
          // outputs hold: the copy-out is bounded by them too).
          const bool direct = j == me && a.out.recv_x != nullptr && row[j] < a.num_recv_rows;
          char* dst = direct ? static_cast<char*>(a.out.recv_x) + row[j] * a.row_bytes
                             : bytes(p.peers.buffers[j]) + land.x + row[j] * a.row_bytes;
#pragma unroll
          for (int u = 0; u < kWords; ++u)
            if (v0 + 32 * u < n16) device::store_16(dst + (v0 + 32 * u) * 16, w[u]);
        }
      }
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        if (row[j] < 0) continue;
        char* peer = bytes(p.peers.buffers[j]);
        if (lane < a.num_topk) {
          const bool here = expert >= static_cast<int64_t>(j) * L && expert < static_cast<int64_t>(j + 1) * L;
          reinterpret_cast<int64_t*>(peer + land.topk_idx)[row[j] * a.num_topk + lane] = here ? expert - j * L : -1;
          reinterpret_cast<float*>(peer + land.weights)[row[j] * a.num_topk + lane] = here ? weight : 0.0f;
        }
        auto* scales = reinterpret_cast<int32_t*>(peer + land.scales) + row[j] * a.num_scales;
#pragma unroll
        for (int m = 0; m < 2; ++m)
          if (lane + 32 * m < a.num_scales) scales[lane + 32 * m] = scale[m];
        for (int g = lane + 64; g < a.num_scales; g += 32) scales[g] = input_scale(a, t, g);
        if (lane == 0) reinterpret_cast<int32_t*>(peer + land.src_idx)[row[j]] = t;
      }
    }
#pragma unroll
    for (int j = 0; j < kRows; ++j) next[j] += __popc(masks[j]);
  }
}

// Copies elements [0, n) of `from` to `to`, spread over the grid.
template <typename T>
__device__ __forceinline__ void grid_copy(T* to, const T* from, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    to[i] = __ldcg(from + i);
}

template <int kRows>
__global__ void __launch_bounds__(kThreads, 1) landing_dispatch_kernel(DispatchParams p) {
  if (device::wait_abandoned(p.ctx.errors)) return;
  const DispatchArgs& a = p.args;
  const DispatchOutputs& o = a.out;
  const int R = p.peers.num_ranks, me = p.peers.rank;
  char* self = bytes(p.peers.buffers[me]);
  const IntranodeRegion& region = p.region;
  if (device::load_volatile(reinterpret_cast<const int32_t*>(self + region.status)) != 0) {
    if (blockIdx.x == 0 && o.source_num_tokens != nullptr && threadIdx.x < R) o.source_num_tokens[threadIdx.x] = -1;
    return;
  }
  if (blockIdx.x == 0 && o.source_num_tokens != nullptr && threadIdx.x < R)
    o.source_num_tokens[threadIdx.x] = reinterpret_cast<const int32_t*>(self + region.source_info)[threadIdx.x * 4];
  land_tokens<kRows>(p);
  // Every store of the block before the release that tells each destination.
  __syncthreads();
  if (threadIdx.x < R)
    device::red_add_release_sys(reinterpret_cast<uint32_t*>(bytes(p.peers.buffers[threadIdx.x]) + region.landed) + me,
                                1);
  if (threadIdx.x < R) {
    const auto* landed = reinterpret_cast<const int32_t*>(self + region.landed) + threadIdx.x;
    device::bounded_wait(p.ctx, p.ctx.first_nvl_rank + threadIdx.x, WaitSite::kDispatchData,
                         [&] { return device::load_acquire_sys(landed) >= 2 * region.num_channels; });
  }
  __syncthreads();
  if (device::wait_abandoned(p.ctx.errors)) return;
  const int64_t rows = a.num_recv_rows;
  const DispatchLanding& land = p.landing;
  if (o.recv_x_scales != nullptr)
    grid_copy(static_cast<int32_t*>(o.recv_x_scales), reinterpret_cast<const int32_t*>(self + land.scales),
              rows * a.num_scales);
  if (o.recv_topk_idx != nullptr) {
    grid_copy(o.recv_topk_idx, reinterpret_cast<const int64_t*>(self + land.topk_idx), rows * a.num_topk);
    grid_copy(o.recv_topk_weights, reinterpret_cast<const float*>(self + land.weights), rows * a.num_topk);
  }
  if (o.recv_src_idx != nullptr) grid_copy(o.recv_src_idx, reinterpret_cast<const int32_t*>(self + land.src_idx), rows);
}

}  // namespace

KernelLaunch intranode_landing_dispatch_launch(const DispatchParams& p) {
  const void* kernel = p.peers.num_ranks <= 2   ? reinterpret_cast<const void*>(landing_dispatch_kernel<2>)
                       : p.peers.num_ranks <= 4 ? reinterpret_cast<const void*>(landing_dispatch_kernel<4>)
                                                : reinterpret_cast<const void*>(landing_dispatch_kernel<8>);
  return {kernel, dim3(p.region.num_channels * 2), dim3(kThreads), 0};
}

void launch_intranode_landing_dispatch(const DispatchParams& p, cudaStream_t stream) {
  void* args[] = {const_cast<DispatchParams*>(&p)};
  launch(intranode_landing_dispatch_launch(p), args, stream);
}

}  // namespace turnout::kernels
