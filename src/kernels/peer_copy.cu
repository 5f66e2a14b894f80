// Copies to and from peers' buffers over NVLink, plain 16-byte SM stores and
// loads or bulk copies: the peer memory test and the bench's NVLink ceiling.
#include <cuda_runtime.h>

#include <type_traits>

#include "kernels/device/bulk_copy.cuh"
#include "kernels/launch.hpp"
#include "turnout/error.hpp"

namespace turnout::kernels {
namespace {

constexpr int kMaxThreads = 1024;

// Any block size up to kMaxThreads: the bench compares as many warps on
// fewer SMs with the same warps spread over more. Each lane has kWords loads
// in flight before their stores: with one, a warp's rate is bound by the load's
// round trip; the data kernels copy rows with seven or eight.
template <int kWords>
__global__ void __launch_bounds__(kMaxThreads)
    store_to_peers_kernel(void* const* peers, int nvl_rank, int num_nvl_ranks, const int4* src, size_t n16,
                          size_t dst_offset, bool include_self) {
  const size_t threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t dst_index = (dst_offset + nvl_rank * n16 * sizeof(int4)) / sizeof(int4);
  auto store = [&](size_t i, const int4& v) {
    // Start at the next peer so ranks do not all hit peer 0 first.
    for (int s = 1; s <= num_nvl_ranks; ++s) {
      const int p = (nvl_rank + s) % num_nvl_ranks;
      if (p == nvl_rank && !include_self) continue;
      static_cast<int4*>(peers[p])[dst_index + i] = v;
    }
  };
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  for (; i + (kWords - 1) * threads < n16; i += kWords * threads) {
    int4 v[kWords];
#pragma unroll
    for (int u = 0; u < kWords; ++u) v[u] = __ldg(src + i + u * threads);
#pragma unroll
    for (int u = 0; u < kWords; ++u) store(i + u * threads, v[u]);
  }
  for (; i < n16; i += threads) store(i, __ldg(src + i));
}

// The same stores as bulk copies: thread 0 of each block stages the block's
// chunks (chunk c, c + gridDim.x, ...) in shared memory and sends each chunk
// to every peer, kBulkStages chunks in flight.
constexpr uint32_t kBulkChunk = 32 * 1024;
constexpr int kBulkStages = 4;
constexpr int kBulkSharedBytes = kBulkStages * kBulkChunk;

__global__ void __launch_bounds__(32)
    store_to_peers_bulk_kernel(void* const* peers, int nvl_rank, int num_nvl_ranks, const char* src, size_t bytes,
                               size_t dst_offset, bool include_self) {
  extern __shared__ __align__(128) char stage[];
  __shared__ __align__(8) uint64_t loaded[kBulkStages];
  if (threadIdx.x != 0) return;
  const size_t num_chunks = (bytes + kBulkChunk - 1) / kBulkChunk;
  const size_t first = blockIdx.x, step = gridDim.x;
  const int n = first < num_chunks ? static_cast<int>((num_chunks - first + step - 1) / step) : 0;
  for (int s = 0; s < kBulkStages; ++s) device::mbarrier_init(&loaded[s], 1);
  const size_t dst_base = dst_offset + nvl_rank * bytes;
  auto chunk_at = [&](int i) { return (first + i * step) * kBulkChunk; };
  auto chunk_bytes = [&](int i) {
    return static_cast<uint32_t>(min(static_cast<size_t>(kBulkChunk), bytes - chunk_at(i)));
  };
  auto load = [&](int i) {
    const int s = i % kBulkStages;
    device::mbarrier_expect_bytes(&loaded[s], chunk_bytes(i));
    device::bulk_load(stage + s * kBulkChunk, src + chunk_at(i), chunk_bytes(i), &loaded[s]);
  };
  for (int i = 0; i < n && i < kBulkStages - 1; ++i) load(i);
  for (int i = 0; i < n; ++i) {
    const int s = i % kBulkStages;
    device::mbarrier_wait(&loaded[s], (i / kBulkStages) & 1);
    for (int k = 1; k <= num_nvl_ranks; ++k) {
      const int p = (nvl_rank + k) % num_nvl_ranks;
      if (p == nvl_rank && !include_self) continue;
      device::bulk_store(static_cast<char*>(peers[p]) + dst_base + chunk_at(i), stage + s * kBulkChunk, chunk_bytes(i));
    }
    device::bulk_commit();
    // The refill's stage last held chunk i - 1, whose group must be done reading it.
    if (i + kBulkStages - 1 < n) {
      device::bulk_wait_read<1>();
      load(i + kBulkStages - 1);
    }
  }
  device::bulk_wait_all();
}

// The reverse of store_to_peers_kernel: every lane reads from the peers, kWords
// loads a peer in flight before their stores into local memory. Another GPU
// wrote the data: the loads bypass the (non-coherent) L1. Sixteen words take
// 64 registers: at most 512 threads, so that they fit.
template <int kWords>
__global__ void __launch_bounds__(kWords >= 16 ? kMaxThreads / 2 : kMaxThreads)
    load_from_peers_kernel(void* const* peers, int nvl_rank, int num_nvl_ranks, int4* dst, size_t n16,
                           size_t src_offset, bool include_self) {
  const size_t threads = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t src_index = src_offset / sizeof(int4);
  auto copy = [&](size_t i, int count) {
    for (int s = 1; s <= num_nvl_ranks; ++s) {
      const int p = (nvl_rank + s) % num_nvl_ranks;
      if (p == nvl_rank && !include_self) continue;
      const int4* src = static_cast<const int4*>(peers[p]) + src_index;
      int4 v[kWords];
#pragma unroll
      for (int u = 0; u < kWords; ++u)
        if (u < count) v[u] = __ldcv(src + i + u * threads);
#pragma unroll
      for (int u = 0; u < kWords; ++u)
        if (u < count) dst[p * n16 + i + u * threads] = v[u];
    }
  };
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  for (; i + (kWords - 1) * threads < n16; i += kWords * threads) copy(i, kWords);
  for (; i < n16; i += threads) copy(i, 1);
}

// Calls launch(std::integral_constant<int, W>) for words_in_flight W: 1, 2,
// 4, 8, or 16 where kMaxWords allows it (the ops layer checked the value).
template <int kMaxWords, typename Launch>
void with_words(int words_in_flight, Launch launch) {
  if constexpr (kMaxWords >= 16)
    if (words_in_flight == 16) return launch(std::integral_constant<int, 16>{});
  switch (words_in_flight) {
    case 8:
      return launch(std::integral_constant<int, 8>{});
    case 4:
      return launch(std::integral_constant<int, 4>{});
    case 2:
      return launch(std::integral_constant<int, 2>{});
    default:
      return launch(std::integral_constant<int, 1>{});
  }
}

}  // namespace

void launch_store_to_peers(void* const* peers, int nvl_rank, int num_nvl_ranks, const void* src, size_t bytes,
                           size_t dst_offset, bool include_self, int num_sms, int threads, int words_in_flight,
                           cudaStream_t stream) {
  if (bytes == 0) return;
  with_words<8>(words_in_flight, [&](auto words) {
    store_to_peers_kernel<decltype(words)::value><<<num_sms, threads, 0, stream>>>(
        peers, nvl_rank, num_nvl_ranks, static_cast<const int4*>(src), bytes / sizeof(int4), dst_offset, include_self);
  });
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

void launch_store_to_peers_bulk(void* const* peers, int nvl_rank, int num_nvl_ranks, const void* src, size_t bytes,
                                size_t dst_offset, bool include_self, int num_sms, cudaStream_t stream) {
  if (bytes == 0) return;
  TURNOUT_CUDA_CHECK(
      cudaFuncSetAttribute(store_to_peers_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSharedBytes));
  store_to_peers_bulk_kernel<<<num_sms, 32, kBulkSharedBytes, stream>>>(
      peers, nvl_rank, num_nvl_ranks, static_cast<const char*>(src), bytes, dst_offset, include_self);
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

void launch_load_from_peers(void* const* peers, int nvl_rank, int num_nvl_ranks, void* dst, size_t bytes,
                            size_t src_offset, bool include_self, int num_sms, int threads, int words_in_flight,
                            cudaStream_t stream) {
  if (bytes == 0) return;
  with_words<16>(words_in_flight, [&](auto words) {
    load_from_peers_kernel<decltype(words)::value><<<num_sms, threads, 0, stream>>>(
        peers, nvl_rank, num_nvl_ranks, static_cast<int4*>(dst), bytes / sizeof(int4), src_offset, include_self);
  });
  TURNOUT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace turnout::kernels
