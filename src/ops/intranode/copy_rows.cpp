// The copy-engine copies of a landing dispatch's and a staged combine's rows.
#include <algorithm>

#include "ops/intranode/intranode.hpp"
#include "turnout/error.hpp"

namespace turnout::intranode {
namespace {

void copy_range(char* to, const char* from, int64_t begin, int64_t end, int64_t row_bytes, cudaStream_t stream) {
  if (end <= begin) return;
  TURNOUT_CUDA_CHECK(cudaMemcpyAsync(to + begin * row_bytes, from + begin * row_bytes, (end - begin) * row_bytes,
                                     cudaMemcpyDeviceToDevice, stream));
}

}  // namespace

void copy_rows_around(void* to, const void* from, int64_t rows, int64_t skip_begin, int64_t skip, int64_t row_bytes,
                      cudaStream_t stream) {
  const int64_t begin = std::clamp<int64_t>(skip_begin, 0, std::max<int64_t>(rows, 0));
  const int64_t end = std::clamp<int64_t>(skip_begin + skip, begin, std::max<int64_t>(rows, 0));
  auto* dst = static_cast<char*>(to);
  const auto* src = static_cast<const char*>(from);
  copy_range(dst, src, 0, begin, row_bytes, stream);
  copy_range(dst, src, end, rows, row_bytes, stream);
}

}  // namespace turnout::intranode
