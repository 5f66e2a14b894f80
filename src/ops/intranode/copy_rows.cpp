// The device-to-device copies of a landing dispatch's and a staged combine's
// rows (the runtime runs them on the SMs: benchmarks/call_costs/copy_engines).
#include <algorithm>

#include "ops/intranode/intranode.hpp"
#include "turnout/error.hpp"

namespace turnout::intranode {

RowCopies rows_around(void* to, const void* from, int64_t rows, int64_t skip_begin, int64_t skip, int64_t row_bytes) {
  const int64_t n = std::max<int64_t>(rows, 0);
  const int64_t begin = std::clamp<int64_t>(skip_begin, 0, n);
  const int64_t end = std::clamp<int64_t>(skip_begin + skip, begin, n);
  auto* dst = static_cast<char*>(to);
  const auto* src = static_cast<const char*>(from);
  RowCopies c;
  for (const auto& [first, last] : {std::pair<int64_t, int64_t>{0, begin}, {end, n}}) {
    if (last > first)
      c.steps[c.count++] = GraphStep::copy(dst + first * row_bytes, src + first * row_bytes,
                                           static_cast<size_t>((last - first) * row_bytes));
  }
  return c;
}

void copy_one_by_one(const RowCopies& copies, cudaStream_t stream) {
  for (int i = 0; i < copies.count; ++i) {
    const GraphStep& c = copies.steps[i];
    TURNOUT_CUDA_CHECK(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDeviceToDevice, stream));
  }
}

}  // namespace turnout::intranode
