// Rounding sizes and checking addresses: rows move as 16-byte words, buffer
// regions start on 128-byte lines.
#pragma once

#include <cuda_runtime_api.h>  // __host__ __device__ for the C++ compiler too

#include <cstdint>

namespace turnout {

__host__ __device__ constexpr int64_t align_up(int64_t n, int64_t alignment) {
  return (n + alignment - 1) / alignment * alignment;
}

// Null (no rows) counts as aligned.
inline bool is_aligned(const void* p, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

}  // namespace turnout
