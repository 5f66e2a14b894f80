// An op's copies and kernel launches enqueued as one CUDA graph, made once
// per shape and set anew each call. A launch or a copy costs the host 4-6 us
// on an H200 host; the graph's parameter updates and its one launch cost
// about half of what its steps cost one by one, and the GPU starts them
// sooner (benchmarks/call_costs/graph_updates). Copies are launches of a
// copy kernel of its own: the runtime's memcpy nodes made a 4096-token
// combine 30 us slower on the GPU, the kernel did not. Not for a stream under
// capture, nor for work whose shape changes every call.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/launch.hpp"
#include "runtime/cuda_resources.hpp"

namespace turnout {

// One step of an op: a device-to-device copy of `bytes` (> 0), or a launch
// (`args` points at each of the kernel's parameters, read when enqueued).
struct GraphStep {
  bool is_copy = false;
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
  kernels::KernelLaunch kernel;
  void** args = nullptr;

  static GraphStep copy(void* dst, const void* src, size_t bytes) { return {true, dst, src, bytes, {}, nullptr}; }
  static GraphStep launch(const kernels::KernelLaunch& k, void** args) { return {false, nullptr, nullptr, 0, k, args}; }
};

// The steps step i waits for: copies next to each other run side by side,
// so a step waits for the whole group of copies before it, else for the
// step before it.
std::vector<std::vector<int>> step_dependencies(std::span<const GraphStep> steps);

// Whether two lists of steps make the same graph: the same kinds in the same
// order, the same kernels on the same grids. Addresses, sizes and parameters
// may differ: a call sets those.
bool same_shape(std::span<const GraphStep> a, std::span<const GraphStep> b);

// Whether `stream` is under a CUDA-graph capture, where an op's graph is not for it.
bool capturing(cudaStream_t stream);

class OpGraph {
 public:
  // Enqueues the steps on `stream` (not capturing) in the order
  // step_dependencies gives them.
  void enqueue(std::span<const GraphStep> steps, cudaStream_t stream);
  // Graphs made so far (each shape once, at most kShapes kept).
  int64_t graphs_made() const { return made_; }
  void release() { built_.clear(); }

  // Shapes kept at once: an op alternates between few (one copy or two, the
  // stage's kernel or the ring's), and making one costs about 100 us.
  static constexpr size_t kShapes = 4;

 private:
  struct Built {
    std::vector<GraphStep> shape;
    std::vector<cudaGraphNode_t> nodes;
    Graph graph;  // kept: a set names each node by its handle in this graph
    GraphExec exec;
    uint64_t last_use = 0;
  };
  Built& make(std::span<const GraphStep> steps);
  bool set(Built& b, std::span<const GraphStep> steps);
  // A copy step's parameters as the copy kernel takes them, while its node is made or set.
  struct CopyArgs {
    const char* src = nullptr;
    char* dst = nullptr;
    size_t bytes = 0;
    void* args[3] = {};
  };
  // A step's kernel node: a launch's own, or a copy's as a launch of
  // kernels::copy_bytes_launch (`copy` holds its parameters).
  cudaKernelNodeParams kernel_node(const GraphStep& s, CopyArgs& copy);

  std::vector<Built> built_;
  uint64_t uses_ = 0;
  int64_t made_ = 0;
};

}  // namespace turnout
