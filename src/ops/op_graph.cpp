#include "ops/op_graph.hpp"

#include <algorithm>

#include "turnout/error.hpp"

namespace turnout {
namespace {

cudaKernelNodeParams kernel_params(const GraphStep& s) {
  cudaKernelNodeParams p{};
  p.func = const_cast<void*>(s.kernel.func);
  p.gridDim = s.kernel.grid;
  p.blockDim = s.kernel.block;
  p.sharedMemBytes = static_cast<unsigned>(s.kernel.shared_bytes);
  p.kernelParams = s.args;
  return p;
}

bool same_dim(dim3 a, dim3 b) {
  return a.x == b.x && a.y == b.y && a.z == b.z;
}

}  // namespace

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TURNOUT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  return capture != cudaStreamCaptureStatusNone;
}

std::vector<std::vector<int>> step_dependencies(std::span<const GraphStep> steps) {
  std::vector<std::vector<int>> deps(steps.size());
  std::vector<int> group;  // the last copies next to each other, or the last launch
  for (size_t i = 0; i < steps.size(); ++i) {
    if (steps[i].is_copy && i > 0 && steps[i - 1].is_copy) {
      deps[i] = deps[i - 1];
    } else {
      deps[i] = group;
      group.clear();
    }
    group.push_back(static_cast<int>(i));
  }
  return deps;
}

bool same_shape(std::span<const GraphStep> a, std::span<const GraphStep> b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].is_copy != b[i].is_copy) return false;
    if (a[i].is_copy) continue;
    const kernels::KernelLaunch &x = a[i].kernel, &y = b[i].kernel;
    if (x.func != y.func || !same_dim(x.grid, y.grid) || !same_dim(x.block, y.block) ||
        x.shared_bytes != y.shared_bytes)
      return false;
  }
  return true;
}

cudaKernelNodeParams OpGraph::kernel_node(const GraphStep& s, CopyArgs& copy) {
  if (!s.is_copy) return kernel_params(s);
  copy.src = static_cast<const char*>(s.src);
  copy.dst = static_cast<char*>(s.dst);
  copy.bytes = s.bytes;
  copy.args[0] = &copy.src;
  copy.args[1] = &copy.dst;
  copy.args[2] = &copy.bytes;
  return kernel_params(GraphStep::launch(kernels::copy_bytes_launch(s.bytes), copy.args));
}

OpGraph::Built& OpGraph::make(std::span<const GraphStep> steps) {
  if (built_.size() >= kShapes) {
    auto oldest = std::min_element(built_.begin(), built_.end(),
                                   [](const Built& x, const Built& y) { return x.last_use < y.last_use; });
    built_.erase(oldest);
  }
  Built b;
  cudaGraph_t graph = nullptr;
  TURNOUT_CUDA_CHECK(cudaGraphCreate(&graph, 0));
  b.graph = Graph(graph);
  const std::vector<std::vector<int>> deps = step_dependencies(steps);
  b.nodes.resize(steps.size());
  std::vector<cudaGraphNode_t> waits;
  for (size_t i = 0; i < steps.size(); ++i) {
    waits.clear();
    for (int d : deps[i]) waits.push_back(b.nodes[d]);
    CopyArgs copy;
    const cudaKernelNodeParams p = kernel_node(steps[i], copy);
    TURNOUT_CUDA_CHECK(cudaGraphAddKernelNode(&b.nodes[i], graph, waits.data(), waits.size(), &p));
  }
  cudaGraphExec_t exec = nullptr;
  TURNOUT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  b.exec = GraphExec(exec);
  b.shape.assign(steps.begin(), steps.end());
  ++made_;
  built_.push_back(std::move(b));
  return built_.back();
}

bool OpGraph::set(Built& b, std::span<const GraphStep> steps) {
  for (size_t i = 0; i < steps.size(); ++i) {
    CopyArgs copy;
    const cudaKernelNodeParams p = kernel_node(steps[i], copy);
    if (cudaGraphExecKernelNodeSetParams(b.exec.get(), b.nodes[i], &p) != cudaSuccess) {
      // Where the runtime refuses an update, the call makes a graph of its
      // own. The refusal must not fail a later launch's error check, so it is
      // cleared (with any error the caller left pending before this call).
      (void)cudaGetLastError();
      return false;
    }
  }
  return true;
}

void OpGraph::enqueue(std::span<const GraphStep> steps, cudaStream_t stream) {
  Built* b = nullptr;
  for (Built& x : built_) {
    if (same_shape(x.shape, steps)) {
      b = &x;
      break;
    }
  }
  if (b != nullptr && !set(*b, steps)) {
    built_.erase(built_.begin() + (b - built_.data()));
    b = nullptr;
  }
  if (b == nullptr) b = &make(steps);
  b->last_use = ++uses_;
  TURNOUT_CUDA_CHECK(cudaGraphLaunch(b->exec.get(), stream));
}

}  // namespace turnout
