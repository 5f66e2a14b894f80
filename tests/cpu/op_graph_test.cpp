// An op's graph: which step waits for which, and which lists of steps can
// share a graph (the parts a call cannot change on a graph made before).
#include "ops/op_graph.hpp"

#include <gtest/gtest.h>

#include <vector>

#include "ops/intranode/intranode.hpp"

namespace turnout {
namespace {

using Deps = std::vector<std::vector<int>>;

int kernel_a, kernel_b;  // stand-ins: only their addresses matter

GraphStep copy() {
  static char from[64], to[64];
  return GraphStep::copy(to, from, 64);
}
GraphStep launch(const void* func = &kernel_a, unsigned blocks = 24) {
  return GraphStep::launch({func, dim3(blocks), dim3(1024), 0}, nullptr);
}

TEST(OpGraph, CopiesSideBySideThenTheLaunchesInTurn) {
  // A staged combine where ranks share a GPU: a middle rank's two copies, the check, the data step.
  const std::vector<GraphStep> combine{copy(), copy(), launch(), launch(&kernel_b)};
  EXPECT_EQ(step_dependencies(combine), (Deps{{}, {}, {0, 1}, {2}}));
  // A landing dispatch: the launch, then its copies out, side by side.
  const std::vector<GraphStep> landing{launch(), copy(), copy()};
  EXPECT_EQ(step_dependencies(landing), (Deps{{}, {0}, {0}}));
  const std::vector<GraphStep> mixed{copy(), launch(), copy(), copy(), copy(), launch(), launch()};
  EXPECT_EQ(step_dependencies(mixed), (Deps{{}, {0}, {1}, {1}, {1}, {2, 3, 4}, {5}}));
  EXPECT_EQ(step_dependencies(std::vector<GraphStep>{launch()}), (Deps{{}}));
  EXPECT_TRUE(step_dependencies(std::vector<GraphStep>{}).empty());
}

TEST(OpGraph, ShapeIsKindsKernelsAndGridsNotArguments) {
  const std::vector<GraphStep> a{copy(), launch()};
  std::vector<GraphStep> b{copy(), launch()};
  static char elsewhere[1 << 10];
  int params = 0;
  void* args[] = {&params};
  b[0] = GraphStep::copy(elsewhere, elsewhere + 512, 512);  // other addresses and size
  b[1].args = args;
  EXPECT_TRUE(same_shape(a, b));
  EXPECT_FALSE(same_shape(a, std::vector<GraphStep>{copy(), launch(&kernel_b)}));
  EXPECT_FALSE(same_shape(a, std::vector<GraphStep>{copy(), launch(&kernel_a, 12)}));
  EXPECT_FALSE(same_shape(a, std::vector<GraphStep>{launch(), copy()}));
  EXPECT_FALSE(same_shape(a, std::vector<GraphStep>{copy(), copy(), launch()}));
  EXPECT_FALSE(same_shape(a, std::vector<GraphStep>{copy()}));
  GraphStep threads = launch();
  threads.kernel.block = dim3(512);
  EXPECT_FALSE(same_shape(a, std::vector<GraphStep>{copy(), threads}));
  GraphStep shared = launch();
  shared.kernel.shared_bytes = 1024;
  EXPECT_FALSE(same_shape(a, std::vector<GraphStep>{copy(), shared}));
}

TEST(OpGraph, RowsAroundLeaveOutTheSkippedRangeAndEmptyCopies) {
  char from[100], to[100];
  // Rows of 10 bytes: 10 rows, 3..5 skipped.
  intranode::RowCopies c = intranode::rows_around(to, from, 10, 3, 3, 10);
  ASSERT_EQ(c.count, 2);
  EXPECT_EQ(c.steps[0].dst, to);
  EXPECT_EQ(c.steps[0].src, from);
  EXPECT_EQ(c.steps[0].bytes, 30u);
  EXPECT_EQ(c.steps[1].dst, to + 60);
  EXPECT_EQ(c.steps[1].src, from + 60);
  EXPECT_EQ(c.steps[1].bytes, 40u);
  EXPECT_TRUE(c.steps[0].is_copy && c.steps[1].is_copy);
  // A range at either end, none, everything, or past the rows: one copy or none.
  c = intranode::rows_around(to, from, 10, 0, 4, 10);
  ASSERT_EQ(c.count, 1);
  EXPECT_EQ(c.steps[0].dst, to + 40);
  EXPECT_EQ(c.steps[0].bytes, 60u);
  c = intranode::rows_around(to, from, 10, 7, 3, 10);
  ASSERT_EQ(c.count, 1);
  EXPECT_EQ(c.steps[0].bytes, 70u);
  c = intranode::rows_around(to, from, 10, 0, 0, 10);
  ASSERT_EQ(c.count, 1);
  EXPECT_EQ(c.steps[0].bytes, 100u);
  EXPECT_EQ(intranode::rows_around(to, from, 10, 0, 10, 10).count, 0);
  EXPECT_EQ(intranode::rows_around(to, from, 0, 0, 0, 10).count, 0);
  c = intranode::rows_around(to, from, 10, 8, 5, 10);
  ASSERT_EQ(c.count, 1);
  EXPECT_EQ(c.steps[0].bytes, 80u);
}

}  // namespace
}  // namespace turnout
